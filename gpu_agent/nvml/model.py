"""What the agent knows about GPUs, as plain data that every output reads."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Optional

from gpu_agent.host.pci import Vgpu


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile a MIG-capable GPU supports, with its possible placements."""

    name: str  # e.g. "1g.10gb"
    id: int  # the id NVML creation calls take
    slices: int
    instances: int
    multiprocessors: int
    memory_mib: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[tuple[int, int], ...]  # (start, size)
    # The NVML_GPU_INSTANCE_PROFILE_* constant NVML answered for, without that prefix ("1_SLICE_REV1"): what
    # go-nvlib, and so mig-parted, names the profile by (its attributes); "" where not known.
    constant: str = ""


@dataclass(frozen=True)
class MigDevice:
    """What CUDA and containers see of a compute instance: one MIG device, as NVML enumerates them."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "3g.40gb", "1c.3g.40gb"
    memory_mib: int
    multiprocessors: int
    placement: Optional[tuple[int, int]]  # of its GPU instance


@dataclass(frozen=True)
class ComputeInstance:
    id: int
    profile_id: int  # the id NVML creation calls take
    profile: str  # the MIG device it makes: "3g.40gb", "1c.3g.40gb"
    slices: int  # compute slices
    placement: tuple[int, int]  # (start, size) in compute slices of its GPU instance
    multiprocessors: int
    uuid: str  # of its MIG device
    device_index: int  # its position among the GPU's MIG devices (nvmlDeviceGetMigDeviceHandleByIndex)


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance with its compute instances; one without any is visible here, though no MIG device."""

    id: int
    profile_id: int
    profile: str  # e.g. "3g.40gb", "1g.10gb+me"
    slices: int  # compute slices
    placement: tuple[int, int]  # (start, size) in memory slices
    memory_mib: int
    compute_instances: tuple[ComputeInstance, ...] = ()


@dataclass(frozen=True)
class MigState:
    capable: bool
    enabled: bool = False
    pending_enabled: bool = False
    gpu_instances: tuple[GpuInstance, ...] = ()
    profiles: tuple[MigProfile, ...] = ()

    @cached_property
    def devices(self) -> tuple[MigDevice, ...]:
        """The MIG devices (one per compute instance), in NVML's order; worked out once per reading (the
        readiness checks ask for them at every publish of the model)."""
        found = [
            (ci.device_index, MigDevice(ci.uuid, gi.id, ci.id, ci.profile, gi.memory_mib, ci.multiprocessors,
                                        gi.placement))
            for gi in self.gpu_instances for ci in gi.compute_instances
        ]
        return tuple(device for _, device in sorted(found, key=lambda pair: pair[0]))


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    pci_bus_id: str
    product: str
    memory_mib: int
    compute_capability: tuple[int, int]
    minor_number: int
    mig: MigState
    pci_device_id: int = 0  # 0xDDDDVVVV, as mig-parted's device-filter writes it
    pci_subsystem_id: int = 0  # 0xSSSSssss
    numa_node: Optional[int] = None  # the CPU NUMA node it hangs off (sysfs numa_node); None: unknown (-1, a VM)
    pci_class: Optional[int] = None  # sysfs class: 0x030200 a 3D controller (compute), 0x030000 VGA; None: unread
    vgpu: Optional[Vgpu] = None  # the vGPU capability in its PCI config space; None: config space unread
    # Why NVML cannot read it now ("nvmlDeviceGetHandleByIndex: GPU is lost"); "": read whole. Such a GPU is
    # a fact about that GPU, not a failed inventory: its record holds what is known of it (known_from).
    unreadable: str = ""
    known_from: str = "nvml"  # NVML (read now), LAST_READING or IDENTITY

    @property
    def device_node(self) -> str:
        return f"nvidia{self.minor_number}"

    @property
    def details_known(self) -> bool:
        """Whether its MIG state, memory and compute capability are known (read now or as last read): a GPU
        known by its identity alone has none of them."""
        return self.known_from != IDENTITY


# Where an unreadable GPU's record comes from: the last reading of it at its index and bus id (the daemon's),
# or its identity alone (UUID, bus id, product, device minor: what NVML still answers of it, and the driver's
# /proc/driver/nvidia/gpus/<bus id>/information), nothing of its MIG state, memory or compute capability.
LAST_READING = "last reading"
IDENTITY = "identity only"


@dataclass(frozen=True)
class UnidentifiedGpu:
    """A GPU NVML counts but cannot read, and nothing else names (no earlier reading, no driver record)."""

    index: int
    reason: str


# How far apart two GPUs are on PCIe, in nvidia-smi topo's words (NVML's nvmlGpuTopologyLevel_t), nearest first.
PCIE_LEVELS = ("BOARD", "PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs (by index, a < b) reach each other."""

    a: int
    b: int
    nvlinks: int = 0  # NVLink links joining them, directly or through NVSwitch; 0: none
    pcie: str = ""  # their nearest common PCIe ancestor (PCIE_LEVELS); "": unknown

    @property
    def kind(self) -> str:
        """`NV18`, `PIX`, `SYS`, ... as `nvidia-smi topo -m` writes it; `unknown` where NVML did not say."""
        return f"NV{self.nvlinks}" if self.nvlinks else self.pcie or "unknown"


@dataclass(frozen=True)
class Inventory:
    driver_version: str
    cuda_version: str  # "12.4"
    gpus: tuple[Gpu, ...] = ()
    links: tuple[GpuLink, ...] = ()  # one per pair of GPUs NVML could relate; none on a one-GPU node
    unidentified: tuple[UnidentifiedGpu, ...] = ()  # beside `gpus`: counted by NVML, unreadable, unnamed

    @property
    def readable(self) -> tuple[Gpu, ...]:
        """The GPUs NVML read whole in this reading: those its queries and changes may address."""
        return tuple(gpu for gpu in self.gpus if not gpu.unreadable)

    @property
    def count(self) -> int:
        """Every GPU NVML counts, readable or not."""
        return len(self.gpus) + len(self.unidentified)

    def unreadable_notes(self) -> list[str]:
        """`GPU 3 (GPU-...): NVML cannot read it: ...`, one per GPU NVML could not read."""
        return ([f"GPU {gpu.index} ({gpu.uuid}): NVML cannot read it: {gpu.unreadable}"
                 for gpu in self.gpus if gpu.unreadable]
                + [f"GPU {gpu.index}: NVML cannot read it: {gpu.reason}" for gpu in self.unidentified])

    def link(self, a: int, b: int) -> Optional[GpuLink]:
        """How GPUs `a` and `b` (indexes) are connected, or None where it is not known."""
        low, high = min(a, b), max(a, b)
        return next((link for link in self.links if (link.a, link.b) == (low, high)), None)

    def summary(self) -> str:
        """`8x H100 80GB HBM3, driver 550.90.07`, the way an operator names a node."""
        products: dict[str, int] = {}
        for gpu in self.gpus:
            name = gpu.product.removeprefix("NVIDIA ")
            products[name] = products.get(name, 0) + 1
        kinds = " + ".join(f"{count}x {name}" for name, count in products.items())
        return f"{kinds}, driver {self.driver_version}"


@dataclass(frozen=True)
class MigSample:
    """Framebuffer of one GPU instance (read through its first MIG device) and its GPM profiling metrics,
    as dcgm-exporter reports them per GPU instance."""

    gpu_instance_id: int
    profile: str  # the GPU instance's profile, e.g. "3g.40gb"
    memory_used_mib: Optional[float] = None
    memory_free_mib: Optional[float] = None
    memory_reserved_mib: Optional[float] = None
    gr_engine_active: Optional[float] = None  # GPM of the GPU instance (nvmlGpmMigSampleGet), as for a GpuSample
    pipe_tensor_active: Optional[float] = None
    dram_active: Optional[float] = None
    pcie_tx_bytes: Optional[float] = None
    pcie_rx_bytes: Optional[float] = None


@dataclass(frozen=True)
class GpuSample:
    """Metrics of one GPU, taken in the background so that a scrape never calls NVML. None: the GPU
    or driver does not report it (never a made-up value)."""

    utilization_percent: Optional[float] = None
    memory_used_mib: Optional[float] = None
    memory_free_mib: Optional[float] = None
    memory_reserved_mib: Optional[float] = None  # None where the driver has no NVML v2 memory info
    temperature_c: Optional[float] = None
    power_w: Optional[float] = None
    sm_clock_mhz: Optional[float] = None
    memory_clock_mhz: Optional[float] = None
    energy_mj: Optional[float] = None  # since the driver loaded
    pcie_replays: Optional[float] = None
    memory_copy_utilization_percent: Optional[float] = None
    encoder_utilization_percent: Optional[float] = None
    decoder_utilization_percent: Optional[float] = None
    correctable_remapped_rows: Optional[float] = None
    uncorrectable_remapped_rows: Optional[float] = None
    row_remap_failure: Optional[float] = None  # 1 when a row remapping failed
    memory_temperature_c: Optional[float] = None  # HBM temperature (NVML field value NVML_FI_DEV_MEMORY_TEMP)
    nvlink_data_kib: Optional[float] = None  # NVLink data received and sent on all links, a counter; None: no NVLink
    nvlink_bandwidth_total: Optional[float] = None  # from two samples' nvlink_data_kib, as DCGM works it out
    # NVML GPM (Hopper and later) over the interval between two samples, in DCGM's units: ratios 0-1, bytes/s
    gr_engine_active: Optional[float] = None
    pipe_tensor_active: Optional[float] = None
    dram_active: Optional[float] = None
    pcie_tx_bytes: Optional[float] = None
    pcie_rx_bytes: Optional[float] = None
    profiling_unavailable: Optional[str] = None  # why the GPM series above are left out
    clock_event_reasons: Optional[int] = None  # NVML's bitmask of why the clocks are held down now
    mig: tuple[MigSample, ...] = ()  # by GPU instance, where MIG is enabled


@dataclass(frozen=True)
class XidEvent:
    gpu_uuid: str
    xid: int
    at: float  # unix time
    gpu_instance_id: Optional[int] = None  # on a MIG device: the GPU instance NVML attributes it to
    compute_instance_id: Optional[int] = None


@dataclass(frozen=True)
class HealthReading:
    """What the periodic health checks read from one GPU; None where the GPU does not report it."""

    pending_remaps: Optional[bool] = None  # rows waiting for a remap (or pages for retirement) at next reset
    pending_kind: str = "row remapping"  # or "page retirement", on GPUs without row remapping
    remap_failed: Optional[bool] = None
    temperature_c: Optional[int] = None
    slowdown_c: Optional[int] = None  # the temperature at which the GPU slows itself down


@dataclass(frozen=True)
class GpuHealth:
    """Replaced, never changed: the watcher threads publish a new one, HTTP handlers read the old."""

    xid_reason: str = ""  # a critical XID was seen; clears after health.recover_after_seconds without another
    query_error: str = ""  # NVML queries on this GPU fail; clears when they answer again
    last_xid: Optional[int] = None
    xid_counts: tuple[tuple[int, int], ...] = ()  # (xid, count), sorted
    critical_at: Optional[float] = None  # when the last critical XID was seen (unix time)
    lost: bool = False  # off the bus (XID 79): unhealthy until NVML answers for it again at its bus id
    missing: bool = False  # lost, and NVML has since failed to answer for it
    check_reason: str = ""  # a periodic check fails (pending row remaps, temperature...); clears when it passes

    @property
    def healthy(self) -> bool:
        return not (self.xid_reason or self.query_error or self.check_reason)

    @property
    def reason(self) -> str:
        return "; ".join(r for r in (self.xid_reason, self.query_error, self.check_reason) if r)


def to_json(value: Any) -> Any:
    """Dataclasses to JSON-ready dicts (tuples become lists)."""
    return asdict(value)
