"""NVIDIA devices on the PCI bus, read from sysfs: independent of the driver, so a missing or broken
driver is diagnosed as such and never mistaken for "no GPU"."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from gpu_agent.errors import HostFormatError
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
    devices = str(root("/sys/bus/pci/devices"))
    try:
        entries = sorted(entry.name for entry in os.scandir(devices))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    found = []
    for name in entries:
        entry = f"{devices}/{name}"
        try:
            vendor, device, pci_class = _ids(entry)
        except OSError:
            continue  # a device that vanished or is not readable is not ours to judge
        try:
            driver: Optional[str] = os.path.basename(os.readlink(f"{entry}/driver"))
        except OSError:  # no driver bound (or the link is not one)
            driver = None
        found.append(PciDevice(name.lower(), vendor, device, pci_class >> 8, driver))
    return PciInventory(
        gpus=tuple(d for d in found if d.vendor == NVIDIA and d.pci_class in GPU_CLASSES),
        nvswitches=tuple(d for d in found if d.vendor == NVIDIA and d.pci_class == BRIDGE_CLASS),
        mellanox_nics=tuple(d for d in found if d.vendor == MELLANOX and d.pci_class in NETWORK_CLASSES),
    )


# A device's vendor, device and class cannot change while it is on the bus: they are read again only
# when its sysfs entry is made again (hotplug, a rescan) or announces a change (a uevent), not at every
# pass. By the entry's path: its identity then, and the three numbers.
_Identity = tuple[int, int, int, Optional[tuple[int, int]]]
_known_ids: dict[str, tuple[_Identity, tuple[int, int, int]]] = {}
_KNOWN_MAX = 4096  # more PCI functions than a node has; beyond it (many roots: tests), start over


def _ids(entry: str) -> tuple[int, int, int]:
    identity = _identity(entry)
    known = _known_ids.get(entry)
    if known is not None and known[0] == identity:
        return known[1]
    ids = (_hex(entry, "vendor"), _hex(entry, "device"), _hex(entry, "class"))
    if len(_known_ids) >= _KNOWN_MAX:
        _known_ids.clear()
    _known_ids[entry] = (identity, ids)
    return ids


def _identity(entry: str) -> _Identity:
    """The entry (a symlink in sysfs, made anew when the device is), and its uevent file, written when
    the kernel announces a change of the device."""
    link = os.lstat(entry)
    try:
        uevent = os.stat(f"{entry}/uevent")
        announced: Optional[tuple[int, int]] = (uevent.st_ino, uevent.st_mtime_ns)
    except OSError:
        announced = None
    return (link.st_ino, link.st_mtime_ns, link.st_ctime_ns, announced)


def _hex(entry: str, name: str) -> int:
    """One of sysfs' hexadecimal attributes (vendor 0x10de, class 0x030200)."""
    with open(f"{entry}/{name}", "rb") as attribute:
        text = attribute.read(64).decode("ascii", errors="replace").strip()
    try:
        return int(text, 16)
    except ValueError:
        raise HostFormatError(f"/sys/bus/pci/devices/{os.path.basename(entry)}/{name}", 1, text,
                              "a hexadecimal number such as 0x10de") from None


def numa_node(root: Root, address: str) -> Optional[int]:
    """The NUMA node a PCI function hangs off, as the kernel (and so the kubelet) sees it; None where the
    kernel does not know (-1: one node, a VM) or says something else."""
    try:
        text = root(f"/sys/bus/pci/devices/{address.lower()}/numa_node").read_bytes()[:32]
        node = int(text.decode("ascii", errors="replace").strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
