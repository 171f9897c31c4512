"""The current MIG geometry as a mig-parted `version: v1` config (`gpu-agent mig export`), so that
applying it changes nothing."""
from __future__ import annotations

from typing import Any, Sequence, Union

import yaml

from gpu_agent.nvml.model import Gpu


def geometry(gpu: Gpu) -> tuple[bool, tuple[tuple[str, int], ...]]:
    """(MIG enabled, MIG device profile -> count) of a GPU, as mig-parted counts them."""
    counts: dict[str, int] = {}
    for device in gpu.mig.devices if gpu.mig.enabled else ():
        counts[device.profile] = counts.get(device.profile, 0) + 1
    return gpu.mig.enabled, tuple(sorted(counts.items()))


def export(gpus: Sequence[Gpu], name: str) -> str:
    """One entry per distinct geometry, `devices: all` when every GPU has the same one."""
    groups: dict[tuple[bool, tuple[tuple[str, int], ...]], list[int]] = {}
    for gpu in gpus:
        groups.setdefault(geometry(gpu), []).append(gpu.index)
    entries = []
    for (enabled, devices), indices in groups.items():
        selected: Union[str, list[int]] = "all" if len(groups) == 1 else indices
        entry: dict[str, Any] = {"devices": selected, "mig-enabled": enabled}
        if enabled:
            entry["mig-devices"] = dict(devices)
        entries.append(entry)
    return yaml.safe_dump({"version": "v1", "mig-configs": {name: entries}}, sort_keys=False,
                          default_flow_style=None)
