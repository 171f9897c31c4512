"""GetPreferredAllocation's policies on hand-made topologies: whole GPUs by topology (gpu_agent/plugin/preferred.py),
replicas and MIG devices by the shared-devices policy (gpu_agent/plugin/shared_policy.py)."""
from __future__ import annotations

import random
from collections import Counter
from typing import Optional

import pytest

from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, GpuLink, Inventory, MigState
from gpu_agent.plugin.devices import GPU_RESOURCE, PluginDevice, Resource
from gpu_agent.plugin.preferred import MAX_SEEDS, Links, preferred
from gpu_agent.plugin.shared_policy import NotEnoughDevices, _Picker, preferred_allocation


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


def dgx(mig: Optional[dict[int, int]] = None) -> Inventory:
    """8 GPUs, NVLink all-to-all through NVSwitch (NV18), GPUs 0-3 on NUMA node 0 and 4-7 on node 1."""
    return inventory([0, 0, 0, 0, 1, 1, 1, 1],
                     {(a, b): (18, "NODE" if a // 4 == b // 4 else "SYS") for a in range(8) for b in range(a + 1, 8)},
                     mig)


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


def test_without_topology_it_still_answers():
    ids = gpus(3, 1, 2)
    assert preferred(ids, [], 2, None) == gpus(1, 2)
    assert preferred(ids, gpus(3), 2, None) == gpus(3, 1)
    # Ids the topology does not know are unconnected, not errors.
    assert preferred(["odd-1", uuid(0), "odd-0"], [], 2, dgx()) == [uuid(0), "odd-0"]


def test_a_request_that_cannot_be_met_gets_no_preference_and_duplicates_count_once():
    """As NVIDIA's best-effort policy answers: [] when fewer GPUs are available than asked for, when more
    must be included than that, or when one to include is not available; the kubelet then chooses."""
    topology = dgx()
    assert preferred(gpus(0, 1), [], 5, topology) == []
    assert preferred(gpus(0, 1, 1), [], 3, topology) == []
    assert preferred(gpus(*range(8)), gpus(6, 1, 2), 2, topology) == []
    assert preferred(gpus(0, 1, 2), gpus(5), 2, topology) == []
    assert preferred(gpus(0, 1), [], 0, topology) == []
    assert preferred([], [], 3, topology) == []
    assert preferred(gpus(0, 0, 1, 1), [], 2, topology) == gpus(0, 1)
    assert preferred(gpus(0, 1, 2), gpus(2), 1, topology) == gpus(2)


def test_the_answer_does_not_depend_on_the_order_of_available():
    topology = pcie_box()
    ids = gpus(*range(8))
    expected = preferred(ids, [], 3, topology)
    shuffler = random.Random(7)
    for _ in range(5):
        shuffled = list(ids)
        shuffler.shuffle(shuffled)
        assert preferred(shuffled, [], 3, topology) == expected


# --- the search keeps running link totals, and answers as the plain sums do --------------------------

def plain_preferred(available: list[str], must_include: list[str], size: int,
                    topology: Optional[Inventory]) -> list[str]:
    """preferred(), every link total summed afresh: the reference the running totals answer as."""
    links = Links(topology)
    pool, kept = list(dict.fromkeys(available)), list(dict.fromkeys(must_include))
    if size <= 0 or len(pool) < size or len(kept) > size or not set(kept) <= set(pool):
        return []

    def order(gpu: str) -> tuple[int, str]:
        return links.index_of.get(gpu, 1 << 30), gpu

    def score(a: str, b: str) -> int:
        return links.score(links.index_of.get(a), links.index_of.get(b))

    free = sorted((gpu for gpu in pool if gpu not in kept), key=order)
    best: Optional[tuple[int, list[str]]] = None
    for seed in ([None] if kept else free[:MAX_SEEDS]):
        chosen = kept + ([seed] if seed else [])
        while len(chosen) < size:
            rest = [gpu for gpu in free if gpu not in chosen]
            chosen.append(max(rest, key=lambda gpu: sum(score(gpu, other) for other in chosen)))
        rank = sum(score(a, b) for n, a in enumerate(chosen) for b in chosen[n + 1:])
        if best is None or rank > best[0]:
            best = (rank, chosen[len(kept):])
    assert best is not None
    return kept + sorted(best[1], key=order)


def _random_case(rng: random.Random) -> tuple[list[str], list[str], int, Optional[Inventory]]:
    count = rng.randint(1, 8)
    topology = rng.choice([dgx(), pcie_box(), None, inventory(
        [rng.choice([0, 1, None]) for _ in range(count)],
        {(a, b): (rng.choice([0, 0, 2, 18]), rng.choice(["PIX", "PXB", "PHB", "NODE", "SYS"]))
         for a in range(count) for b in range(a + 1, count) if rng.random() < 0.8})])
    ids = [gpu.uuid for gpu in topology.gpus] if topology else gpus(*range(count))
    if rng.random() < 0.2:
        ids.append("unknown-device")
    available = rng.sample(ids, rng.randint(1, len(ids)))
    must = rng.sample(available, rng.randint(0, min(2, len(available)))) if rng.random() < 0.4 else []
    return available, must, rng.randint(0, len(available) + 1), topology


def test_the_search_answers_as_the_plain_sums_on_random_requests() -> None:
    rng = random.Random(27)
    for _ in range(400):
        available, must, size, topology = _random_case(rng)
        assert preferred(available, must, size, topology) == plain_preferred(available, must, size, topology), \
            (available, must, size)


# --- the shared-devices policy: replicas and MIG devices (gpu_agent/plugin/shared_policy.py) --------------

def replicas(topology: Inventory, count: int) -> Resource:
    """nvidia.com/gpu with `count` replicas of each GPU of the topology."""
    return Resource(GPU_RESOURCE, tuple(
        PluginDevice(f"{gpu.uuid}::{n}", gpu.uuid, gpu.uuid, gpu.index, gpu.numa_node, True)
        for gpu in topology.gpus for n in range(count)), count)


def mig_devices(topology: Inventory) -> Resource:
    """nvidia.com/mig-3g.40gb with every MIG device of the topology."""
    return Resource("nvidia.com/mig-3g.40gb", tuple(
        PluginDevice(device.uuid, device.uuid, gpu.uuid, gpu.index, gpu.numa_node, True)
        for gpu in topology.gpus for device in gpu.mig.devices))


def per_gpu(topology: Inventory, chosen: list[str]) -> dict[int, int]:
    """Devices chosen on each GPU, by index."""
    index = {gpu.uuid: gpu.index for gpu in topology.gpus}
    index.update({device.uuid: gpu.index for gpu in topology.gpus for device in gpu.mig.devices})
    return dict(Counter(index[device.split("::")[0]] for device in chosen))


def test_distributed_spreads_replicas_over_the_least_loaded_gpus_and_packed_fills_the_most_loaded() -> None:
    topology = dgx()
    resource = replicas(topology, 4)
    ids = [device.id for device in resource.devices]
    busy = [i for i in ids if not i.startswith((uuid(0), uuid(5)))] + [f"{uuid(5)}::3"]  # GPU 0 free, GPU 5 busiest
    assert per_gpu(topology, preferred_allocation(resource, ids, [], 3, "distributed", topology)) == {0: 1, 1: 1, 2: 1}
    assert per_gpu(topology, preferred_allocation(resource, ids, [], 6, "packed", topology)) == {0: 4, 1: 2}
    assert preferred_allocation(resource, busy, [], 1, "distributed", topology) == [f"{uuid(1)}::0"]
    assert preferred_allocation(resource, busy, [], 2, "packed", topology) == [f"{uuid(5)}::3", f"{uuid(4)}::0"]


def test_mig_devices_spread_over_gpus_or_pack_onto_one_and_follow_the_topology() -> None:
    topology = dgx(mig={g: 2 for g in range(8)})
    resource = mig_devices(topology)
    ids = [device.id for device in resource.devices]
    assert per_gpu(topology, preferred_allocation(resource, ids, [], 3, "distributed", topology)) == {0: 1, 1: 1, 2: 1}
    assert per_gpu(topology, preferred_allocation(resource, ids, [], 3, "packed", topology)) == {0: 2, 1: 1}
    # With one MIG device of GPU 5 to include, distributed takes the next from GPU 4, on GPU 5's NUMA node.
    chosen = preferred_allocation(resource, ids, [mig_uuid(5, 0)], 2, "distributed", topology)
    assert chosen == [mig_uuid(5, 0), mig_uuid(4, 0)]
    # GPU 6 has one MIG device in use: packed fills its other one first, distributed avoids it.
    taken = [i for i in ids if i != mig_uuid(6, 0)]
    assert preferred_allocation(resource, taken, [], 1, "packed", topology) == [mig_uuid(6, 1)]
    assert per_gpu(topology, preferred_allocation(resource, taken, [], 7, "distributed", topology)).get(6) is None


def test_a_shared_request_that_cannot_be_met_is_refused() -> None:
    topology = dgx()
    resource = replicas(topology, 2)
    ids = [device.id for device in resource.devices]
    with pytest.raises(NotEnoughDevices, match="not enough available devices to satisfy allocation: 5 asked for, 1 "
                                               "of them must-include, 3 other devices available"):
        preferred_allocation(resource, ids[:4], ids[:1], 5, "distributed", topology)
    # Must-include beyond the size asked for: all of them, nothing more, as NVIDIA's plugin answers.
    assert preferred_allocation(resource, ids, ids[:3], 2, "packed", topology) == ids[:3]


def test_the_shared_answer_does_not_depend_on_the_order_of_available() -> None:
    topology = dgx(mig={g: 2 for g in range(8)})
    shuffler = random.Random(3)
    for resource in (replicas(topology, 3), mig_devices(topology)):
        ids = [device.id for device in resource.devices][1:]
        for policy in ("distributed", "packed"):
            expected = preferred_allocation(resource, ids, [], 5, policy, topology)
            for _ in range(3):
                shuffled = list(ids)
                shuffler.shuffle(shuffled)
                assert preferred_allocation(resource, shuffled, [], 5, policy, topology) == expected


def test_whole_gpus_are_placed_by_topology_whatever_the_policy() -> None:
    topology = dgx()
    resource = Resource(GPU_RESOURCE, tuple(PluginDevice(gpu.uuid, gpu.uuid, gpu.uuid, gpu.index, gpu.numa_node, True)
                                            for gpu in topology.gpus))
    available = gpus(0, 1, 4, 5, 6)
    for policy in ("distributed", "packed"):
        assert preferred_allocation(resource, available, [], 3, policy, topology) == gpus(4, 5, 6)
        assert preferred_allocation(resource, available, [], 6, policy, topology) == []


def test_1024_replicas_of_8_gpus_cost_work_linear_in_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's valid config (128 replicas x 8 GPUs, one pod asking for 1,024) took 15 s once: each pick
    looks at each GPU once, and each pair of GPUs is scored once."""
    calls = Counter()
    score, key = Links._pair_score, _Picker._key

    def counted_score(self: Links, a: int, b: int) -> int:
        calls["score"] += 1
        return score(self, a, b)

    def counted_key(self: _Picker, unit: str) -> tuple[int, ...]:
        calls["key"] += 1
        return key(self, unit)

    monkeypatch.setattr(Links, "_pair_score", counted_score)
    monkeypatch.setattr(_Picker, "_key", counted_key)
    topology = dgx()
    resource = replicas(topology, 128)
    available = [device.id for device in resource.devices]
    for policy in ("distributed", "packed"):
        calls.clear()
        chosen = preferred_allocation(resource, available, [], len(available), policy, topology)
        assert sorted(chosen) == sorted(available)
        assert calls["score"] <= 8 * 9 // 2 and calls["key"] <= 8 * len(available)
