"""The preferred allocation policy (gpu_agent/plugin/preferred.py), on hand-made topologies."""
from __future__ import annotations

import random
from typing import Optional

import pytest

from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, GpuLink, Inventory, MigState
from gpu_agent.plugin.preferred import MAX_SEEDS, _Device, _Resolver, preferred


def uuid(index: int) -> str:
    return f"GPU-{index:08d}-0000-0000-0000-000000000000"


def mig_uuid(gpu: int, n: int) -> str:
    return f"MIG-{gpu:04d}{n:04d}-0000-0000-0000-000000000000"


def inventory(numa: list[Optional[int]], links: dict[tuple[int, int], tuple[int, str]],
              mig: Optional[dict[int, int]] = None) -> Inventory:
    """GPUs with these NUMA nodes; links (a, b) -> (NVLinks, PCIe level); mig: GPU -> MIG devices."""
    gpus = []
    for index, node in enumerate(numa):
        instances = tuple(
            GpuInstance(id=n + 1, profile_id=9, profile="3g.40gb", slices=3, placement=(4 * n, 4), memory_mib=40448,
                        compute_instances=(ComputeInstance(0, 2, "3g.40gb", 3, (0, 3), 60, mig_uuid(index, n), n),))
            for n in range((mig or {}).get(index, 0)))
        gpus.append(Gpu(index=index, uuid=uuid(index), pci_bus_id=f"0000:{index + 16:02x}:00.0",
                        product="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability=(9, 0),
                        minor_number=index, mig=MigState(capable=True, enabled=bool(instances),
                                                         gpu_instances=instances),
                        numa_node=node))
    return Inventory("580.95.05", "13.0", tuple(gpus),
                     tuple(GpuLink(a, b, nvlinks, pcie) for (a, b), (nvlinks, pcie) in sorted(links.items())))


def dgx() -> Inventory:
    """8 GPUs, NVLink all-to-all through NVSwitch (NV18), GPUs 0-3 on NUMA node 0 and 4-7 on node 1."""
    return inventory([0, 0, 0, 0, 1, 1, 1, 1],
                     {(a, b): (18, "NODE" if a // 4 == b // 4 else "SYS") for a in range(8) for b in range(a + 1, 8)})


def pcie_box() -> Inventory:
    """8 PCIe GPUs, no NVLink: two per PCIe switch, two switches per NUMA node."""
    def level(a: int, b: int) -> str:
        if a // 4 != b // 4:
            return "SYS"
        return "PIX" if a // 2 == b // 2 else "NODE"
    return inventory([0, 0, 0, 0, 1, 1, 1, 1], {(a, b): (0, level(a, b)) for a in range(8) for b in range(a + 1, 8)})


def gpus(*indexes: int) -> list[str]:
    return [uuid(i) for i in indexes]


def test_the_same_numa_node_wins_among_nvlink_peers():
    topology = dgx()
    assert preferred(gpus(*range(8)), [], 4, topology) == gpus(0, 1, 2, 3)
    assert preferred(gpus(0, 1, 4, 5, 6), [], 2, topology) == gpus(0, 1)
    # A whole selection is judged: three GPUs on node 1 beat the two on node 0 plus one across.
    assert preferred(gpus(0, 1, 4, 5, 6), [], 3, topology) == gpus(4, 5, 6)


def test_must_include_is_kept_and_its_neighbours_follow():
    topology = dgx()
    assert preferred(gpus(*range(8)), gpus(5), 2, topology) == gpus(5, 4)
    assert preferred(gpus(*range(8)), gpus(6, 1), 3, topology) == gpus(6, 1, 0)
    assert preferred(gpus(*range(8)), gpus(6, 1, 2), 2, topology) == gpus(6, 1)  # never more than size


def test_nvlink_beats_the_same_numa_node():
    topology = inventory([0, 0, 1], {(0, 1): (0, "NODE"), (0, 2): (4, "SYS"), (1, 2): (0, "SYS")})
    assert preferred(gpus(0, 1, 2), [], 2, topology) == gpus(0, 2)
    more_links = inventory([0, 1, 1], {(0, 1): (2, "SYS"), (0, 2): (4, "SYS"), (1, 2): (0, "NODE")})
    assert preferred(gpus(0, 1, 2), gpus(0), 2, more_links) == gpus(0, 2)


def test_pcie_switch_then_numa_node_on_a_pcie_machine():
    topology = pcie_box()
    assert preferred(gpus(1, 2, 3, 5), [], 2, topology) == gpus(2, 3)  # one switch
    assert preferred(gpus(1, 3, 5), [], 2, topology) == gpus(1, 3)  # same NUMA node, two switches
    assert preferred(gpus(3, 4, 6), gpus(3), 2, topology) == gpus(3, 4)  # across sockets: the lowest index


def test_replicas_spread_across_gpus_then_least_shared():
    topology = dgx()
    replicas = [f"{uuid(g)}::{n}" for g in (0, 1) for n in range(4)]
    assert preferred(replicas, [], 2, topology) == [f"{uuid(0)}::0", f"{uuid(1)}::0"]
    # GPU 1 has one replica left (three in use): GPU 0 is the less shared.
    busy = [f"{uuid(0)}::{n}" for n in range(4)] + [f"{uuid(1)}::3"]
    assert preferred(busy, [], 1, topology) == [f"{uuid(0)}::0"]
    assert preferred(busy, [], 3, topology) == [f"{uuid(0)}::0", f"{uuid(0)}::1", f"{uuid(1)}::3"]
    # With one replica already on GPU 0, the next comes from another GPU.
    assert preferred(replicas, [f"{uuid(0)}::2"], 2, topology) == [f"{uuid(0)}::2", f"{uuid(1)}::0"]


def test_replicas_spread_with_topology_deciding_between_gpus():
    topology = dgx()
    replicas = [f"{uuid(g)}::{n}" for g in (0, 4, 5) for n in range(2)]
    assert preferred(replicas, [f"{uuid(5)}::1"], 2, topology) == [f"{uuid(5)}::1", f"{uuid(4)}::0"]


def test_mig_devices_are_placed_by_their_gpu():
    topology = inventory([0, 1, 1], {(0, 1): (0, "SYS"), (0, 2): (0, "SYS"), (1, 2): (0, "PIX")},
                         mig={0: 2, 1: 1, 2: 1})
    available = [mig_uuid(0, 0), mig_uuid(0, 1), mig_uuid(1, 0), mig_uuid(2, 0)]
    assert preferred(available, [mig_uuid(1, 0)], 2, topology) == [mig_uuid(1, 0), mig_uuid(2, 0)]
    assert preferred(available, [mig_uuid(0, 1)], 2, topology) == [mig_uuid(0, 1), mig_uuid(0, 0)]


def test_without_topology_it_still_answers():
    ids = gpus(3, 1, 2)
    assert preferred(ids, [], 2, None) == gpus(1, 2)
    assert preferred(ids, gpus(3), 2, None) == gpus(3, 1)
    replicas = [f"{uuid(g)}::{n}" for g in (2, 1) for n in range(3)]
    assert preferred(replicas, [], 2, None) == [f"{uuid(1)}::0", f"{uuid(2)}::0"]
    # Ids the topology does not know are unconnected, not errors.
    assert preferred(["odd-1", uuid(0), "odd-0"], [], 2, dgx()) == [uuid(0), "odd-0"]


def test_bounds_and_duplicates():
    topology = dgx()
    assert preferred(gpus(0, 1), [], 5, topology) == gpus(0, 1)
    assert preferred(gpus(0, 1), [], 0, topology) == []
    assert preferred(gpus(0, 0, 1, 1), [], 2, topology) == gpus(0, 1)
    assert preferred([], [], 3, topology) == []


def test_the_answer_does_not_depend_on_the_order_of_available():
    topology = pcie_box()
    ids = gpus(*range(8)) + [f"{uuid(g)}::{n}" for g in range(8) for n in range(2)]
    expected = preferred(ids, [], 3, topology)
    shuffler = random.Random(7)
    for _ in range(5):
        shuffled = list(ids)
        shuffler.shuffle(shuffled)
        assert preferred(shuffled, [], 3, topology) == expected


def test_large_requests_stay_fast_enough_to_finish():
    # 16 GPUs with 64 replicas each: the search works per GPU, not per device.
    topology = inventory([g // 8 for g in range(16)], {})
    ids = [f"{uuid(g)}::{n}" for g in range(16) for n in range(64)]
    chosen = preferred(ids, [], 16, topology)
    assert sorted({device.split("::")[0] for device in chosen}) == gpus(*range(16))


# --- the search is linear in the devices, and answers as the quadratic one did -------------------

class _QuadraticSelection:
    """The search as first written (quadratic in the devices): the reference the new one answers as."""

    def __init__(self, resolve: _Resolver, kept: list[_Device], free: list[_Device]) -> None:
        self.resolve = resolve
        self.kept = kept
        self.by_group: dict[str, list[_Device]] = {}
        for device in sorted(free, key=lambda d: d.order):
            self.by_group.setdefault(device.group, []).append(device)
        self.free_count = {group: len(devices) for group, devices in self.by_group.items()}
        self.groups = sorted(self.by_group, key=lambda g: self.by_group[g][0].order)

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
        chosen = list(self.kept)
        picked: list[_Device] = []
        if seed is not None:
            picked.append(self.by_group[seed][0])
            used[seed] = 1
            chosen.append(picked[0])
        while len(picked) < wanted:
            best_group, best_key = None, None
            for group in self.groups:
                if used[group] >= len(self.by_group[group]):
                    continue
                device = self.by_group[group][used[group]]
                key = self._gain(device, chosen)
                if best_key is None or key > best_key:
                    best_group, best_key = group, key
            assert best_group is not None
            device = self.by_group[best_group][used[best_group]]
            used[best_group] += 1
            picked.append(device)
            chosen.append(device)
        return picked

    def _gain(self, device: _Device, chosen: list[_Device]) -> tuple[int, int, int]:
        """What adding `device` brings, best first: fewer replicas sharing a GPU, better links, a less
        shared GPU. Ties fall to the earlier group (the loop keeps the first best)."""
        same = sum(1 for other in chosen if other.group == device.group and device.replica is not None)
        links = sum(self.resolve.score(device, other) for other in chosen if other.group != device.group
                    or device.replica is None)
        spare = self.free_count[device.group] if device.replica is not None else 0
        return (-same, links, spare)

    def _rank(self, devices: list[_Device]) -> tuple[int, int, int]:
        """A whole selection's worth, compared as _gain compares one step."""
        same = links = 0
        for n, a in enumerate(devices):
            for b in devices[n + 1:]:
                if a.group == b.group and (a.replica is not None or b.replica is not None):
                    same += 1
                else:
                    links += self.resolve.score(a, b)
        spare = sum(self.free_count.get(d.group, 0) for d in devices if d.replica is not None)
        return (-same, links, spare)


def quadratic_preferred(available: list[str], must_include: list[str], size: int,
                        topology: Optional[Inventory]) -> list[str]:
    """preferred() with the search as first written."""
    if size <= 0:
        return []
    kept = list(dict.fromkeys(must_include))[:size]
    resolve = _Resolver(topology)
    free = [resolve(d) for d in dict.fromkeys(available) if d not in set(kept)]
    wanted = min(size - len(kept), len(free))
    if wanted <= 0:
        return kept
    chosen = _QuadraticSelection(resolve, [resolve(d) for d in kept], free).best(wanted)
    return kept + [device.id for device in sorted(chosen, key=lambda d: d.order)]


def _random_case(rng: random.Random) -> tuple[list[str], list[str], int, Optional[Inventory]]:
    count = rng.randint(1, 8)
    topology = rng.choice([dgx(), pcie_box(), None, inventory(
        [rng.choice([0, 1, None]) for _ in range(count)],
        {(a, b): (rng.choice([0, 0, 2, 18]), rng.choice(["PIX", "PXB", "PHB", "NODE", "SYS"]))
         for a in range(count) for b in range(a + 1, count) if rng.random() < 0.8},
        mig={n: rng.randint(0, 2) for n in range(count)})])
    gpus_there = topology.gpus if topology else [None] * count
    ids = []
    for n, gpu in enumerate(gpus_there):
        base = gpu.uuid if gpu is not None else uuid(n)
        kind = rng.random()
        if gpu is not None and gpu.mig.devices and kind < 0.3:
            ids += [device.uuid for device in gpu.mig.devices]
        elif kind < 0.7:
            ids += [f"{base}::{r}" for r in range(rng.randint(1, 6))]
        else:
            ids.append(base)
    if rng.random() < 0.2:
        ids.append("unknown-device")
    available = rng.sample(ids, rng.randint(1, len(ids)))
    must = rng.sample(available, rng.randint(0, min(2, len(available)))) if rng.random() < 0.4 else []
    return available, must, rng.randint(0, len(available) + 1), topology


def test_the_search_answers_as_the_quadratic_one_on_random_requests() -> None:
    rng = random.Random(27)
    for _ in range(400):
        available, must, size, topology = _random_case(rng)
        assert preferred(available, must, size, topology) == quadratic_preferred(available, must, size, topology), \
            (available, must, size)


def test_1024_replicas_of_8_gpus_cost_work_linear_in_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's valid config (128 replicas x 8 GPUs, one pod asking for 1,024) took 15 s: the link
    scores the search looks up now grow with the GPUs and the devices asked for, not their square."""
    calls = [0]
    score = _Resolver.score

    def counted(self: _Resolver, a: _Device, b: _Device) -> int:
        calls[0] += 1
        return score(self, a, b)

    monkeypatch.setattr(_Resolver, "score", counted)
    topology = dgx()
    for replicas in (16, 128):
        calls[0] = 0
        available = [f"{uuid(g)}::{r}" for g in range(8) for r in range(replicas)]
        chosen = preferred(available, [], len(available), topology)
        assert sorted(chosen) == sorted(available)
        # per seed (8): a pick updates 8 link totals, and a rank looks at 8 x 8 pairs
        assert calls[0] <= min(8, MAX_SEEDS) * (8 * len(available) + 8 * 8 + 8) * 2
