"""Integers from text go through gpu_agent/numbers.py, whatever module reads them: every int() of an argument
that looks like text (a regex group, a split or stripped string, an environment variable, a name, a
field) anywhere in the agent fails here unless it is listed below with why its digits are bounded.
Python's int() raises ValueError past 4,300 digits and takes Unicode digits, signs, spaces and
underscores; numbers.decimal takes none of them. An entry that no longer matches fails too."""
from __future__ import annotations

import ast

import pytest
from package_source import modules, nodes

from gpu_agent.numbers import MAX_DIGITS, decimal, hexadecimal, version_numbers

_TEXT_CALLS = {"group", "groups", "split", "strip", "rstrip", "lstrip", "partition", "rpartition", "decode",
               "read_text", "read", "get", "getenv"}
_TEXT_WORDS = ("text", "environ", "digit", "word", "field", "part", "value", "major", "minor", "usec", "port", "size",
               "length", "pid", "match", "found", "name", "line", "version", "string")

# (module, the call as ast.unparse writes it): why its argument's digits are bounded.
BOUNDED = {
    ("numbers.py", "int(text)"): "the bounded conversion itself: at most MAX_DIGITS ASCII digits",
    ("numbers.py", "int(text, 16)"): "the bounded conversion itself",
    ("cli/__init__.py", "int(os.environ.get('COLUMNS', '0'))"): "ValueError is caught: any other text is 0",
    ("cli/local_http.py", "int(parts[1])"): "a status code: three ASCII digits, checked above",
    ("cli/local_http.py", "int(size_text, 16)"): "ValueError is caught; base 16 converts in linear time",
    ("config/defaults.py", "int(value)"): "a float that is an integer",
    ("config/endpoint.py", "int(self.listen.rpartition(':')[2])"): "a port validated as at most 5 digits",
    ("config/endpoint.py", "int(port)"): "at most 5 ASCII digits, checked before",
    ("host/files.py", "int(match.group(2) or 0)"): "_BACKUP_SUFFIX: at most 9 digits",
    ("host/files.py", "int(found[1])"): "difflib's own hunk header",
    ("host/files.py", "int(found[3])"): "difflib's own hunk header",
    ("host/jsontext.py", "int(digits)"): "counted against max_digits before",
    ("host/mounts.py", "int(m.group(1), 8)"): "three octal digits",
    ("host/pci.py", "int(text, 16)"): "at most 64 bytes read; base 16 converts in linear time",
    ("host/pci.py", "int(text.decode('ascii', errors='replace').strip())"): "at most 32 bytes read",
    ("metrics/exporter.py", "int(value)"): "a float sample",
    ("metrics/own_process.py", "int(_read('statm').split()[1])"): "the running kernel's own numbers for this process",
    ("metrics/own_process.py", "int(fields[11])"): "the running kernel's own numbers for this process",
    ("metrics/own_process.py", "int(fields[12])"): "the running kernel's own numbers for this process",
    ("metrics/own_process.py", "int(line.split()[1])"): "the running kernel's own numbers for this process",
    ("mig/config.py", "int(m.group(1), 16)"): "_PCI_ID: at most 8 hex digits",
    ("mig/generate.py", "int(text[end])"): "one ASCII digit, checked before",
    ("mig/generate.py", "int(whole + 1 if size - whole >= 0.5 else whole)"): "a float, no text",
    ("mig/profile.py", "int(g_text)"): "_FIELDS: at most 6 digits",
    ("mig/profile.py", "int(gb_text)"): "_FIELDS: at most 6 digits",
    ("mig/profile.py", "int(c_text)"): "_FIELDS: at most 6 digits",
    ("toolkit/containerd.py", "int(version)"): "a TOML integer already, one of CRI_PLUGIN's keys",
    ("sim/fake.py", "int(rest.split('.')[0], 16)"): "the simulator's own bus ids",
    ("sim/fake.py", "int(rows.get('pending', 0))"): "the simulator's own state",
    ("sim/fake.py", "int(rows.get('failure', 0))"): "the simulator's own state",
    ("sim/fake.py", "int(gpu.get('clock_event_reasons', 1 if not gpu['processes'] else 0))"):
        "the simulator's own state",
    ("sim/machine.py", "int(match.group(3), 16)"): "_PCI_ADDRESS: at most 2 hex digits",
    ("sim/machine_file.py", "int(major)"): "validated by numbers.decimal (at most 99)",
    ("sim/machine_file.py", "int(minor)"): "validated by numbers.decimal (at most 99)",
    ("sim/replay.py", "int(match.group(1))"): "handle_of: at most 9 digits",
    ("sim/replay.py", "int(match.group(3))"): "handle_of: at most 9 digits",
    ("sim/replay.py", "int(match.group(4))"): "handle_of: at most 9 digits",
    ("sim/replay.py", "int(self.value('nvmlDeviceGetTemperature', handle, pynvml.NVML_TEMPERATURE_GPU, default=0))"):
        "a capture's JSON number, read through host/jsontext (at most 40 digits)",
}


def _texty(node: ast.AST) -> bool:
    for part in ast.walk(node):
        if isinstance(part, ast.Call) and isinstance(part.func, ast.Attribute) and part.func.attr in _TEXT_CALLS:
            return True
        ident = part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute) else None
        if ident and any(word in ident.lower() for word in _TEXT_WORDS):
            return True
    return False


def int_of_text(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "int" and bool(call.args) and _texty(call.args[0])


def test_every_int_of_text_is_bounded() -> None:
    found = set()
    for module in modules():
        for node in nodes(module.tree):
            if isinstance(node, ast.Call) and int_of_text(node):
                found.add((module.relative, ast.unparse(node)))
    unlisted = sorted(found - BOUNDED.keys())
    assert not unlisted, "convert through gpu_agent.numbers (decimal, hexadecimal, version_numbers), or bound the " \
        "digits and list it here:\n" + "\n".join(f"  {module}: {call}" for module, call in unlisted)
    assert not BOUNDED.keys() - found, f"listed but gone: {sorted(BOUNDED.keys() - found)}"


def test_the_guard_sees_ints_of_text() -> None:
    sample = ["int(match.group(1))", "int(os.environ['X'])", "int(line.split()[1])", "int(entry.name)",
              "int(text, 16)", "int(time.monotonic())", "int(state.ready)", "int(a * 2)"]
    assert [int_of_text(ast.parse(code).body[0].value) for code in sample] == [True] * 5 + [False] * 3  # type: ignore


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("42", 42), (" 7\n", 7), ("9" * MAX_DIGITS, int("9" * MAX_DIGITS)),
    ("9" * (MAX_DIGITS + 1), None), ("9" * 5000, None), ("", None), ("-1", None), ("+1", None), ("1_000", None),
    ("\u0663", None), ("\u00b2", None), ("0x10", None), ("1.0", None), ("1 2", None),
])
def test_decimal_takes_ascii_digits_only_and_not_too_many(text: str, value: object) -> None:
    assert decimal(text) == value


def test_decimal_hexadecimal_and_version_numbers_bound_what_they_convert() -> None:
    assert decimal("300", maximum=255) is None and decimal("255", maximum=255) == 255
    assert hexadecimal("0x10de") == 0x10DE and hexadecimal("10DE\n") == 0x10DE
    assert hexadecimal("f" * 5000) is None and hexadecimal("0x") is None and hexadecimal("-1") is None
    assert version_numbers("1.6.20~ds1") == (1, 6, 20) and version_numbers("v1.29.3+k3s1") == (1, 29, 3)
    assert version_numbers("2.0") == (2, 0) and version_numbers("1.2.3.4") == (1, 2, 3)
    for none in ("9" * 5000, "1." + "2" * 5000, "9" * 20 + ".1", "1", "v", "", None, "\u0661.\u0662", "x1.2"):
        assert version_numbers(none) is None, none
