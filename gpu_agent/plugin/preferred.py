"""Which devices to offer the kubelet for a request (GetPreferredAllocation): a pure, deterministic policy.

Device ids are GPU UUIDs, MIG device UUIDs or time-slicing replicas `<uuid>::<n>`. The policy picks,
from `available`, the `size` devices (those in `must_include` first) whose GPUs are best connected:

1. replicas are spread: two replicas of one GPU are taken only when no other GPU has one free;
2. GPUs joined by NVLink (directly or through NVSwitch) beat any PCIe path, more links beating fewer;
3. then GPUs on the same NUMA node;
4. then the nearest common PCIe ancestor: one board, one switch (PIX), several switches (PXB), one host
   bridge (PHB), one NUMA node (NODE), across sockets (SYS);
5. then, among replicas, GPUs with more replicas free (the least shared);
6. then the lowest GPU index and replica number, so the same request always gets the same answer.

Whole selections are compared, not single steps: each free GPU is tried as the first pick, the rest
added greedily, and the selection with the best total (in the order above) wins. Devices the topology
does not know (no inventory, an id NVML did not report) count as unconnected, so the policy still
answers, by rules 1, 5 and 6 alone.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from gpu_agent.nvml.model import PCIE_LEVELS, Inventory

REPLICA = re.compile(r"^(?P<base>.+)::(?P<n>[0-9]{1,9})$")
NVLINK_SCORE = 1000  # per pair of NVLink-joined GPUs, plus one per link: above anything PCIe can score
SAME_NUMA_SCORE = 100  # above any PCIe level
PCIE_SCORES = {level: 10 * (len(PCIE_LEVELS) - n) for n, level in enumerate(PCIE_LEVELS)}  # BOARD 60 .. SYS 10
MAX_SEEDS = 64  # first picks tried; beyond that (only ids the topology does not know) the earliest


@dataclass(frozen=True)
class _Device:
    id: str
    group: str  # the GPU it runs on (its UUID), or the id itself where the topology does not know it
    gpu: Optional[int]  # the GPU's index in the inventory
    replica: Optional[int]  # n of `<uuid>::<n>`

    @property
    def order(self) -> tuple[int, str, int, str]:
        gpu = self.gpu if self.gpu is not None else 1 << 30
        return (gpu, self.group, self.replica if self.replica is not None else -1, self.id)


def preferred(available: Sequence[str], must_include: Sequence[str], size: int,
              topology: Optional[Inventory]) -> list[str]:
    """The devices to prefer: every one of `must_include` (as far as `size` allows) and the best
    connected of the rest of `available`, never more than `size`, in a stable order."""
    if size <= 0:
        return []
    kept = list(dict.fromkeys(must_include))[:size]
    resolve = _Resolver(topology)
    taken = set(kept)
    free = [resolve(d) for d in dict.fromkeys(available) if d not in taken]
    wanted = min(size - len(kept), len(free))
    if wanted <= 0:
        return kept
    chosen = _Selection(resolve, [resolve(d) for d in kept], free).best(wanted)
    return kept + [device.id for device in sorted(chosen, key=lambda d: d.order)]


class _Resolver:
    """Device id -> the GPU it is on, by the inventory's GPU and MIG device UUIDs."""

    def __init__(self, topology: Optional[Inventory]) -> None:
        self.topology = topology
        self._gpus: dict[str, int] = {}  # GPU or MIG device UUID -> GPU index
        self._uuids: dict[int, str] = {}  # GPU index -> GPU UUID
        for gpu in topology.gpus if topology else ():
            self._uuids[gpu.index] = gpu.uuid
            self._gpus[gpu.uuid] = gpu.index
            for device in gpu.mig.devices:
                self._gpus[device.uuid] = gpu.index
        self._scores: dict[tuple[int, int], int] = {}

    def __call__(self, device_id: str) -> _Device:
        match = REPLICA.match(device_id)
        base = match.group("base") if match else device_id
        replica = int(match.group("n")) if match else None
        gpu = self._gpus.get(base)
        group = self._uuids[gpu] if gpu is not None else base
        return _Device(device_id, group, gpu, replica)

    def score(self, a: _Device, b: _Device) -> int:
        """How well two devices on different GPUs are connected (0: nothing known)."""
        if a.gpu is None or b.gpu is None or self.topology is None:
            return 0
        key = (min(a.gpu, b.gpu), max(a.gpu, b.gpu))
        if key not in self._scores:
            self._scores[key] = self._pair_score(*key)
        return self._scores[key]

    def _pair_score(self, a: int, b: int) -> int:
        assert self.topology is not None
        if a == b:  # two MIG devices of one GPU share its PCIe path, never NVLink
            return SAME_NUMA_SCORE + PCIE_SCORES["BOARD"]
        score = 0
        link = self.topology.link(a, b)
        if link is not None:
            score += NVLINK_SCORE + link.nvlinks if link.nvlinks else 0
            score += PCIE_SCORES.get(link.pcie, 0)
        gpus = {gpu.index: gpu for gpu in self.topology.gpus}
        numa = {gpus[i].numa_node for i in (a, b) if i in gpus}
        if len(numa) == 1 and None not in numa:
            score += SAME_NUMA_SCORE
        return score


class _Selection:
    """The search: each GPU with a free device as the first pick, the rest greedily, best total wins.

    What a device adds depends only on how many devices of each GPU are chosen already, so the search
    keeps those counts, and each GPU's link total to the chosen ones, and updates them per pick: a pick
    costs O(GPUs), a selection's rank O(GPUs²), whatever the number of devices (replicas) asked for.
    """

    def __init__(self, resolve: _Resolver, kept: list[_Device], free: list[_Device]) -> None:
        self.resolve = resolve
        self.kept = kept
        self.by_group: dict[str, list[_Device]] = {}
        for device in sorted(free, key=lambda d: d.order):
            self.by_group.setdefault(device.group, []).append(device)
        self.free_count = {group: len(devices) for group, devices in self.by_group.items()}
        self.groups = sorted(self.by_group, key=lambda g: self.by_group[g][0].order)
        self.sample: dict[str, _Device] = {d.group: d for d in kept}  # a device of each group: its GPU
        self.sample.update((group, devices[0]) for group, devices in self.by_group.items())
        self.known = [group for group in self.sample if self.sample[group].gpu is not None]

    def _score(self, a: str, b: str) -> int:
        """The link score of two devices of groups a and b (of one group: as two devices of one GPU)."""
        return self.resolve.score(self.sample[a], self.sample[b])

    def best(self, wanted: int) -> list[_Device]:
        seeds: list[Optional[str]] = [None] if self.kept else list(self.groups[:MAX_SEEDS])
        best: Optional[tuple[tuple[int, int, int], list[_Device]]] = None
        for seed in seeds:
            picked = self._greedy(seed, wanted)
            rank = self._rank(self.kept + picked)
            if best is None or rank > best[0]:
                best = (rank, picked)
        assert best is not None
        return best[1]

    def _greedy(self, seed: Optional[str], wanted: int) -> list[_Device]:
        used = {group: 0 for group in self.groups}
        chosen: dict[str, int] = {}  # group: devices chosen
        links = {group: 0 for group in self.sample}  # group: sum of its scores to every chosen device

        def choose(device: _Device) -> None:
            chosen[device.group] = chosen.get(device.group, 0) + 1
            if device.gpu is not None:
                for group in self.known:
                    links[group] += self._score(group, device.group)

        for device in self.kept:
            choose(device)
        picked: list[_Device] = []
        if seed is not None:
            picked.append(self.by_group[seed][0])
            used[seed] = 1
            choose(picked[0])
        while len(picked) < wanted:
            best_group, best_key = None, None
            for group in self.groups:
                if used[group] >= len(self.by_group[group]):
                    continue
                key = self._gain(self.by_group[group][used[group]], chosen, links)
                if best_key is None or key > best_key:
                    best_group, best_key = group, key
            assert best_group is not None
            device = self.by_group[best_group][used[best_group]]
            used[best_group] += 1
            picked.append(device)
            choose(device)
        return picked

    def _gain(self, device: _Device, chosen: dict[str, int], links: dict[str, int]) -> tuple[int, int, int]:
        """What adding `device` brings, best first: fewer replicas sharing a GPU, better links (to the
        devices of other GPUs; for a device that is not a replica, to those of its own GPU too), a less
        shared GPU. Ties fall to the earlier group (the loop keeps the first best)."""
        group = device.group
        mates = chosen.get(group, 0)
        if device.replica is None:
            return (0, links[group], 0)
        own = mates * self._score(group, group) if device.gpu is not None else 0
        return (-mates, links[group] - own, self.free_count[group])

    def _rank(self, devices: list[_Device]) -> tuple[int, int, int]:
        """A whole selection's worth, compared as _gain compares one step: over every pair of devices,
        those of one GPU where one is a replica count as sharing, the others add their link score."""
        count: dict[str, int] = {}
        whole: dict[str, int] = {}  # devices that are not replicas
        spare = 0
        for device in devices:
            count[device.group] = count.get(device.group, 0) + 1
            if device.replica is None:
                whole[device.group] = whole.get(device.group, 0) + 1
            else:
                spare += self.free_count.get(device.group, 0)
        same = links = 0
        groups = list(count)
        for n, a in enumerate(groups):
            pairs, whole_pairs = count[a] * (count[a] - 1) // 2, whole.get(a, 0) * (whole.get(a, 0) - 1) // 2
            same += pairs - whole_pairs
            if self.sample[a].gpu is None:
                continue
            links += whole_pairs * self._score(a, a)
            links += sum(count[a] * count[b] * self._score(a, b) for b in groups[n + 1:])
        return (-same, links, spare)
