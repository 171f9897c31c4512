"""mig-parted `version: v1` files: read unchanged, refused as strictly as mig-parted, every refusal naming
the file and line, the config, the entry and the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpu_agent.mig.config import DeviceFilter, MigConfigError, entry_for, load_mig_config, parse_mig_config

SHIPPED = Path(__file__).resolve().parent.parent / "packaging" / "mig.yaml"

GOOD = """\
version: v1
mig-configs:
  custom:
    - device-filter: ["0x233010DE", "0x20B210DE:0x147F10DE"]
      devices: [0, 2]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "1c.3g.40gb": 1
        "2g.20gb": 0
    - device-filter: "0x20B710DE"
      devices: all
      mig-enabled: false
    - devices: all
      mig-enabled: true
      mig-devices: {}
"""


def test_a_mig_parted_file_is_read() -> None:
    custom = parse_mig_config(GOOD, "mig.yaml").select("custom")
    first, second, third = custom
    assert first.devices == (0, 2) and first.mig_enabled
    assert first.device_filter == (DeviceFilter(0x233010DE), DeviceFilter(0x20B210DE, 0x147F10DE))
    assert first.wanted == {"1g.10gb": 2, "1c.3g.40gb": 1}
    assert second.device_filter == (DeviceFilter(0x20B710DE),) and not second.mig_enabled and second.mig_devices == ()
    assert third.mig_enabled and third.wanted == {} and third.where == "mig.yaml:14 mig-configs.custom[2]"


def test_the_last_entry_selecting_a_gpu_applies() -> None:
    entries = parse_mig_config(GOOD, "mig.yaml").select("custom")
    assert entry_for(entries, 0, 0x233010DE, 0) is entries[2]  # the catch-all comes last
    assert entry_for(entries[:2], 0, 0x233010DE, 0) is entries[0]
    assert entry_for(entries[:2], 1, 0x233010DE, 0) is None  # index 1 is not in [0, 2]
    assert entry_for(entries[:2], 0, 0x20B210DE, 0x147F10DE) is entries[0]
    assert entry_for(entries[:2], 0, 0x20B210DE, 0x134F10DE) is None  # another subsystem
    assert entry_for(entries[:2], 5, 0x20B710DE, 0) is entries[1]


def test_an_unknown_config_names_the_known_ones() -> None:
    with pytest.raises(MigConfigError, match=r"mig.yaml: no MIG config 'nope'; it has: custom"):
        parse_mig_config(GOOD, "mig.yaml").select("nope")


ENTRY = "version: v1\nmig-configs:\n  c:\n    - {}\n"


@pytest.mark.parametrize("entry, message", [
    ("devices: 3, mig-enabled: false",
     r"mig.yaml:4: mig-configs.c\[0\].devices: a bare integer is not a list of GPU indices .*write \[3\]"),
    ('devices: "some", mig-enabled: false', r"\[0\].devices: expected \"all\" or a list of GPU indices, got 'some'"),
    ("devices: [0, true], mig-enabled: false", r"\[0\].devices: True is not a GPU index"),
    ("devices: [-1], mig-enabled: false", r"\[0\].devices: -1 is not a GPU index"),
    ("mig-enabled: false", r"mig.yaml:4: mig-configs.c\[0\]: devices: missing required field"),
    ("devices: all", r"\[0\]: mig-enabled: missing required field"),
    ('devices: all, mig-enabled: "true"', r"\[0\].mig-enabled: expected true or false, got 'true'"),
    ("devices: all, mig-enabled: true", r"\[0\]: mig-devices: required when mig-enabled is true"),
    ("devices: all, mig-enabled: true, mig-devices: null", r"mig-devices: required when mig-enabled is true"),
    ('devices: all, mig-enabled: false, mig-devices: {"1g.10gb": 1}',
     r"\[0\].mig-devices: MIG devices are given but mig-enabled is false"),
    ('devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 0}', r"\[0\].mig-devices: all counts are 0"),
    ('devices: all, mig-enabled: true, mig-devices: {"1g.10gb": -1}',
     r"\[0\].mig-devices.1g.10gb: count -1 is not a whole number from 0 to 64"),
    ('devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 1.5}', r"count 1.5 is not a whole number"),
    ('devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 100000}', r"count 100000 is not a whole number"),
    ('devices: all, mig-enabled: true, mig-devices: {"10gb": 1}', r"\[0\].mig-devices.10gb: '10gb' is not \[<c>c.\]"),
    ('devices: all, mig-enabled: true, mig-devices: {"1g.10gb+me-x": 1}', r"has both '\+' and '-' attributes"),
    ('devices: all, mig-enabled: true, mig-devices: [1g.10gb]',
     r"\[0\].mig-devices: expected a mapping of MIG profile to count, got a list"),
    ('devices: all, mig-enabled: false, device-filter: "20B010DE"', r"\[0\].device-filter: '20B010DE' is not a PCI id"),
    ('devices: all, mig-enabled: false, device-filter: "0x20B010DE:0x1:0x2"', r"is not a PCI id 0xDDDDVVVV"),
    ('devices: all, mig-enabled: false, device-filter: "0x120B010DE"', r"is not a PCI id"),
    ("devices: all, mig-enabled: false, device-filter: [0x20B010DE]", r"expected a PCI id string"),
    ("devices: all, mig-enabled: false, devices-filter: x", r"\[0\].devices-filter: unexpected field"),
])
def test_a_bad_entry_names_file_line_config_entry_and_field(entry: str, message: str) -> None:
    with pytest.raises(MigConfigError, match=message):
        parse_mig_config(ENTRY.replace("{}", "{" + entry + "}"), "mig.yaml")


@pytest.mark.parametrize("text, message", [
    ("- a\n", r"mig.yaml:1: \(top level\): expected a mapping"),
    ("mig-configs: {}\n", r"version: missing"),
    ("version: v2\nmig-configs: {}\n", r"mig.yaml:1: version: unknown version 'v2'"),
    ("version: v1\nmig-configs: {}\n", r"mig-configs: at least one named config"),
    ("version: v1\nmig-configs:\n  c: []\n", r"mig.yaml:3: mig-configs.c: at least one entry is required"),
    ("version: v1\nmig-configs:\n  c:\n    devices: all\n", r"mig-configs.c: at least one entry is required, as a"),
    ("version: v1\nmig-configs:\n  c:\n    - [1]\n", r"mig.yaml:4: mig-configs.c\[0\]: an entry is a mapping"),
    ("version: v1\nextra: 1\nmig-configs: {}\n", r"mig.yaml:2: extra: unexpected field"),
    ("version: v1\nmig-configs:\n  c:\n    - devices: all\n      devices: all\n      mig-enabled: false\n",
     r"mig.yaml:5: duplicate key 'devices'"),
    ("version: v1\nmig-configs:\n  c: &a [*a]\n", r"alias \*a is inside its own anchor"),
    ("version: v1\nmig-configs:\n\tc: 1\n", r"mig.yaml:3: not valid YAML: a tab character"),
])
def test_a_bad_file_is_refused_naming_where(text: str, message: str) -> None:
    with pytest.raises(MigConfigError, match=message):
        parse_mig_config(text, "mig.yaml")


def test_files_that_are_not_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(MigConfigError, match=r"no such file"):
        load_mig_config(tmp_path / "missing.yaml")
    with pytest.raises(MigConfigError, match=r"not a regular file \(it is a directory\); -f must name a YAML file"):
        load_mig_config(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_text("version: v1\n" + "#" * 300_000)
    with pytest.raises(MigConfigError, match=r"too large"):
        load_mig_config(big)


def test_the_shipped_file_has_the_gpu_operator_names() -> None:
    shipped = load_mig_config(SHIPPED)
    for name in ("all-disabled", "all-enabled", "all-balanced", "all-1g.10gb", "all-1g.10gb.me", "all-1g.5gb.me",
                 "all-2g.12gb.me", "all-7g.141gb", "all-1g.35gb"):
        assert shipped.select(name)
    balanced = {str(f): e.wanted for e in shipped.select("all-balanced") for f in e.device_filter}
    assert balanced["0x233010DE"] == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert balanced["0x233510DE"] == {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}
    assert balanced["0x20B010DE"] == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert balanced["0x20B710DE"] == {"1g.6gb": 2, "2g.12gb": 1}


def test_an_unquoted_yaml_boolean_as_a_config_name_says_to_quote_it() -> None:
    with pytest.raises(MigConfigError) as error:
        parse_mig_config("version: v1\nmig-configs:\n  off:\n    - devices: all\n      mig-enabled: false\n", "m.yaml")
    assert str(error.value) == ("m.yaml:2: mig-configs: config name False is not a name (on, off, yes and no are "
                                "YAML booleans: quote the name)")
    assert list(parse_mig_config('version: v1\nmig-configs:\n  "off":\n    - devices: all\n'
                                 '      mig-enabled: false\n', "m.yaml").configs) == ["off"]
