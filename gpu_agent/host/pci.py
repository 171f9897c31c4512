"""NVIDIA devices on the PCI bus, read from sysfs: independent of the driver, so a missing or broken
driver is diagnosed as such and never mistaken for "no GPU"."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from gpu_agent.errors import HostFormatError
from gpu_agent.host.bounded import NotRegular, read_head
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


def _head(path: Union[str, Path], size: int) -> bytes:
    """The first `size` bytes of a sysfs attribute; OSError where it is missing or not a regular file."""
    try:
        data = read_head(path, size)
    except NotRegular as exc:
        raise OSError(errno.EINVAL, f"it is {exc.kind}", str(path)) from None
    if data is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    return data


def _hex(entry: str, name: str) -> int:
    """One of sysfs' hexadecimal attributes (vendor 0x10de, class 0x030200)."""
    text = _head(f"{entry}/{name}", 64).decode("ascii", errors="replace").strip()
    try:
        return int(text, 16)
    except ValueError:
        raise HostFormatError(f"/sys/bus/pci/devices/{os.path.basename(entry)}/{name}", 1, text,
                              "a hexadecimal number such as 0x10de") from None


def numa_node(root: Root, address: str) -> Optional[int]:
    """The NUMA node a PCI function hangs off, as the kernel (and so the kubelet) sees it; None where the
    kernel does not know (-1: one node, a VM) or says something else."""
    try:
        text = _head(root(f"/sys/bus/pci/devices/{address.lower()}/numa_node"), 32)
        node = int(text.decode("ascii", errors="replace").strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pci_class(root: Root, address: str) -> Optional[int]:
    """The function's class code, all 24 bits (0x030200); None where it cannot be read."""
    try:
        return _hex(str(root(f"/sys/bus/pci/devices/{address.lower()}")), "class") & 0xFFFFFF
    except (OSError, HostFormatError):
        return None


@dataclass(frozen=True)
class Vgpu:
    """What the vGPU capability in a GPU's PCI config space says, read as GFD's internal/vgpu reads it."""

    present: bool  # the vendor-specific capability carries the vGPU signature "VF": a vGPU guest
    host_driver_version: str = ""  # of the vGPU manager on the hypervisor ("460.16"); "" where not recorded
    host_driver_branch: str = ""  # "r460_00"


_STATUS, _CAPABILITY_LIST, _VENDOR_SPECIFIC = 0x06, 0x34, 0x09
_RECORDS, _FIELD = 5, 10  # GFD's VGPUCapabilityRecordStart; HostDriverVersionLength and ...BranchLength


def vgpu(root: Root, address: str) -> Optional[Vgpu]:
    """The vGPU capability of the GPU at `address`; None where its config space cannot be read whole (GFD
    then writes no vgpu labels: 'run GFD with privileged mode to read complete PCI configuration data')."""
    try:
        return vgpu_of(_head(root(f"/sys/bus/pci/devices/{address.lower()}/config"), 256))
    except OSError:
        return None


def vgpu_of(config: bytes) -> Optional[Vgpu]:
    """GFD's GetVendorSpecificCapability, IsVGPUDevice and GetInfo on the first 256 bytes of config space:
    the first vendor-specific capability (id 9) in the capability list; a vGPU when it is signed 'VF'; then
    its records from offset 5, each [id, length, ...], until record 0, which holds the host driver's
    version and branch, 10 NUL-padded bytes each. A list that loops or breaks (id 0xff) ends the walk."""
    if len(config) < 256:
        return None
    capability = b""
    position, visited = config[_CAPABILITY_LIST] if config[_STATUS] & 0x10 else 0, set()
    while position and position not in visited and config[position] != 0xFF:
        if config[position] == _VENDOR_SPECIFIC:
            capability = config[position:position + config[(position + 2) & 0xFF]]
            break
        visited.add(position)
        position = config[(position + 1) & 0xFF]
    if len(capability) < 5 or capability[3:5] != b"VF":
        return Vgpu(False)
    position, record = _RECORDS, capability[_RECORDS] if len(capability) > _RECORDS else 0
    while record != 0 and position + 1 < len(capability) and capability[position + 1]:  # a 0 length: GFD spins
        position += capability[position + 1]
        record = capability[position] if position < len(capability) else 0
    start = position + 2
    if record != 0 or start + 2 * _FIELD > len(capability):
        return Vgpu(True)  # GFD fails the labeling pass here ("cannot find driver version record")
    version, branch = capability[start:start + _FIELD], capability[start + _FIELD:start + 2 * _FIELD]
    return Vgpu(True, *(field.strip(b"\0").decode("ascii", "replace") for field in (version, branch)))
