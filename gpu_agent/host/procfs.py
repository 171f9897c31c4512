"""Parsers for what the kernel and the NVIDIA driver write under /proc and /sys, in every format
real nodes show (see ../shared/hardware). Each takes the host path, for its messages, and the text.

A line that cannot be read raises HostFormatError naming the file, the line and what was expected.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from gpu_agent.errors import HostFormatError
from gpu_agent.host.bounded import read_text
from gpu_agent.numbers import decimal
from gpu_agent.host.paths import Root


MAX_PROC_BYTES = 4 << 20  # /proc/modules of a busy kernel is tens of KiB


def read(root: Root, host_path: str) -> Optional[str]:
    """A kernel or driver file's text; None when it does not exist. Bytes that are not UTF-8 are
    replaced, so they fail the parser with its message instead of a decoding error."""
    return read_text(root(host_path), host_path, MAX_PROC_BYTES, errors="replace",
                     why_limit=", not what the kernel writes there")


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id(root: Root) -> Optional[str]:
    """This boot's id (a new one at every boot); None where the kernel does not say."""
    text = read(root, BOOT_ID)
    return text.strip() or None if text is not None else None


# Linux's dev_t: 12 bits of major, 20 of minor (MINORBITS); values past them cannot name a device node.
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1
MAX_MODE = 0o7777
UINT32_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class LoadedModule:
    name: str
    refcnt: Optional[int]  # None where the kernel cannot unload modules and writes "-"
    holders: tuple[str, ...]


def parse_modules(path: str, text: str) -> dict[str, LoadedModule]:
    """/proc/modules: `name size refcount holders state address [taint]`.

    A kernel built without CONFIG_MODULE_UNLOAD writes `-` for refcount and holders; holders are
    comma-separated with a trailing comma, or `-` when there are none.
    """
    modules = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        refcnt = decimal(fields[2]) if len(fields) >= 4 else None
        if len(fields) < 4 or decimal(fields[1]) is None or not (fields[2] == "-" or refcnt is not None):
            raise HostFormatError(path, number, line, "name, size, refcount (a number or -), holders, state, address")
        holders = tuple(h for h in fields[3].split(",") if h and h != "-")
        modules[fields[0]] = LoadedModule(fields[0], refcnt, holders)
    return modules


def parse_char_majors(path: str, text: str) -> dict[str, int]:
    """/proc/devices: character device majors by driver name. One major may carry several names
    (the nvidia driver registers both `nvidia` and `nvidiactl` on 195)."""
    majors: dict[str, int] = {}
    section = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.endswith("devices:"):
            section = stripped
            continue
        text, _, name = stripped.partition(" ")
        major = decimal(text, MAX_MAJOR)
        if section is None or major is None or not name.strip():
            raise HostFormatError(path, number, line, "a 'Character devices:' or 'Block devices:' heading, "
                                  f"or a major number (0 to {MAX_MAJOR}) and a driver name")
        if section == "Character devices:":
            majors.setdefault(name.strip(), major)
    return majors


@dataclass(frozen=True)
class DriverVersion:
    version: str
    open_module: bool  # NVIDIA's open kernel module (Turing and newer) rather than the proprietary one

    @property
    def flavour(self) -> str:
        return "open kernel module" if self.open_module else "proprietary kernel module"


_NVRM = re.compile(r"NVRM version: NVIDIA UNIX (?P<kind>.*?Kernel Module(?: for \S+)?)\s+(?P<version>\d+(?:\.\d+)+)\b")


def parse_driver_version(path: str, text: str) -> DriverVersion:
    """/proc/driver/nvidia/version, whose first line is one of
    `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (...)` or
    `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024`."""
    lines = text.splitlines()
    first = lines[0] if lines else ""
    match = _NVRM.match(first.strip())
    if match is None:
        raise HostFormatError(path, 1, first, "'NVRM version: NVIDIA UNIX ... Kernel Module  <version>  ...'")
    return DriverVersion(match["version"], "Open Kernel Module" in match["kind"])


class KeyValues(dict[str, str]):
    """parse_key_values' result: the pairs, and where each came from, for messages."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.lines: dict[str, tuple[int, str]] = {}

    def integer(self, key: str, default: int, maximum: int = UINT32_MAX) -> int:
        """A decimal value from 0 to `maximum`; anything else is a HostFormatError naming its line."""
        if key not in self:
            return default
        value = decimal(self[key], maximum)
        if value is None:
            number, line = self.lines[key]
            raise HostFormatError(self.path, number, line, f"{key} to be a decimal number from 0 to {maximum}")
        return value


def parse_key_values(path: str, text: str) -> KeyValues:
    """`Key: value` lines (the driver's params, capabilities and GPU information files). Values may be
    empty or quoted (`RegistryDwords: ""`); quotes are removed."""
    pairs = KeyValues(path)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, colon, value = line.partition(":")
        if not colon or not key.strip():
            raise HostFormatError(path, number, line, "'Key: value'")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        pairs[key.strip()] = value
        pairs.lines[key.strip()] = (number, line)
    return pairs
