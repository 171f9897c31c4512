"""NVIDIA devices on the PCI bus, read from sysfs: independent of the driver, so a missing or broken
driver is diagnosed as such and never mistaken for "no GPU"."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from gpu_agent.host.paths import Root

NVIDIA = 0x10DE
MELLANOX = 0x15B3
GPU_CLASSES = (0x0300, 0x0302, 0x0380)  # VGA, 3D controller, other display controller
BRIDGE_CLASS = 0x0680  # NVSwitch reports itself as an "other bridge"
NETWORK_CLASSES = (0x0200, 0x0207)  # Ethernet, InfiniBand


@dataclass(frozen=True)
class PciDevice:
    address: str  # 0000:18:00.0
    vendor: int
    device: int
    pci_class: int  # base class and subclass, e.g. 0x0302
    driver: Optional[str] = None  # the kernel driver bound to it: nvidia, nouveau, vfio-pci


@dataclass(frozen=True)
class PciInventory:
    gpus: tuple[PciDevice, ...]
    nvswitches: tuple[PciDevice, ...]
    mellanox_nics: tuple[PciDevice, ...]


def scan(root: Root) -> PciInventory:
    devices = root("/sys/bus/pci/devices")
    found = []
    for entry in sorted(devices.iterdir()) if devices.is_dir() else ():
        try:
            vendor = int((entry / "vendor").read_text(), 16)
            device = int((entry / "device").read_text(), 16)
            pci_class = int((entry / "class").read_text(), 16) >> 8
        except (OSError, ValueError):
            continue  # a device that vanished or is not readable is not ours to judge
        bound = entry / "driver"
        driver = os.path.basename(os.readlink(bound)) if bound.is_symlink() else None
        found.append(PciDevice(entry.name.lower(), vendor, device, pci_class, driver))
    return PciInventory(
        gpus=tuple(d for d in found if d.vendor == NVIDIA and d.pci_class in GPU_CLASSES),
        nvswitches=tuple(d for d in found if d.vendor == NVIDIA and d.pci_class == BRIDGE_CLASS),
        mellanox_nics=tuple(d for d in found if d.vendor == MELLANOX and d.pci_class in NETWORK_CLASSES),
    )
