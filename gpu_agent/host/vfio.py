"""PCI functions' drivers and IOMMU groups in sysfs, and the writes that move a function between drivers
(driver_override, a driver's unbind and bind, drivers_probe): what a VFIO passthrough reads and changes."""
from __future__ import annotations

import os
import re
from typing import Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.host.paths import Root
from gpu_agent.numbers import hexadecimal

DEVICES = "/sys/bus/pci/devices"
DRIVERS = "/sys/bus/pci/drivers"
GROUPS = "/sys/kernel/iommu_groups"
PROBE = "/sys/bus/pci/drivers_probe"
VFIO_DEVICES = "/dev/vfio"
BRIDGE_CLASS = 0x0604  # PCI-to-PCI bridges (pcieport) stay with the host: vfio needs only endpoints
_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_DRIVER = re.compile(r"[A-Za-z0-9_-]{1,64}")


def pci_address(bus_id: str) -> str:
    """00000000:9A:00.0 (NVML) or 0000:9a:00.0 to sysfs' 0000:9a:00.0."""
    domain, rest = bus_id.split(":", 1)
    return f"{domain[-4:]}:{rest}".lower()


def _link_name(root: Root, path: str) -> Optional[str]:
    try:
        return os.path.basename(os.readlink(root(path)))
    except OSError:
        return None


def driver_of(root: Root, address: str) -> Optional[str]:
    return _link_name(root, f"{DEVICES}/{address}/driver")


def group_of(root: Root, address: str) -> Optional[str]:
    """The function's IOMMU group; None without an IOMMU (no iommu_group link)."""
    group = _link_name(root, f"{DEVICES}/{address}/iommu_group")
    return group if group is not None and group.isdigit() else None


def override_of(root: Root, address: str) -> str:
    """driver_override, "" for the kernel's (null) or where there is none."""
    try:
        data = read_head(root(f"{DEVICES}/{address}/driver_override"), 128)
    except (OSError, NotRegular):
        return ""
    text = (data or b"").decode("ascii", errors="replace").strip()
    return "" if text == "(null)" else text


def group_members(root: Root, group: str) -> list[str]:
    """The endpoint functions of an IOMMU group, in address order (bridges left out)."""
    try:
        names = sorted(entry.name for entry in os.scandir(root(f"{GROUPS}/{group}/devices")))
    except OSError:
        return []
    return [name for name in names if _ADDRESS.fullmatch(name) and _class(root, name) >> 8 != BRIDGE_CLASS]


def vendor_of(root: Root, address: str) -> Optional[int]:
    return _hex(root, address, "vendor")


def _class(root: Root, address: str) -> int:
    return _hex(root, address, "class") or 0


def _hex(root: Root, address: str, name: str) -> Optional[int]:
    try:
        data = read_head(root(f"{DEVICES}/{address}/{name}"), 32)
    except (OSError, NotRegular):
        return None
    return hexadecimal((data or b"").decode("ascii", errors="replace"))


def driver_present(root: Root, driver: str) -> bool:
    return root(f"{DRIVERS}/{driver}").is_dir()


def group_node(root: Root, group: str) -> bool:
    return os.path.exists(root(f"{VFIO_DEVICES}/{group}"))


def override_path(address: str) -> str:
    return f"{DEVICES}/{address}/driver_override"


def driver_file(driver: str, action: str) -> str:
    """/sys/bus/pci/drivers/<driver>/bind or unbind; drivers_probe for bind with no driver named."""
    if not driver and action == "bind":
        return PROBE
    if not _DRIVER.fullmatch(driver):
        raise AgentError(f"{driver!r} is no kernel driver name")
    return f"{DRIVERS}/{driver}/{action}"


class PciControl(Protocol):
    def write(self, path: str, value: str) -> None:
        """Write one PCI sysfs attribute; OSError where the kernel refuses."""


class SysfsPci:
    """The running kernel's PCI attributes, written in place (sysfs takes one write, never a rename). Only for
    --root / : a sandbox root's sysfs is not a kernel's."""

    def __init__(self, root: Root) -> None:
        self.root = root

    def write(self, path: str, value: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"refusing to write {path} of the running kernel while --root is {self.root.path}")
        with open(self.root(path), "w", encoding="ascii") as handle:
            handle.write(value)
