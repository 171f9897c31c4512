"""mig-parted's `version: v1` config files, read unchanged and as strictly as mig-parted reads them.

    version: v1
    mig-configs:
      all-balanced:
        - device-filter: ["0x233010DE", "0x20B210DE"]   # optional: 0xDDDDVVVV[:0xSSSSssss], one or a list
          devices: all                                  # or a list of GPU indices; a bare integer is an error
          mig-enabled: true
          mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}   # required when enabled; may be {}

Every refusal names the file and line, the config, the entry and the field. The file is bounded like
the agent's own config (size, nesting, aliases: gpu_agent.config.safe_yaml).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from gpu_agent.config.safe_yaml import line_of, load_yaml
from gpu_agent.config.text import MAX_CONFIG_BYTES, read_config_text
from gpu_agent.config.section import shown
from gpu_agent.errors import ConfigError
from gpu_agent.mig.profile import ProfileName, parse_profile

MAX_DEVICES_PER_GPU = 64  # a count beyond any GPU's MIG devices: refused before anything is planned
MAX_GPU_INDEX = 1023
_PCI_ID = re.compile(r"0[xX]([0-9a-fA-F]{1,8})")
_ENTRY_KEYS = ("device-filter", "devices", "mig-enabled", "mig-devices")


class MigConfigError(ConfigError):
    """A MIG config file that cannot be used; names file:line, the config, the entry and the field."""


@dataclass(frozen=True)
class DeviceFilter:
    device: int  # 0xDDDDVVVV: device id, vendor id
    subsystem: int | None = None  # 0xSSSSssss: subsystem device id, subsystem vendor id

    def matches(self, device: int, subsystem: int) -> bool:
        return device == self.device and (self.subsystem is None or subsystem == self.subsystem)

    def __str__(self) -> str:
        text = f"0x{self.device:08X}"
        return text if self.subsystem is None else f"{text}:0x{self.subsystem:08X}"


@dataclass(frozen=True)
class MigConfigEntry:
    """One item of a config's list: which GPUs, and what they should be."""

    devices: Union[str, tuple[int, ...]]  # "all" or GPU indices
    device_filter: tuple[DeviceFilter, ...]  # empty: any GPU
    mig_enabled: bool
    mig_devices: tuple[tuple[ProfileName, int], ...]  # in the file's order; counts of 0 kept
    where: str  # file:line mig-configs.NAME[i], for messages

    def selects(self, index: int, device: int, subsystem: int) -> bool:
        if self.device_filter and not any(f.matches(device, subsystem) for f in self.device_filter):
            return False
        return self.devices == "all" or index in self.devices

    @property
    def wanted(self) -> dict[str, int]:
        """Profile -> count, without the zero counts (as mig-parted compares configs)."""
        found: dict[str, int] = {}
        for profile, count in self.mig_devices:
            if count:
                found[str(profile)] = found.get(str(profile), 0) + count
        return found


@dataclass(frozen=True)
class MigConfigFile:
    source: str
    configs: dict[str, tuple[MigConfigEntry, ...]]

    def select(self, name: str) -> tuple[MigConfigEntry, ...]:
        if name not in self.configs:
            known = ", ".join(sorted(self.configs)[:40])
            raise MigConfigError(f"{self.source}: no MIG config {shown(name)}; "
                                 + (f"it has: {known}" if known else "it has none (no mig-configs)"))
        return self.configs[name]


def entry_for(entries: tuple[MigConfigEntry, ...], index: int, device: int, subsystem: int) -> MigConfigEntry | None:
    """The entry that applies to a GPU: the last one selecting it, as mig-parted applies them in order."""
    chosen = None
    for entry in entries:
        if entry.selects(index, device, subsystem):
            chosen = entry
    return chosen


def load_mig_config(path: Path, option: str = "-f") -> MigConfigFile:
    try:
        text = read_config_text(path, option)
    except ConfigError as exc:
        raise MigConfigError(str(exc)) from None
    if text is None:
        raise MigConfigError(f"{path}: no such file")
    return _parsed(text, str(path))


def parse_mig_config(text: str, name: str) -> MigConfigFile:
    if len(text) > MAX_CONFIG_BYTES:
        raise MigConfigError(f"{name}: more than {MAX_CONFIG_BYTES} characters is too large for a MIG config")
    try:
        document, data = load_yaml(text, name)
    except ConfigError as exc:
        raise MigConfigError(str(exc)) from None
    return _Reader(name, document).file(data)


# The mig stage reads its config file every pass; the file rarely changes, its parse costs milliseconds.
# What the parse gives is immutable, and a file that fails raises again (exceptions are not cached).
_parsed = functools.lru_cache(maxsize=4)(parse_mig_config)


class _Reader:
    def __init__(self, name: str, document: yaml.Node | None) -> None:
        self.name = name
        self.document = document

    def fail(self, loc: tuple[Union[str, int], ...], reason: str) -> MigConfigError:
        line = line_of(self.document, loc)
        where = f"{self.name}:{line}" if line else self.name
        key = "".join(f"[{part}]" if isinstance(part, int) else (f".{part}" if i else str(part))
                      for i, part in enumerate(loc)) or "(top level)"
        return MigConfigError(f"{where}: {key}: {reason}")

    def file(self, data: Any) -> MigConfigFile:
        if data is None:  # mig-parted reads an empty file as a spec without configs: selecting any fails
            return MigConfigFile(self.name, {})
        if not isinstance(data, dict):
            raise self.fail((), f"expected a mapping with version and mig-configs, got {_kind(data)}")
        if "version" not in data:
            raise self.fail((), 'version: missing; mig-parted configs start with "version: v1"')
        if data["version"] != "v1":
            raise self.fail(("version",), f"unknown version {shown(data['version'])}; this reads version v1")
        for key in data:
            if key not in ("version", "mig-configs"):
                raise self.fail((str(key),), "unexpected field; a v1 file has only version and mig-configs")
        if "mig-configs" not in data:  # as mig-parted: `version: v1` alone is a spec without configs
            return MigConfigFile(self.name, {})
        configs = data["mig-configs"]
        if not isinstance(configs, dict) or not configs:
            raise self.fail(("mig-configs",), "at least one named config is required, as a mapping of name to a "
                                              f"list of entries (got {_kind(configs)})")
        read: dict[str, tuple[MigConfigEntry, ...]] = {}
        for key, entries in configs.items():
            if isinstance(key, bool):  # YAML 1.1 reads an unquoted on/off/yes/no as true or false
                raise self.fail(("mig-configs",), f"config name {shown(key)} is not a name (on, off, yes and no "
                                                  "are YAML booleans: quote the name)")
            if not isinstance(key, (str, int)) or str(key) == "":
                raise self.fail(("mig-configs",), f"config name {shown(key)} is not a name")
            config = str(key)
            if not isinstance(entries, list) or not entries:
                raise self.fail(("mig-configs", config),
                                f"at least one entry is required, as a list (got {_kind(entries)})")
            read[config] = tuple(self.entry(config, i, entry) for i, entry in enumerate(entries))
        return MigConfigFile(self.name, read)

    def entry(self, config: str, index: int, data: Any) -> MigConfigEntry:
        loc: tuple[Union[str, int], ...] = ("mig-configs", config, index)
        if not isinstance(data, dict):
            raise self.fail(loc, f"an entry is a mapping of {', '.join(_ENTRY_KEYS)}; got {_kind(data)}")
        for key in data:
            if key not in _ENTRY_KEYS:
                raise self.fail(loc + (str(key),), f"unexpected field; an entry has {', '.join(_ENTRY_KEYS)}")
        for required in ("devices", "mig-enabled"):
            if required not in data:
                raise self.fail(loc, f"{required}: missing required field")
        enabled = data["mig-enabled"]
        if not isinstance(enabled, bool):
            raise self.fail(loc + ("mig-enabled",), f"expected true or false, got {shown(enabled)}")
        mig_devices = self.mig_devices(loc, data.get("mig-devices"), enabled, "mig-devices" in data)
        line = line_of(self.document, loc)
        where = f"{self.name}:{line}" if line else self.name
        return MigConfigEntry(
            devices=self.devices(loc + ("devices",), data["devices"]),
            device_filter=self.device_filter(loc + ("device-filter",), data.get("device-filter")),
            mig_enabled=enabled,
            mig_devices=mig_devices,
            where=f"{where} mig-configs.{config}[{index}]",
        )

    def devices(self, loc: tuple[Union[str, int], ...], value: Any) -> Union[str, tuple[int, ...]]:
        if value == "all":
            return "all"
        if isinstance(value, int) and not isinstance(value, bool):
            raise self.fail(loc, f"a bare integer is not a list of GPU indices (mig-parted refuses it too); "
                                 f"write [{value}]")
        if not isinstance(value, list):
            raise self.fail(loc, f'expected "all" or a list of GPU indices, got {shown(value)}')
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_GPU_INDEX:
                raise self.fail(loc, f"{shown(item)} is not a GPU index (0 to {MAX_GPU_INDEX})")
        return tuple(value)

    def device_filter(self, loc: tuple[Union[str, int], ...], value: Any) -> tuple[DeviceFilter, ...]:
        if value is None or value == "":
            return ()
        items = value if isinstance(value, list) else [value]
        found = []
        for item in items:
            if not isinstance(item, str):
                raise self.fail(loc, f"expected a PCI id string such as \"0x20B010DE\" or a list of them, "
                                     f"got {shown(item)}")
            found.append(self.pci_id(loc, item))
        return tuple(found)

    def pci_id(self, loc: tuple[Union[str, int], ...], text: str) -> DeviceFilter:
        parts = text.split(":")
        matches = [_PCI_ID.fullmatch(part) for part in parts]
        if len(parts) > 2 or not all(matches):
            raise self.fail(loc, f"{shown(text)} is not a PCI id 0xDDDDVVVV (device and vendor) with an optional "
                                 ":0xSSSSssss subsystem, such as 0x20B010DE or 0x20B010DE:0x134F10DE")
        numbers = [int(m.group(1), 16) for m in matches if m is not None]
        return DeviceFilter(numbers[0], numbers[1] if len(numbers) == 2 else None)

    def mig_devices(self, loc: tuple[Union[str, int], ...], value: Any, enabled: bool,
                    present: bool) -> tuple[tuple[ProfileName, int], ...]:
        here = loc + ("mig-devices",)
        if enabled and (not present or value is None):
            raise self.fail(loc, "mig-devices: required when mig-enabled is true (write {} for no MIG devices)")
        if not present or value is None:
            return ()
        if not isinstance(value, dict):
            raise self.fail(here, f"expected a mapping of MIG profile to count, got {_kind(value)}")
        if not enabled and value:
            raise self.fail(here, "MIG devices are given but mig-enabled is false")
        read = []
        for profile, count in value.items():
            if not isinstance(profile, str):
                raise self.fail(here, f"{shown(profile)} is not a MIG profile such as 3g.40gb")
            try:
                parsed = parse_profile(profile)
            except ValueError as exc:
                raise self.fail(here + (profile,), str(exc)) from None
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_DEVICES_PER_GPU:
                raise self.fail(here + (profile,), f"count {shown(count)} is not a whole number from 0 to "
                                                   f"{MAX_DEVICES_PER_GPU}")
            read.append((parsed, count))
        if read and not any(count for _, count in read):
            raise self.fail(here, "all counts are 0; give at least one MIG device, or write {}")
        return tuple(read)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {list: "a list", dict: "a mapping", str: "a string", int: "a number", float: "a number",
            bool: "true or false"}.get(type(value), type(value).__name__)
