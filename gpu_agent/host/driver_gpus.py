"""The GPUs the nvidia kernel module attached, as /proc/driver/nvidia/gpus/<bus id>/information describes
them: their device minor, and for a GPU NVML cannot read (fallen off the bus), what the driver still
knows of it (its UUID and model)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from gpu_agent.host.paths import Root
from gpu_agent.host.procfs import MAX_MINOR, parse_key_values, read

GPUS_DIR = "/proc/driver/nvidia/gpus"
_UUID = re.compile(r"GPU-[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")


@dataclass(frozen=True)
class DriverGpu:
    bus_id: str  # 0000:18:00.0, as the kernel writes it
    uuid: Optional[str]  # None where the file has no UUID in NVIDIA's form (one the driver never read)
    model: str  # "NVIDIA H100 80GB HBM3", as NVML names it
    minor: Optional[int]  # /dev/nvidia<minor>
    excluded: bool  # NVreg_ExcludedGpus: attached, but NVML does not count it


def driver_gpus(root: Root) -> list[DriverGpu]:
    """Every GPU the driver lists, in PCI bus order; none where the driver is not loaded. A file that is
    not `Key: value` lines raises HostFormatError naming it."""
    try:
        addresses = sorted(os.listdir(root(GPUS_DIR)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for address in addresses:
        path = f"{GPUS_DIR}/{address}/information"
        info = parse_key_values(path, read(root, path) or "")
        uuid = info.get("GPU UUID", "")
        found.append(DriverGpu(
            bus_id=address.lower(),
            uuid=uuid if _UUID.fullmatch(uuid) else None,
            model=info.get("Model", ""),
            minor=info.integer("Device Minor", 0, MAX_MINOR) if "Device Minor" in info else None,
            excluded=info.get("GPU Excluded", "").lower() == "yes",
        ))
    return found
