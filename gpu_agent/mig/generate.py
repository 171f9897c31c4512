"""`gpu-agent mig generate-config`: mig-parted's generated configs from the GPUs' own MIG profiles.

The configs are the ones `nvidia-mig-parted generate-config` (v0.15.0) prints for the same GPUs, with the
same names, entries, device filters and order, written the same way (YAML, or JSON with `-o json`):

- `all-disabled`, and `all-enabled` with no MIG devices;
- `all-<profile>` for every GPU instance profile a GPU has (compute instance profiles such as `1c.3g.40gb`
  are left out), as many as the GPU can hold, `+` in the profile written `.` in the name (`1g.10gb+me`:
  `all-1g.10gb.me`; `1g.24gb-me` keeps its `-`); GPUs that hold different numbers of one profile get
  an entry each;
- `all-balanced`: on a GPU of 7 compute slices two 1g, one 2g and one 3g instance, on one of 4 two 1g
  and one 2g, each the profile without attributes that the GPU holds most of; a GPU missing one of them,
  or of another size, gets no entry.

On a node with GPUs of more than one PCI device id, every entry has a `device-filter` naming the device
ids it is for. Names are go-nvlib's: the size in GB worked out from the profile's memory and the GPU's
(not NVML's own profile name), attributes from the NVML profile constant. The A30 is described by a
fixed table, as mig-parted does (NVML reports wrong instance counts for it).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from gpu_agent.errors import AgentError
from gpu_agent.mig.config import DeviceFilter
from gpu_agent.mig.profile import parse_profile
from gpu_agent.nvml.model import Gpu

MIB = 1024 * 1024
GIB = 1024 * MIB

# NVML_GPU_INSTANCE_PROFILE_* constants in the order go-nvlib asks for them (their values, 0 to 17), each
# with the GPU instance's compute slices and the attributes go-nvlib names it with ("-" before a negated
# one). go-nvlib v0.12.0 (vendored by mig-parted v0.15.0) does not know 3_SLICE_GFX: mig-parted fails on
# a GPU that has it; the agent names it 3g.<gb>gb+gfx, as NVML does (docs/mig.md).
GI_PROFILE_CONSTANTS: tuple[tuple[str, int, str], ...] = (
    ("1_SLICE", 1, ""), ("2_SLICE", 2, ""), ("3_SLICE", 3, ""), ("4_SLICE", 4, ""), ("7_SLICE", 7, ""),
    ("8_SLICE", 8, ""), ("6_SLICE", 6, ""), ("1_SLICE_REV1", 1, "+me"), ("2_SLICE_REV1", 2, "+me"),
    ("1_SLICE_REV2", 1, ""), ("1_SLICE_GFX", 1, "+gfx"), ("2_SLICE_GFX", 2, "+gfx"), ("4_SLICE_GFX", 4, "+gfx"),
    ("1_SLICE_NO_ME", 1, "-me"), ("2_SLICE_NO_ME", 2, "-me"), ("1_SLICE_ALL_ME", 1, "+me.all"),
    ("2_SLICE_ALL_ME", 2, "+me.all"), ("3_SLICE_GFX", 3, "+gfx"),
)
_CONSTANT_ORDER = {name: order for order, (name, _, _) in enumerate(GI_PROFILE_CONSTANTS)}
_CONSTANTS = {name: (slices, suffix) for name, slices, suffix in GI_PROFILE_CONSTANTS}

A30 = DeviceFilter(0x20B710DE)
# mig-parted's own description of the A30 (pkg/mig/discovery/discovery.go, getHardcodedA30Profiles, at
# v0.15.0): profile, compute slices, whether it has attributes, most instances.
A30_PROFILES: tuple[tuple[str, int, bool, int], ...] = (
    ("1g.6gb", 1, True, 4), ("1g.6gb+me", 1, False, 1), ("2g.12gb", 2, True, 2), ("2g.12gb+me", 2, False, 1),
    ("4g.24gb", 4, True, 1),
)

# all-balanced: the GPU's compute slices -> {GPU instance slices: count} (pkg/mig/builder/balanced.go).
BALANCED: dict[int, dict[int, int]] = {7: {1: 2, 2: 1, 3: 1}, 4: {1: 2, 2: 1}}

YAML, JSON = "yaml", "json"


class GenerateError(AgentError):
    """No config can be generated from these GPUs; says which GPU and why."""


@dataclass(frozen=True)
class Discovered:
    """One GPU instance profile of one GPU, as mig-parted's generator sees it."""

    name: str  # go-nvlib's: "1g.10gb", "1g.10gb+me", "1g.24gb-me"
    slices: int  # the GPU instance's compute slices (g)
    base: bool  # no attributes: a candidate for all-balanced
    max_count: int
    device_id: str  # "0x233010DE": the GPU's PCI device and vendor id, as device-filter writes it


def profile_gb(memory_mib: int, gpu_memory_bytes: int) -> int:
    """A profile's size in GB as go-nvlib names it: its share of the GPU's memory rounded up to an eighth,
    times the GPU's memory in whole GB rounded up, rounded half away from zero (Go's math.Round)."""
    share = (float(memory_mib) * MIB) / float(gpu_memory_bytes)
    share = math.ceil(share * 8) / 8
    size = share * float((gpu_memory_bytes + GIB - 1) // GIB)
    whole = math.floor(size)
    return int(whole + 1 if size - whole >= 0.5 else whole)


def discover(gpus: Sequence[Gpu]) -> dict[int, tuple[Discovered, ...]]:
    """The MIG profiles of each MIG-capable GPU (by index) that has any; GenerateError where none can be."""
    found: dict[int, tuple[Discovered, ...]] = {}
    capable = 0
    for gpu in gpus:
        if gpu.unreadable or not gpu.details_known:
            raise GenerateError(f"GPU {gpu.index} ({gpu.product or gpu.pci_bus_id}): cannot read its MIG profiles: "
                                f"{gpu.unreadable or 'NVML does not answer for it'}")
        if not gpu.mig.capable:
            continue
        capable += 1
        profiles = _profiles_of(gpu)
        if profiles:
            found[gpu.index] = profiles
    if not capable:
        raise GenerateError("no MIG-capable GPU on this node: there is no MIG config to generate")
    if not found:
        raise GenerateError(f"{capable} MIG-capable GPU(s) but NVML reports no MIG profile for any (drivers before "
                            "the 550 series report them only with MIG mode enabled)")
    return found


def _profiles_of(gpu: Gpu) -> tuple[Discovered, ...]:
    device_id = str(DeviceFilter(gpu.pci_device_id))
    if A30.matches(gpu.pci_device_id, gpu.pci_subsystem_id):
        return tuple(Discovered(name, slices, base, count, device_id) for name, slices, base, count in A30_PROFILES)
    memory = gpu.memory_mib * MIB
    ordered = sorted(gpu.mig.profiles, key=lambda p: _CONSTANT_ORDER.get(p.constant, len(_CONSTANT_ORDER)))
    found = []
    for profile in ordered:
        if profile.constant in _CONSTANTS:
            slices, suffix = _CONSTANTS[profile.constant]
        else:  # a constant the agent's table lacks: NVML's own name says its attributes
            parsed = parse_profile(profile.name)
            slices, suffix = parsed.g, parsed.gpu_instance[len(f"{parsed.g}g.{parsed.gb}gb"):]
        name = f"{slices}g.{profile_gb(profile.memory_mib, memory)}gb{suffix}"
        found.append(Discovered(name, slices, suffix == "", profile.instances, device_id))
    return tuple(found)


def generate(found: dict[int, tuple[Discovered, ...]]) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """The configs by name, in no order (see render), and notes on GPUs all-balanced leaves out."""
    device_ids = {p.device_id for profiles in found.values() for p in profiles}
    filtered = len(device_ids) > 1
    configs: dict[str, list[dict[str, Any]]] = {
        "all-disabled": [_entry(None, False, None)],
        "all-enabled": [_entry(None, True, {})],
    }
    balanced, notes = _balanced(found, filtered)
    if balanced:
        configs["all-balanced"] = balanced
    by_profile: dict[str, dict[str, int]] = {}  # profile -> device id -> most instances
    for index in found:
        for profile in found[index]:
            by_profile.setdefault(profile.name, {})[profile.device_id] = profile.max_count
    for name in sorted(by_profile):
        by_count: dict[int, list[str]] = {}
        for device_id, count in by_profile[name].items():
            by_count.setdefault(count, []).append(device_id)
        configs["all-" + name.replace("+", ".")] = [
            _entry(sorted(by_count[count]) if filtered else None, True, {name: count}) for count in sorted(by_count)]
    return configs, notes


def _balanced(found: dict[int, tuple[Discovered, ...]], filtered: bool) -> tuple[list[dict[str, Any]], list[str]]:
    slices: dict[str, int] = {}  # device id -> its largest GPU instance without attributes
    chosen: dict[str, dict[int, Discovered]] = {}  # device id -> slices -> the profile it holds most of
    for index in sorted(found):
        for profile in found[index]:
            if not profile.base:
                continue
            slices[profile.device_id] = max(slices.get(profile.device_id, 0), profile.slices)
            sizes = chosen.setdefault(profile.device_id, {})
            if 1 <= profile.slices <= 3 and (profile.slices not in sizes
                                             or profile.max_count > sizes[profile.slices].max_count):
                sizes[profile.slices] = profile
    entries, notes = [], []
    for device_id in sorted(chosen):
        formula = BALANCED.get(slices[device_id])
        if formula is None or any(size not in chosen[device_id] for size in formula):
            notes.append(f"GPUs {device_id}: no all-balanced entry (it needs 1g, 2g and 3g profiles without "
                         "attributes on a 7-slice GPU, 1g and 2g on a 4-slice one)")
            continue
        devices = {chosen[device_id][size].name: count for size, count in formula.items()}
        entries.append(_entry([device_id] if filtered else None, True, devices))
    return entries, notes


def _entry(device_filter: list[str] | None, enabled: bool, devices: dict[str, int] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {} if device_filter is None else {"device-filter": device_filter}
    entry.update({"devices": "all", "mig-enabled": enabled, "mig-devices": devices})
    return entry


def render(configs: dict[str, list[dict[str, Any]]], output: str = YAML) -> str:
    """The configs as mig-parted prints them: its YAML library's layout and key order, or Go's indented JSON
    (keys in byte order, no newline at the end)."""
    if output == JSON:
        document = {"version": "v1", "mig-configs": {name: [_sorted_devices(e, sorted) for e in configs[name]]
                                                     for name in sorted(configs)}}
        return json.dumps(document, indent=2)
    lines = ["version: v1", "mig-configs:"]
    for name in sorted(configs, key=_yaml_key):
        lines.append(f"  {name}:")
        for entry in configs[name]:
            fields = []
            if "device-filter" in entry:
                fields.append("device-filter: [" + ", ".join(f'"{d}"' for d in entry["device-filter"]) + "]")
            fields += [f"devices: {entry['devices']}", f"mig-enabled: {str(entry['mig-enabled']).lower()}"]
            devices = entry["mig-devices"] or {}
            fields.append("mig-devices:" + ("" if devices else " {}"))
            fields += [f"  {profile}: {devices[profile]}" for profile in sorted(devices, key=_yaml_key)]
            lines += ["  - " + fields[0]] + ["    " + field for field in fields[1:]]
    return "\n".join(lines) + "\n"


def _sorted_devices(entry: dict[str, Any], order: Any) -> dict[str, Any]:
    devices = entry["mig-devices"]
    return {**entry, "mig-devices": None if devices is None else {k: devices[k] for k in order(devices)}}


def _yaml_less(a: str, b: str) -> bool:
    """The order mig-parted's YAML library (gopkg.in/yaml.v2, sorter.go) writes string keys in: runs of
    digits compare as numbers, and digits sort before letters ("1g.5gb" < "1g.10gb", "all-7g.80gb" <
    "all-balanced")."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        x_letter, y_letter = x.isalpha(), y.isalpha()
        if x_letter and y_letter:
            return x < y
        if x_letter or y_letter:
            return y_letter
        x_number = y_number = 0
        if x == "0" or y == "0":
            j = i - 1
            while j >= 0 and a[j].isdigit():
                if a[j] != "0":
                    x_number = y_number = 1
                    break
                j -= 1
        x_end, x_number = _digits(a, i, x_number)
        y_end, y_number = _digits(b, i, y_number)
        if x_number != y_number:
            return x_number < y_number
        if x_end != y_end:
            return x_end < y_end
        return x < y
    return len(a) < len(b)


def _digits(text: str, start: int, number: int) -> tuple[int, int]:
    end = start
    while end < len(text) and "0" <= text[end] <= "9":  # ASCII only: str.isdigit() takes "²", which int() refuses
        number = number * 10 + int(text[end])
        end += 1
    return end, number


def _yaml_compare(a: str, b: str) -> int:
    return -1 if _yaml_less(a, b) else (1 if _yaml_less(b, a) else 0)


_yaml_key = functools.cmp_to_key(_yaml_compare)
