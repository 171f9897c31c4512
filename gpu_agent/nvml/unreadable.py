"""What is known of a GPU NVML cannot read (fallen off the bus: GPU_IS_LOST; a query that fails Unknown, Timeout,
NotSupported...), so that it is one GPU's fact and never an inventory that hides the others.

Its record is, in this order of trust:
- its last reading at the same index (the daemon's), as long as nothing says the index now names another GPU:
  the bus id or UUID NVML still answers, the bus id the driver lists at that index, a GPU read now at that
  bus id;
- else its identity alone: UUID, bus id, product and device minor from what NVML still answers of it, the rest
  from the driver's /proc/driver/nvidia/gpus/<bus id>/information (found by that bus id or UUID, or as the
  driver's GPU at that index: NVML counts the GPUs the driver attached and did not exclude, in PCI bus order,
  trusted only where every GPU read now sits at its index in that list);
- else nothing but its index and why (UnidentifiedGpu).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from gpu_agent.host.driver_gpus import DriverGpu
from gpu_agent.host.paths import Root
from gpu_agent.host.pci import numa_node, pci_class, vgpu
from gpu_agent.nvml.model import IDENTITY, LAST_READING, Gpu, MigState, UnidentifiedGpu


@dataclass(frozen=True)
class Unread:
    """A GPU NVML did not read whole: its index, why, and what NVML still answered of its identity."""

    index: int
    reason: str
    uuid: Optional[str] = None
    bus_id: Optional[str] = None
    product: Optional[str] = None
    minor: Optional[int] = None


def stand_ins(unread: Sequence[Unread], read: Mapping[int, Gpu], last: Mapping[int, Gpu],
              driver: Sequence[DriverGpu], root: Optional[Root]) -> tuple[list[Gpu], list[UnidentifiedGpu]]:
    """The records of the GPUs in `unread` (read: those NVML read now, by index; last: the last reading of
    each index; driver: the driver's GPUs, in bus order), and those nothing names."""
    claimed = {gpu.pci_bus_id for gpu in read.values()}
    attached = [gpu for gpu in driver if not gpu.excluded]
    in_order = len(attached) == len(read) + len(unread) and all(
        attached[index].bus_id == gpu.pci_bus_id for index, gpu in read.items())
    by_bus = {gpu.bus_id: gpu for gpu in driver}
    by_uuid = {gpu.uuid: gpu for gpu in driver if gpu.uuid}
    records: list[Gpu] = []
    unnamed: list[UnidentifiedGpu] = []
    for gpu in unread:
        found = by_bus.get(gpu.bus_id or "") or by_uuid.get(gpu.uuid or "")
        if found is None and gpu.bus_id is None and in_order:
            found = attached[gpu.index]
        bus_id = gpu.bus_id or (found.bus_id if found else None)
        previous = last.get(gpu.index)
        if previous is not None and previous.pci_bus_id not in claimed and bus_id in (None, previous.pci_bus_id) \
                and gpu.uuid in (None, previous.uuid):
            records.append(replace(previous, unreadable=gpu.reason, known_from=LAST_READING))
            continue
        identity = _identity(gpu, found)
        if identity is not None and identity.pci_bus_id not in claimed:
            records.append(_with_sysfs(identity, root))
        else:
            unnamed.append(UnidentifiedGpu(gpu.index, gpu.reason))
    return records, unnamed


def _identity(gpu: Unread, found: Optional[DriverGpu]) -> Optional[Gpu]:
    """Its UUID, bus id, product and device minor, NVML's answers first; None where one of them is unknown."""
    uuid = gpu.uuid or (found.uuid if found else None)
    bus_id = gpu.bus_id or (found.bus_id if found else None)
    product = gpu.product or (found.model if found else None)
    minor = gpu.minor if gpu.minor is not None else found.minor if found else None
    if not (uuid and bus_id and product) or minor is None:
        return None
    return Gpu(index=gpu.index, uuid=uuid, pci_bus_id=bus_id, product=product, memory_mib=0,
               compute_capability=(0, 0), minor_number=minor, mig=MigState(capable=False), unreadable=gpu.reason,
               known_from=IDENTITY)


def _with_sysfs(gpu: Gpu, root: Optional[Root]) -> Gpu:
    """What sysfs says of it at its bus id, which needs no NVML: its NUMA node, PCI class and vGPU capability."""
    if root is None:
        return gpu
    bus_id = gpu.pci_bus_id
    return replace(gpu, numa_node=numa_node(root, bus_id), pci_class=pci_class(root, bus_id), vgpu=vgpu(root, bus_id))
