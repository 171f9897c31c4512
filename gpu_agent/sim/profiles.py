"""GPU models and the built-in machines the simulator can be.

Numbers are those NVML reports on real hardware with a 550-series driver (`nvidia-smi -q`,
`nvidia-smi mig -lgip` and `-lgipp`); MIG memory sizes are the profiles' memorySizeMB. The H100's
match a real H100 with driver 580 value for value (tests/data/captures/h100-580-vm, checked by
tests/test_sim_profiles.py); the H200's table was read from a real H200 with driver 580.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GiProfile:
    constant: str  # the NVML_GPU_INSTANCE_PROFILE_* it answers to
    id: int
    name: str
    slices: int
    instances: int
    multiprocessors: int
    memory_mib: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    starts: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class GpuModel:
    key: str
    name: str  # what nvmlDeviceGetName returns
    memory_mib: int
    compute_capability: tuple[int, int]
    pci_device_id: int
    idle_temp_c: int
    idle_power_w: int
    max_power_w: int
    mig_profiles: tuple[GiProfile, ...] = ()
    reserved_mib: int = 0  # the driver's own memory, which NVML's v1 memory info counts as used
    mig_needs_reset: bool = False  # Ampere: a MIG mode change waits for a GPU reset (Hopper's is immediate)

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)


def _p(constant: str, id: int, name: str, slices: int, instances: int, sms: int, mem: int,
       ce: int, dec: int, enc: int, jpeg: int, ofa: int, starts: tuple[int, ...], size: int) -> GiProfile:
    return GiProfile(f"NVML_GPU_INSTANCE_PROFILE_{constant}", id, f"MIG {name}", slices, instances, sms, mem,
                     ce, dec, enc, jpeg, ofa, starts, size)


_SEVEN = (0, 1, 2, 3, 4, 5, 6)

A100_SXM4_40GB = GpuModel(
    key="A100-SXM4-40GB", name="NVIDIA A100-SXM4-40GB", memory_mib=40960, compute_capability=(8, 0),
    pci_device_id=0x20B010DE, idle_temp_c=31, idle_power_w=54, max_power_w=400, mig_needs_reset=True,
    mig_profiles=(
        _p("1_SLICE", 19, "1g.5gb", 1, 7, 14, 4864, 1, 0, 0, 0, 0, _SEVEN, 1),
        _p("1_SLICE_REV1", 20, "1g.5gb+me", 1, 1, 14, 4864, 1, 1, 0, 1, 1, _SEVEN, 1),
        _p("1_SLICE_REV2", 15, "1g.10gb", 1, 4, 14, 9856, 1, 1, 0, 0, 0, (0, 2, 4, 6), 2),
        _p("2_SLICE", 14, "2g.10gb", 2, 3, 28, 9856, 2, 1, 0, 0, 0, (0, 2, 4), 2),
        _p("3_SLICE", 9, "3g.20gb", 3, 2, 42, 19968, 3, 2, 0, 0, 0, (0, 4), 4),
        _p("4_SLICE", 5, "4g.20gb", 4, 1, 56, 19968, 4, 2, 0, 0, 0, (0,), 4),
        _p("7_SLICE", 0, "7g.40gb", 7, 1, 98, 40192, 7, 5, 0, 1, 1, (0,), 8),
    ),
)

# `nvidia-smi mig -lgip` of an A100-SXM4-80GB with a 580-series driver.
A100_SXM4_80GB = GpuModel(
    key="A100-SXM4-80GB", name="NVIDIA A100-SXM4-80GB", memory_mib=81920, compute_capability=(8, 0),
    pci_device_id=0x20B210DE, idle_temp_c=32, idle_power_w=60, max_power_w=400, mig_needs_reset=True,
    mig_profiles=(
        _p("1_SLICE", 19, "1g.10gb", 1, 7, 14, 9728, 1, 0, 0, 0, 0, _SEVEN, 1),
        _p("1_SLICE_REV1", 20, "1g.10gb+me", 1, 1, 14, 9728, 1, 1, 0, 1, 1, _SEVEN, 1),
        _p("1_SLICE_REV2", 15, "1g.20gb", 1, 4, 14, 19968, 1, 1, 0, 0, 0, (0, 2, 4, 6), 2),
        _p("2_SLICE", 14, "2g.20gb", 2, 3, 28, 19968, 2, 2, 0, 0, 0, (0, 2, 4), 2),
        _p("3_SLICE", 9, "3g.40gb", 3, 2, 42, 40192, 3, 3, 0, 0, 0, (0, 4), 4),
        _p("4_SLICE", 5, "4g.40gb", 4, 1, 56, 40192, 4, 4, 0, 0, 0, (0,), 4),
        _p("7_SLICE", 0, "7g.80gb", 7, 1, 98, 80896, 7, 5, 0, 1, 1, (0,), 8),
    ),
)

H100_80GB_HBM3 = GpuModel(
    key="H100-80GB-HBM3", name="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability=(9, 0),
    reserved_mib=480,  # an idle H100 with driver 580 (../shared/hardware/h100-580-vm, NVML memory v2)
    pci_device_id=0x233010DE, idle_temp_c=29, idle_power_w=70, max_power_w=700,
    mig_profiles=(
        _p("1_SLICE", 19, "1g.10gb", 1, 7, 16, 9984, 1, 1, 0, 1, 0, _SEVEN, 1),
        _p("1_SLICE_REV1", 20, "1g.10gb+me", 1, 1, 16, 9984, 1, 1, 0, 1, 1, _SEVEN, 1),
        _p("1_SLICE_REV2", 15, "1g.20gb", 1, 4, 26, 20096, 1, 1, 0, 1, 0, (0, 2, 4, 6), 2),
        _p("2_SLICE", 14, "2g.20gb", 2, 3, 32, 20096, 2, 2, 0, 2, 0, (0, 2, 4), 2),
        _p("3_SLICE", 9, "3g.40gb", 3, 2, 60, 40448, 3, 3, 0, 3, 0, (0, 4), 4),
        _p("4_SLICE", 5, "4g.40gb", 4, 1, 64, 40448, 4, 4, 0, 4, 0, (0,), 4),
        _p("7_SLICE", 0, "7g.80gb", 7, 1, 132, 81152, 8, 7, 0, 7, 1, (0,), 8),
    ),
)

# Name, memory, PCI id, profile ids, counts, memory sizes and placements as NVML reports them on a real
# H200 with driver 580 (`nvidia-smi mig -lgip/-lgipp`); multiprocessor and engine counts are the
# H100's, the same GH100 die.
H200 = GpuModel(
    key="H200", name="NVIDIA H200", memory_mib=143771, compute_capability=(9, 0),
    pci_device_id=0x233510DE, idle_temp_c=29, idle_power_w=75, max_power_w=700,
    mig_profiles=(
        _p("1_SLICE", 19, "1g.18gb", 1, 7, 16, 16384, 1, 1, 0, 1, 0, _SEVEN, 1),
        _p("1_SLICE_REV1", 20, "1g.18gb+me", 1, 1, 16, 16384, 1, 1, 0, 1, 1, _SEVEN, 1),
        _p("1_SLICE_REV2", 15, "1g.35gb", 1, 4, 26, 33280, 1, 1, 0, 1, 0, (0, 2, 4, 6), 2),
        _p("2_SLICE", 14, "2g.35gb", 2, 3, 32, 33280, 2, 2, 0, 2, 0, (0, 2, 4), 2),
        _p("3_SLICE", 9, "3g.71gb", 3, 2, 60, 71424, 3, 3, 0, 3, 0, (0, 4), 4),
        _p("4_SLICE", 5, "4g.71gb", 4, 1, 64, 71424, 4, 4, 0, 4, 0, (0,), 4),
        _p("7_SLICE", 0, "7g.141gb", 7, 1, 132, 143360, 8, 7, 0, 7, 1, (0,), 8),
    ),
)

A30 = GpuModel(
    key="A30", name="NVIDIA A30", memory_mib=24576, compute_capability=(8, 0),
    pci_device_id=0x20B710DE, idle_temp_c=33, idle_power_w=32, max_power_w=165, mig_needs_reset=True,
    mig_profiles=(
        _p("1_SLICE", 14, "1g.6gb", 1, 4, 14, 5952, 1, 1, 0, 0, 0, (0, 1, 2, 3), 1),
        _p("1_SLICE_REV1", 21, "1g.6gb+me", 1, 1, 14, 5952, 1, 1, 0, 1, 1, (0, 1, 2, 3), 1),
        _p("2_SLICE", 5, "2g.12gb", 2, 2, 28, 12032, 2, 2, 0, 0, 0, (0, 2), 2),
        _p("2_SLICE_REV1", 6, "2g.12gb+me", 2, 1, 28, 12032, 2, 2, 0, 1, 1, (0, 2), 2),
        _p("4_SLICE", 0, "4g.24gb", 4, 1, 56, 24192, 4, 4, 0, 1, 1, (0,), 4),
    ),
)

T4 = GpuModel(
    key="T4", name="Tesla T4", memory_mib=15360, compute_capability=(7, 5),
    pci_device_id=0x1EB810DE, idle_temp_c=38, idle_power_w=10, max_power_w=70,
)

MODELS = {model.key: model for model in (A100_SXM4_40GB, A100_SXM4_80GB, H100_80GB_HBM3, H200, A30, T4)}


@dataclass(frozen=True)
class Machine:
    """A simulated node: its driver and its GPUs, in PCI order."""

    name: str
    driver_version: Optional[str]  # None: no NVIDIA driver installed
    cuda_version: int  # as nvmlSystemGetCudaDriverVersion returns it: 12040 for 12.4
    gpus: tuple[tuple[GpuModel, str], ...]  # (model, PCI bus id as NVML writes it)
    nvswitches: tuple[str, ...] = ()  # PCI addresses, 0000:c4:00.0
    mellanox_nics: tuple[str, ...] = ()  # PCI addresses of ConnectX NICs (GPUDirect RDMA)
    nouveau: bool = False  # the distribution loaded nouveau at boot
    product_name: str = "Standard PC"  # DMI /sys/class/dmi/id/product_name
    numa_nodes: tuple[int, ...] = ()  # each GPU's NUMA node, in GPU order; none given: unknown (-1)
    pcie_paths: tuple[tuple[str, ...], ...] = ()  # each GPU's PCIe switches from its root port down
    nvlinks: int = 0  # NVLinks from each GPU into the NVSwitch fabric (all-to-all); 0: no NVLink
    passthrough: bool = False  # a VM whose GPUs are passed through (NVML's virtualization mode)
    audio: tuple[bool, ...] = ()  # each GPU's HD audio function (function 1 of its slot), in GPU order


_DGX_A100_BUSES = ("07", "0F", "47", "4E", "87", "90", "B7", "BD")
_DGX_H100_BUSES = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


def _buses(model: GpuModel, buses: tuple[str, ...]) -> tuple[tuple[GpuModel, str], ...]:
    return tuple((model, f"00000000:{bus}:00.0") for bus in buses)


def _addresses(*buses: str) -> tuple[str, ...]:
    return tuple(f"0000:{bus}:00.0" for bus in buses)


# DGX boards: two CPU sockets, GPUs 0-3 on NUMA node 0 and 4-7 on node 1, every GPU NVLinked to every
# other through the NVSwitches (`nvidia-smi topo -m` shows NV12 on a DGX A100, NV18 on a DGX H100/H200).
# A DGX A100 pairs its GPUs under two-level PCIe switches (GPUs 0-1, 2-3, 4-5, 6-7: PXB); a DGX H100
# gives each GPU its own PCIe switch (with its NIC), so its GPUs meet only at the CPU (NODE or SYS).
_DGX_NUMA = (0, 0, 0, 0, 1, 1, 1, 1)
_DGX_A100_PCIE = tuple((f"pex{n // 2}", f"pex{n // 2}.{n % 2}") for n in range(8))
_DGX_H100_PCIE = tuple((f"pex{n}",) for n in range(8))


BUILT_IN = {
    "dgx-a100": Machine("dgx-a100", "550.90.07", 12040, _buses(A100_SXM4_40GB, _DGX_A100_BUSES),
                        nvswitches=_addresses("c4", "c5", "c6", "c7", "c8", "c9"),
                        mellanox_nics=_addresses("0c", "12", "54", "5a", "8d", "94", "ba", "cc"),
                        product_name="DGXA100 920-23687-2530-000",
                        numa_nodes=_DGX_NUMA, pcie_paths=_DGX_A100_PCIE, nvlinks=12),
    "dgx-h100": Machine("dgx-h100", "550.90.07", 12040, _buses(H100_80GB_HBM3, _DGX_H100_BUSES),
                        nvswitches=_addresses("05", "06", "07", "08"),
                        mellanox_nics=_addresses("1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc"),
                        product_name="DGXH100", numa_nodes=_DGX_NUMA, pcie_paths=_DGX_H100_PCIE, nvlinks=18),
    "dgx-h200": Machine("dgx-h200", "550.90.07", 12040, _buses(H200, _DGX_H100_BUSES),
                        nvswitches=_addresses("05", "06", "07", "08"),
                        mellanox_nics=_addresses("1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc"),
                        product_name="DGXH200", numa_nodes=_DGX_NUMA, pcie_paths=_DGX_H100_PCIE, nvlinks=18),
    "a30": Machine("a30", "550.90.07", 12040, _buses(A30, ("3B",)), product_name="PowerEdge R750xa"),
    "t4": Machine("t4", "550.90.07", 12040, ((T4, "00000000:00:1E.0"),), product_name="g4dn.xlarge"),
    "none": Machine("none", None, 0, ()),
}
