"""The preferred allocation policy (gpu_agent/plugin/preferred.py), on hand-made topologies."""
from __future__ import annotations

import random
from typing import Optional

from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, GpuLink, Inventory, MigState
from gpu_agent.plugin.preferred import preferred


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
