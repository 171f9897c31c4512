"""The VM path of the device plugin: GPUs passed through to vfio-pci, advertised and allocated as KubeVirt's GPU
device plugin (NVIDIA/kubevirt-gpu-device-plugin) does, so KubeVirt's permittedHostDevices entries carry over.

The rule, read from its pkg/device_plugin/device_plugin.go (getDeviceName) and generic_device_plugin.go (Allocate)
at commit d26f2374d3c3f4785f52689cf954d1eea6202fb5: a resource per PCI device id, named from the PCI ids database's
entry for that id under vendor 10de, upper-cased, '/' and '.' made '_', each run of white space made '_', then
everything but letters, digits, '_' and '.' dropped, under nvidia.com/; each device is a function's PCI address;
Allocate gives /dev/vfio/vfio and /dev/vfio/<group> (mrw) and PCI_RESOURCE_NVIDIA_COM_<NAME>=<address,...>.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from gpu_agent.config.plugin import RESOURCE_PREFIX
from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.host.paths import Root

PCI_IDS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids")  # Debian's pciutils/pci.ids, RHEL's hwdata
PCI_IDS_MAX = 8 << 20
ENV_PREFIX = "PCI_RESOURCE_NVIDIA_COM_"
# The entries of the PCI ids database (its version 2025.07.11) for the GPUs the agent knows, for a node without
# the database: the same names the database gives.
KNOWN_NAMES = {0x20B0: "GA100 [A100 SXM4 40GB]", 0x20B2: "GA100 [A100 SXM4 80GB]", 0x20B7: "GA100GL [A30 PCIe]",
               0x2330: "GH100 [H100 SXM5 80GB]", 0x2335: "GH100 [H200 SXM 141GB]", 0x1EB8: "TU104GL [Tesla T4]"}
_SPACES = re.compile(r"\s+")
_OTHERS = re.compile(r"[^a-zA-Z0-9_.]+")


def kubevirt_name(entry: str) -> str:
    """A PCI ids database device name as KubeVirt's GPU device plugin makes it a resource name."""
    name = entry.strip().upper().replace("/", "_").replace(".", "_")
    return _OTHERS.sub("", _SPACES.sub("_", name))


def device_entry(pci_ids: str, device_id: int) -> Optional[str]:
    """The name under NVIDIA (10de) of `device_id` in a pci.ids text; None when it has none."""
    prefix = f"\t{device_id:04x}"
    inside = False
    for line in pci_ids.splitlines():
        if line.startswith("#"):
            continue
        if not line.startswith("\t"):
            if inside:
                return None
            inside = line.startswith("10de")
            continue
        if inside and line.startswith(prefix):
            return line[len(prefix):]
    return None


def read_pci_ids(root: Root) -> str:
    for path in PCI_IDS:
        try:
            data = read_head(root(path), PCI_IDS_MAX)
        except (OSError, NotRegular):
            continue
        if data:
            return data.decode("utf-8", errors="replace")
    return ""


def resource_for(device_id: int, pci_ids: str) -> str:
    """nvidia.com/GH100_H100_SXM5_80GB for 0x2330; the hexadecimal id where no name is known (as upstream does)."""
    entry = device_entry(pci_ids, device_id) if pci_ids else None
    entry = entry if entry is not None else KNOWN_NAMES.get(device_id)
    name = kubevirt_name(entry) if entry else ""
    return RESOURCE_PREFIX + (name or f"{device_id:04x}")


def env_name(resource: str) -> str:
    return ENV_PREFIX + resource[len(RESOURCE_PREFIX):].upper()


def allocation(resource: str, requested: Sequence[str], groups: dict[str, Optional[str]]) -> tuple[
        dict[str, str], list[str]]:
    """(envs, device node paths) for `requested` addresses of `resource`; ValueError for an address it does not
    serve or one without a group."""
    nodes: list[str] = ["/dev/vfio/vfio"]
    for address in requested:
        if address not in groups:
            raise ValueError(f"unknown device {address[:100]!r} for {resource}: this node passes through no such GPU")
        group = groups[address]
        if group is None:
            raise ValueError(f"{address} of {resource} has no IOMMU group")
        if f"/dev/vfio/{group}" not in nodes:
            nodes.append(f"/dev/vfio/{group}")
    return {env_name(resource): ",".join(requested)}, nodes


def names(device_ids: Iterable[int], pci_ids: str) -> dict[int, str]:
    return {device_id: resource_for(device_id, pci_ids) for device_id in set(device_ids)}
