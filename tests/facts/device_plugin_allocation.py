"""What NVIDIA's device plugin v0.20 expects of its shared-devices allocation policy (GetPreferredAllocation
for replicas and MIG devices), as our own data: each case's GPUs and replicas, the devices the kubelet
offers, the size asked for and what upstream's test checks of the answer, with the file, Go test and
commit it comes from (github.com/NVIDIA/k8s-device-plugin, tag v0.20.0). tests/test_plugin_upstream.py
replays each case on the agent's policy, on upstream's own device ids and on a simulated dgx-h100.

Upstream's tests check how many devices each GPU gives, not which replicas: its sort leaves ties in any
order (Go's map order), so a case states the counts (`per_gpu`: exactly these; `shape`: these counts,
largest first, whichever GPUs give them) or only the length of the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

COMMIT = "1b826acc6af3079d8923bac395c3124b8861a9a6"  # v0.20.0
ALLOCATE_TEST = "internal/rm/allocate_test.go"


@dataclass(frozen=True)
class Case:
    test: str  # the Go test function
    description: str  # its t.Run name ("" where the test has no table)
    policy: str  # distributed | packed
    replicas: tuple[tuple[str, int], ...]  # the resource's GPUs, in upstream's names, and each one's replicas
    size: int
    available: Optional[tuple[str, ...]] = None  # the kubelet's available ids (`<gpu>::<n>`); None: every device
    required: tuple[str, ...] = ()  # must-include ids
    per_gpu: Optional[tuple[tuple[str, int], ...]] = None  # devices each GPU gives, exactly
    shape: Optional[tuple[int, ...]] = None  # devices per GPU, largest first, whichever GPUs
    error: bool = False  # refused: not enough devices
    source: str = ALLOCATE_TEST
    commit: str = COMMIT

    @property
    def name(self) -> str:
        return f"{self.test}/{self.description}" if self.description else self.test


def _gpus(names: tuple[str, ...], replicas: int) -> tuple[tuple[str, int], ...]:
    return tuple((name, replicas) for name in names)


TWO, THREE, ONE = ("gpu0", "gpu1"), ("gpu0", "gpu1", "gpu2"), ("gpu0",)


def _row(test: str, policy: str, description: str, gpus: tuple[str, ...], replicas: int, size: int,
         **checks: Any) -> Case:
    """A case of a table test whose GPUs all have the same replicas (upstream's newTestDevices)."""
    return Case(test, description, policy, _gpus(gpus, replicas), size, **checks)


def _distributed(*row: Any, **checks: Any) -> Case:
    return _row("TestDistributedAlloc", "distributed", *row, **checks)


def _packed(*row: Any, **checks: Any) -> Case:
    return _row("TestPackedAlloc", "packed", *row, **checks)


CASES: list[Case] = [
    # GPU-0 keeps both replicas free, GPU-1 one: the two picks still come from both GPUs.
    Case("TestDistributedAlloc_PartiallyAllocated_DistributesAcrossDistinctGPUs", "", "distributed",
         (("GPU-0", 2), ("GPU-1", 2)), 2, available=("GPU-0::0", "GPU-0::1", "GPU-1::1"),
         per_gpu=(("GPU-0", 1), ("GPU-1", 1))),
    _distributed("2 GPUs, 4 replicas each, allocate 2 — should distribute across GPUs", TWO, 4, 2,
                 per_gpu=(("gpu0", 1), ("gpu1", 1))),
    _distributed("3 GPUs, 2 replicas each, allocate 3 — should distribute across all GPUs", THREE, 2, 3,
                 per_gpu=(("gpu0", 1), ("gpu1", 1), ("gpu2", 1))),
    _distributed("2 GPUs, 4 replicas each, allocate 4 — should distribute 2 per GPU", TWO, 4, 4,
                 per_gpu=(("gpu0", 2), ("gpu1", 2))),
    _distributed("allocate 1 from single GPU — trivial case", ONE, 4, 1, per_gpu=(("gpu0", 1),)),
    _distributed("not enough devices — should return error", ONE, 2, 5, error=True),
    # Its comment says gpu0 is taken, but the table leaves `available` unset: every device, length checked.
    _distributed("partial availability simulates pre-allocated state — should still distribute", TWO, 4, 2),
    _packed("2 GPUs, 4 replicas each, allocate 2 — should pack onto same GPU", TWO, 4, 2, shape=(2,)),
    _packed("3 GPUs, 2 replicas each, allocate 3 — should fill one GPU first", THREE, 2, 3, shape=(2, 1)),
    _packed("2 GPUs, 4 replicas each, allocate 4 — should pack onto single GPU", TWO, 4, 4, shape=(4,)),
    _packed("2 GPUs, 4 replicas each, allocate 5 — should fill one GPU then overflow", TWO, 4, 5, shape=(4, 1)),
    _packed("allocate 1 from single GPU — trivial case", ONE, 4, 1),
    _packed("not enough devices — should return error", ONE, 2, 5, error=True),
    # The default policy, asked ten times over: one device of each GPU every time.
    Case("TestDistributedAllocIsDefault", "", "distributed", _gpus(THREE, 4), 3,
         per_gpu=(("gpu0", 1), ("gpu1", 1), ("gpu2", 1))),
    # The two policies on the same request: 2 + 2 against 4 on one GPU.
    Case("TestPackedVsDistributedContrast", "distributed", "distributed", _gpus(TWO, 4), 4,
         per_gpu=(("gpu0", 2), ("gpu1", 2))),
    Case("TestPackedVsDistributedContrast", "packed", "packed", _gpus(TWO, 4), 4, shape=(4,)),
    # TestComparatorForPolicy compares a GPU with 3 of its 4 replicas allocated and one with 1 of 4: asked
    # for one device, each policy's choice between the two.
    Case("TestComparatorForPolicy", "distributed prefers GPU with fewer allocated replicas", "distributed",
         (("more", 4), ("less", 4)), 1, available=("more::3", "less::1", "less::2", "less::3"),
         per_gpu=(("less", 1),)),
    Case("TestComparatorForPolicy", "packed prefers GPU with more allocated replicas", "packed",
         (("more", 4), ("less", 4)), 1, available=("more::3", "less::1", "less::2", "less::3"),
         per_gpu=(("more", 1),)),
]

# TestComparatorForPolicy's other two cases: an empty policy is the default (distributed); an unknown one
# falls back to it inside the allocator, and the plugin refuses it at start (validateFlags in
# cmd/nvidia-device-plugin/main.go: "invalid --shared-devices-allocation-policy option").
DEFAULT_POLICY = "distributed"
UNKNOWN_POLICY = "no-such-policy"

DEFAULT_REPEATS = 10  # TestDistributedAllocIsDefault's loop

# TestFullGPUNodeIgnoresAllocationPolicy: full GPUs (no replica among the ids offered) take the aligned,
# topology-based path whatever the policy; MIG devices and replicas never do.
FULL_GPU_TEST = "TestFullGPUNodeIgnoresAllocationPolicy"
FULL_GPUS = ("GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd")
