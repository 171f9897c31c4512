"""Which whole GPUs to offer the kubelet for a request (GetPreferredAllocation): a pure, deterministic
policy over NVML's topology, the agent's counterpart of the best-effort policy NVIDIA's plugin applies to
full GPUs. Replicas and MIG devices take the shared-devices policy instead (shared_policy.py), as there.

From `available`, the `size` GPUs (those in `must_include` first) that are best connected:

1. GPUs joined by NVLink (directly or through NVSwitch) beat any PCIe path, more links beating fewer;
2. then GPUs on the same NUMA node;
3. then the nearest common PCIe ancestor: one board, one switch (PIX), several switches (PXB), one host
   bridge (PHB), one NUMA node (NODE), across sockets (SYS);
4. then the lowest GPU index, so the same request always gets the same answer.

Whole selections are compared, not single steps: each free GPU is tried as the first pick, the rest
added greedily, and the selection with the best total wins. Ids the topology does not know (no
inventory, an id NVML did not report) count as unconnected, so the policy still answers, by rule 4.
A request that cannot be met (fewer GPUs available than asked for, more must-include ids than that,
or one of them not available) gets no preference (an empty list), as NVIDIA's plugin answers it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from gpu_agent.nvml.model import PCIE_LEVELS, Inventory

NVLINK_SCORE = 1000  # per pair of NVLink-joined GPUs, plus one per link: above anything PCIe can score
SAME_NUMA_SCORE = 100  # above any PCIe level
PCIE_SCORES = {level: 10 * (len(PCIE_LEVELS) - n) for n, level in enumerate(PCIE_LEVELS)}  # BOARD 60 .. SYS 10
MAX_SEEDS = 64  # first picks tried; beyond that (only ids the topology does not know) the earliest
_UNKNOWN = 1 << 30  # where an id the topology does not know sorts: after every GPU


class Links:
    """How well two GPUs (by inventory index) are connected, each pair worked out once."""

    def __init__(self, topology: Optional[Inventory]) -> None:
        self.topology = topology
        self.index_of = {gpu.uuid: gpu.index for gpu in topology.gpus} if topology else {}
        self._numa = {gpu.index: gpu.numa_node for gpu in topology.gpus} if topology else {}
        self._scores: dict[tuple[int, int], int] = {}

    def score(self, a: Optional[int], b: Optional[int]) -> int:
        """The link score of GPUs a and b (for a == b: two devices of one GPU); 0 where nothing is known."""
        if a is None or b is None or self.topology is None:
            return 0
        key = (min(a, b), max(a, b))
        if key not in self._scores:
            self._scores[key] = self._pair_score(*key)
        return self._scores[key]

    def _pair_score(self, a: int, b: int) -> int:
        assert self.topology is not None
        if a == b:  # two devices of one GPU share its PCIe path, never NVLink
            return SAME_NUMA_SCORE + PCIE_SCORES["BOARD"]
        score = 0
        link = self.topology.link(a, b)
        if link is not None:
            score += NVLINK_SCORE + link.nvlinks if link.nvlinks else 0
            score += PCIE_SCORES.get(link.pcie, 0)
        numa = {self._numa.get(a), self._numa.get(b)}
        if len(numa) == 1 and None not in numa:
            score += SAME_NUMA_SCORE
        return score


def preferred(available: Sequence[str], must_include: Sequence[str], size: int,
              topology: Optional[Inventory]) -> list[str]:
    """The GPUs to prefer: every one of `must_include` and the best connected of the rest of `available`,
    `size` in all, in a stable order; [] for a request that cannot be met."""
    pool = list(dict.fromkeys(available))
    kept = list(dict.fromkeys(must_include))
    if size <= 0 or len(pool) < size or len(kept) > size or not set(kept) <= set(pool):
        return []
    links = Links(topology)
    taken = set(kept)
    free = sorted((gpu for gpu in pool if gpu not in taken), key=lambda gpu: _order(links, gpu))
    if len(kept) == size:
        return kept
    chosen = _Search(links, kept, free).best(size - len(kept))
    return kept + sorted(chosen, key=lambda gpu: _order(links, gpu))


def _order(links: Links, gpu: str) -> tuple[int, str]:
    return links.index_of.get(gpu, _UNKNOWN), gpu


class _Search:
    """Each free GPU as the first pick (or none, when the kubelet names some), the rest greedily: the
    GPU with the best link total to those chosen, ties to the earlier; the best selection wins."""

    def __init__(self, links: Links, kept: list[str], free: list[str]) -> None:
        self.links = links
        self.kept = kept
        self.free = free  # in order: index, then id

    def _score(self, a: str, b: str) -> int:
        return self.links.score(self.links.index_of.get(a), self.links.index_of.get(b))

    def best(self, wanted: int) -> list[str]:
        seeds: list[Optional[str]] = [None] if self.kept else list(self.free[:MAX_SEEDS])
        best: Optional[tuple[int, list[str]]] = None
        for seed in seeds:
            picked = self._greedy(seed, wanted)
            rank = self._rank(self.kept + picked)
            if best is None or rank > best[0]:
                best = (rank, picked)
        assert best is not None
        return best[1]

    def _greedy(self, seed: Optional[str], wanted: int) -> list[str]:
        totals = {gpu: 0 for gpu in self.free}  # each free GPU's link total to the chosen ones
        remaining = list(self.free)

        def choose(gpu: str) -> None:
            for other in remaining:
                totals[other] += self._score(other, gpu)

        for gpu in self.kept:
            choose(gpu)
        picked: list[str] = []
        if seed is not None:
            remaining.remove(seed)
            picked.append(seed)
            choose(seed)
        while len(picked) < wanted:
            gpu = max(remaining, key=lambda candidate: totals[candidate])  # the first of equals
            remaining.remove(gpu)
            picked.append(gpu)
            choose(gpu)
        return picked

    def _rank(self, gpus: list[str]) -> int:
        return sum(self._score(a, b) for n, a in enumerate(gpus) for b in gpus[n + 1:])
