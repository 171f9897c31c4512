"""GetPreferredAllocation as NVIDIA's device plugin v0.20 answers it: whole GPUs by topology
(preferred.py), replicas and MIG devices by the shared-devices allocation policy
(`plugin.shared_devices_allocation_policy`), here.

A shared device belongs to a unit, the GPU or MIG device it gives (a replica `<uuid>::<n>` without its
`::<n>`). A unit's load is how many of its devices the resource advertises but the request cannot have:
allocated (not in `available`), in `must_include`, unhealthy, or picked already. Devices are picked one
at a time, each from the best unit:

1. by the policy, on the unit's load: `distributed` the least loaded, `packed` the most loaded;
2. then the unit this request has picked from least, so that `distributed` spreads one request over
   units whose loads tie;

which are NVIDIA's rules; where they tie, NVIDIA's plugin takes whichever its sort leaves first, and the
agent decides, so that the same request always gets the same answer:

3. the GPU's load (the units on one GPU: a MIG device's GPU), by the policy again: `distributed` spreads
   MIG devices over GPUs, `packed` fills the busiest GPU first;
4. the GPU best connected to the devices chosen so far (NVLink, NUMA node, PCIe: preferred.py's scores);
5. the lowest GPU index, then the unit's place in the resource's list, then the replica number.

A request for more devices than the resource has free, beyond those it must include, is refused
(NotEnoughDevices), as NVIDIA's plugin refuses it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from gpu_agent.nvml.model import Inventory
from gpu_agent.plugin.devices import REPLICA_SEPARATOR, PluginDevice, Resource
from gpu_agent.plugin.preferred import Links, preferred

POLICIES = ("distributed", "packed")


class NotEnoughDevices(Exception):
    """The request asks for more devices than are free: the message goes back to the kubelet."""


def preferred_allocation(resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int,
                         policy: str, topology: Optional[Inventory]) -> list[str]:
    """The devices to offer: by topology where the resource is whole GPUs and `available` holds no
    replica (NVIDIA's aligned allocation), else by the shared-devices policy."""
    whole_gpus = all(device.uuid == device.gpu_uuid for device in resource.devices)
    if whole_gpus and not any(REPLICA_SEPARATOR in device_id for device_id in available):
        return preferred(available, must_include, size, topology)
    return shared_preferred(resource.devices, available, must_include, size, policy, Links(topology))


def shared_preferred(devices: Sequence[PluginDevice], available: Sequence[str], must_include: Sequence[str],
                     size: int, policy: str, links: Links) -> list[str]:
    """`must_include`, then the devices the policy picks from the rest of `available`, in the order picked.
    `devices`: every device of the resource (what is not available counts as load)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown shared devices allocation policy {policy!r}")
    required = list(dict.fromkeys(must_include))
    advertised = {device.id: device for device in devices}
    excluded = set(required)
    candidates = [advertised[i] for i in dict.fromkeys(available) if i in advertised and i not in excluded]
    needed = size - len(required)
    if len(candidates) < needed:
        raise NotEnoughDevices(f"not enough available devices to satisfy allocation: {size} asked for, "
                               f"{len(required)} of them must-include, {len(candidates)} other devices available")
    if needed <= 0:
        return required
    return required + _Picker(devices, candidates, required, policy, links).pick(needed)


class _Picker:
    """The picks, one at a time; per pick, work in proportion to the units with a free device and the GPUs."""

    def __init__(self, devices: Sequence[PluginDevice], candidates: list[PluginDevice], required: list[str],
                 policy: str, links: Links) -> None:
        self.links = links
        self.sign = 1 if policy == "distributed" else -1  # applied to loads: the smaller key wins
        place = {device.id: n for n, device in enumerate(devices)}
        self.position: dict[str, int] = {}  # unit: its first device's place in the resource's list
        self.gpu: dict[str, int] = {}  # unit: its GPU's index
        self.load: dict[str, int] = {}  # unit: its devices not free
        self.gpu_load: dict[int, int] = {}  # GPU index: its units' devices not free
        for device in devices:
            self.position.setdefault(device.uuid, place[device.id])
            self.gpu[device.uuid] = device.gpu_index
            self.load[device.uuid] = self.load.get(device.uuid, 0) + 1
            self.gpu_load[device.gpu_index] = self.gpu_load.get(device.gpu_index, 0) + 1
        self.free: dict[str, list[PluginDevice]] = {}  # unit: its free devices, the next one last
        for device in sorted(candidates, key=lambda d: place[d.id], reverse=True):
            self.free.setdefault(device.uuid, []).append(device)
            self.load[device.uuid] -= 1
            self.gpu_load[device.gpu_index] -= 1
        self.picked = {unit: 0 for unit in self.free}
        self.affinity = {gpu: 0 for gpu in self.gpu_load}  # GPU: its link total to the devices chosen
        by_id = {device.id: device for device in devices}
        for device_id in required:
            if device_id in by_id:
                self._linked(by_id[device_id].gpu_index)

    def _linked(self, gpu: int) -> None:
        for other in self.affinity:
            self.affinity[other] += self.links.score(other, gpu)

    def _key(self, unit: str) -> tuple[int, int, int, int, int, int]:
        gpu = self.gpu[unit]
        return (self.sign * self.load[unit], self.picked[unit], self.sign * self.gpu_load[gpu], -self.affinity[gpu],
                gpu, self.position[unit])

    def pick(self, needed: int) -> list[str]:
        chosen: list[str] = []
        for _ in range(needed):
            unit = min((unit for unit, free in self.free.items() if free), key=self._key)
            device = self.free[unit].pop()
            self.picked[unit] += 1
            self.load[unit] += 1
            self.gpu_load[device.gpu_index] += 1
            self._linked(device.gpu_index)
            chosen.append(device.id)
        return chosen
