"""CDI devices that more than one spec defines, across the spec directories CDI readers scan.

A CDI registry (container-device-interface pkg/cdi, read by containerd, CRI-O, Podman and Docker) reads every
*.yaml and *.json in /etc/cdi and then /var/run/cdi. The same fully qualified device (kind=name) in two
specs of one directory makes it unresolvable; in both directories the later one shadows the other, so
which spec a container gets depends on where each was written. Either way the node should hold one
definition of each device: this finds the others and names their files.
"""
from __future__ import annotations

import posixpath
from typing import Any, Iterable, Mapping

import yaml

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.paths import Root, resolve

SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # CDI's default static and dynamic directories, in its order
SUFFIXES = (".yaml", ".json")
MAX_SPEC_BYTES = 16 << 20
MAX_SPECS = 256


def device_names(spec: Any) -> set[str]:
    """`kind=name` of every device a parsed spec defines; none for what is no spec."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        return set()
    devices = spec.get("devices")
    return {f"{spec['kind']}={device['name']}" for device in devices if isinstance(device, dict)
            and isinstance(device.get("name"), str)} if isinstance(devices, list) else set()


def other_specs(root: Root, exclude: Iterable[str], directories: Iterable[str] = SPEC_DIRS) -> dict[str, set[str]]:
    """By host path (where links lead under the root), the devices of each spec file in the directories, but
    `exclude` (host paths). A file that is no readable spec defines nothing here: CDI readers skip it too."""
    skipped = {resolve(root, path) or path for path in exclude}
    found: dict[str, set[str]] = {}
    for directory in dict.fromkeys(resolve(root, d) for d in directories):
        if directory is None or not root(directory).is_dir():
            continue
        names = sorted(entry.name for entry in root(directory).iterdir() if entry.name.endswith(SUFFIXES))
        for name in names[:MAX_SPECS]:
            path = posixpath.join(directory, name)
            if path not in skipped:
                found[path] = device_names(_load(root, path))
    return found


def _load(root: Root, path: str) -> Any:
    try:
        raw = read_bounded(root(path), MAX_SPEC_BYTES, follow=False)
        return yaml.safe_load(raw) if raw is not None else None  # JSON is YAML
    except (OSError, NotRegular, TooLarge, yaml.YAMLError, RecursionError):
        return None


def duplicates(specs: Mapping[str, set[str]]) -> dict[str, list[str]]:
    """Each device more than one spec defines, with those specs' paths in the order given."""
    where: dict[str, list[str]] = {}
    for path, devices in specs.items():
        for device in devices:
            where.setdefault(device, []).append(path)
    return {device: paths for device, paths in sorted(where.items()) if len(paths) > 1}


def describe(found: Mapping[str, list[str]], most: int = 4) -> str:
    """`nvidia.com/gpu=0 and 7 more in /etc/cdi/nvidia.yaml and /var/run/cdi/nvidia.yaml`, one part per set of files."""
    by_files: dict[tuple[str, ...], list[str]] = {}
    for device, paths in found.items():
        by_files.setdefault(tuple(paths), []).append(device)
    parts = []
    for files, devices in by_files.items():
        more = f" and {len(devices) - most} more" if len(devices) > most else ""
        parts.append(f"{', '.join(devices[:most])}{more} in {' and '.join(files)}")
    return "; ".join(parts)
