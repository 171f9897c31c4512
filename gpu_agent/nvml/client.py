"""The one narrow way into NVML.

`lib` is the pynvml module, or anything with its surface: same function names, same NVMLError
classes, so this code runs unchanged in tests. NVML is initialised once per process, and every
call runs on a worker thread with a timeout so a hung driver cannot hang the agent.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, NamedTuple, Optional, TypeVar, cast

from gpu_agent.errors import AgentError
from gpu_agent.host.pci import numa_node
from gpu_agent.host.paths import Root
from gpu_agent.host.threads import daemon_thread
from gpu_agent.printable import printable
from gpu_agent.nvml.model import (
    ComputeInstance,
    Gpu,
    GpuInstance,
    GpuLink,
    GpuSample,
    HealthReading,
    Inventory,
    MigProfile,
    MigSample,
    MigState,
    XidEvent,
)

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
log = logging.getLogger(__name__)

MIB = 1024 * 1024
_NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId when it is not on a MIG device
ALL_LINKS = 0xFFFFFFFF  # a field value's scopeId for "every NVLink of the GPU", as DCGM passes it

# The NVML field values sampled: (GpuSample field or part of one, pynvml constant, scope).
SAMPLED_FIELDS = (
    ("memory_temperature_c", "NVML_FI_DEV_MEMORY_TEMP", 0),
    ("nvlink_rx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS),
    ("nvlink_tx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS),
)
# The NVML GPM metrics sampled: (GpuSample field, pynvml constant, factor to DCGM's unit). GPM answers
# percentages where DCGM's PROF fields are ratios, and MiB/s where DCGM says bytes/s.
GPM_METRICS = (
    ("gr_engine_active", "NVML_GPM_METRIC_GRAPHICS_UTIL", 0.01),
    ("pipe_tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    ("pcie_tx_bytes", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", float(MIB)),
    ("pcie_rx_bytes", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", float(MIB)),
)
# The union member each NVML_VALUE_TYPE_* is read from, by its number.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

# NVML_GPU_INSTANCE_PROFILE_* constants worth asking about, in the order nvidia-smi lists them.
_GI_PROFILE_CONSTANTS = (
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE",
)

# The compute instance profile constant of each size (NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_PROFILE_BY_SLICES = {
    1: "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE",
    2: "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
    3: "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE",
    4: "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
    6: "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE",
    7: "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
    8: "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE",
}

# nvmlDeviceGetTopologyCommonAncestor's levels in nvidia-smi topo's words.
_PCIE_LEVELS = {0: "BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

_INIT_REMEDIES = {
    "NVMLError_LibraryNotFound": "NVML library (libnvidia-ml.so.1) not found: the NVIDIA driver is not installed",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded (modprobe nvidia, or check dmesg)",
    "NVMLError_NoPermission": "no permission to open /dev/nvidiactl: run the agent as root",
    "NVMLError_LibRmVersionMismatch": (
        "NVML library and kernel module versions differ (half-finished driver upgrade): "
        "reload the nvidia modules or reboot"
    ),
}


def _changes_gpus(method: _F) -> _F:
    """A call that changes the GPUs' MIG geometry: the inventory read before it is not reused, even when
    the call fails half-way."""

    @functools.wraps(method)
    def changing(self: Nvml, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._identities = {}
            self.forget_inventory()

    return cast(_F, changing)


class _GpuIdentity(NamedTuple):
    uuid: str
    pci_bus_id: str
    product: str
    compute_capability: tuple[int, int]
    minor_number: int
    pci_device_id: int
    pci_subsystem_id: int
    numa_node: Optional[int]
    mig_mode: Optional[tuple[int, int]]  # as it was read with the rest


class DriverView(NamedTuple):
    version: str
    bus_ids: list[str]
    persistence: Optional[list[bool]]  # by GPU index, when asked for


class NvmlUnavailable(AgentError):
    """NVML cannot be initialised: no driver, driver not loaded, version mismatch."""

    def __init__(self, message: str, no_driver: bool = False) -> None:
        super().__init__(message)
        self.no_driver = no_driver


class NvmlHung(AgentError):
    """An NVML call did not return in time; the driver is presumed hung."""


class _TimedCalls:
    """Runs calls on worker threads; a call past its timeout marks NVML hung until it returns.

    The workers are daemon threads: one stuck in a hung driver must not keep the process from
    exiting on SIGTERM (a ThreadPoolExecutor's workers are joined at exit).
    """

    _WORKERS = 4

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_worker = threading.local()
        for n in range(self._WORKERS):
            daemon_thread(self._work, f"nvml-{n}").start()
        self._lock = threading.Lock()
        self._stuck: dict[Future[Any], tuple[str, float]] = {}
        self.timeouts = 0

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, extra_timeout: float = 0.0) -> Any:
        batch = getattr(self._on_worker, "future", None)
        if batch is not None:  # a call within a batch (Nvml.sample): the batch's timeout covers it
            batch.current_call = name  # what a timeout of the batch names
            return fn(*args)
        with self._lock:
            if self._stuck:
                stuck_name, since = next(iter(self._stuck.values()))
                raise NvmlHung(
                    f"NVML call {stuck_name} has not returned for {time.monotonic() - since:.0f} s "
                    f"(the driver looks hung); {name} not attempted"
                )
        started = time.monotonic()
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        try:
            return future.result(timeout=self.timeout + extra_timeout)
        except FutureTimeout:
            name = getattr(future, "current_call", name)
            with self._lock:
                self.timeouts += 1
                self._stuck[future] = (name, started)
            future.add_done_callback(self._unstick)
            raise NvmlHung(
                f"NVML call {name} did not return within {self.timeout + extra_timeout:g} s (the driver looks hung)"
            ) from None

    def _unstick(self, future: Future[Any]) -> None:
        with self._lock:
            name, since = self._stuck.pop(future, ("?", 0.0))
        log.warning("NVML call %s returned after %.1f s; NVML is usable again", name, time.monotonic() - since)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            self._on_worker.future = future
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)
            finally:
                self._on_worker.future = None

    def close(self) -> None:
        for _ in range(self._WORKERS):
            self._queue.put(None)


class Nvml:
    def __init__(self, lib: Any, call_timeout: float = 5.0, root: Optional[Root] = None) -> None:
        """`root`: where the GPUs' NUMA nodes are read (sysfs); without it they are unknown."""
        self.lib = lib
        self.root = root
        self._call = _TimedCalls(call_timeout)
        self._init_lock = threading.Lock()
        self._initialised = False
        self._static: dict[str, tuple[MigProfile, ...]] = {}  # MIG profile tables by GPU UUID
        self._ci_profiles: dict[tuple[str, int], tuple[Any, ...]] = {}  # by (GPU UUID, GPU instance profile id)
        self._mig_ids: dict[str, dict[str, tuple[int, int]]] = {}  # by GPU UUID: MIG device UUID -> (GI, CI id)
        self._memory_v2: Optional[bool] = None  # whether the driver has NVML's v2 memory info
        self._links: dict[tuple[str, ...], tuple[GpuLink, ...]] = {}  # by the GPUs' bus ids: hardware, read once
        self._links_complete = True  # no unexpected NVML error while reading them (else read again next time)
        # The inventory read last in this reconcile pass, kept for the next stage that wants one (discovery
        # after the mig stage) while nothing changed the GPUs since. `_generation` counts the pass starts and
        # the changes this agent made: a reading taken across one of them is not kept. Generation 0: no
        # pass has begun (a one-shot command, a test's engine), so nothing is kept.
        self._generation = 0
        self._reading: Optional[Inventory] = None
        self._reading_lock = threading.Lock()
        self._batch = threading.local()  # `handles`: the GPU handles asked for in the batch running on this thread
        # By GPU index: the MIG layout sampled last and its MIG devices' handles by device index. A MIG
        # device's handle lasts as long as the device; a new layout, or a pass's start, asks again.
        self._mig_handles: dict[int, tuple[MigState, dict[int, Any]]] = {}
        self._gpm_request = threading.local()  # `request`: this thread's nvmlGpmMetricsGet request
        # By GPU index: what cannot change while NVML is initialised (the board, its bus id and minor
        # number), read once rather than at every pass; a MIG change or reset by this agent reads it again.
        self._identities: dict[int, _GpuIdentity] = {}

    @property
    def call_timeout(self) -> float:
        return self._call.timeout

    @call_timeout.setter
    def call_timeout(self, seconds: float) -> None:
        self._call.timeout = seconds

    @property
    def timeouts(self) -> int:
        return self._call.timeouts

    def _nvml(self, name: str, *args: Any, extra_timeout: float = 0.0) -> Any:
        try:
            result = self._call(name, getattr(self.lib, name), *args, extra_timeout=extra_timeout)
        except self.lib.NVMLError as exc:
            exc.call = name  # so a message can say which query failed
            raise
        return printable(result) if type(result) is str else result  # a name, UUID or version: shown everywhere

    def init(self) -> None:
        """Initialise NVML once per process; later calls are free. Raises NvmlUnavailable."""
        if self._initialised:
            return
        with self._init_lock:
            if self._initialised:
                return
            try:
                self._nvml("nvmlInit")
            except self.lib.NVMLError as exc:
                kind = type(exc).__name__
                reason = _INIT_REMEDIES.get(kind, f"NVML initialisation failed: {exc}")
                raise NvmlUnavailable(reason, no_driver=kind == "NVMLError_LibraryNotFound") from None
            self._identities = {}
            self._initialised = True

    def close(self) -> None:
        with self._init_lock:
            if self._initialised:
                try:
                    self._nvml("nvmlShutdown")
                except (self.lib.NVMLError, NvmlHung) as exc:
                    log.debug("nvmlShutdown: %s", exc)
                self._initialised = False
        self._call.close()

    # --- inventory ---------------------------------------------------------------------------

    def inventory(self) -> Inventory:
        """Every GPU and its MIG geometry, read now."""
        self.init()
        generation = self._generation
        # Its queries (hundreds with MIG) go to an NVML worker as one batch, under one timeout that names
        # the call that hung: a thread hop per GPU or per call cost more than the queries.
        inventory = self._call("nvmlDevice*(inventory)", self._batched, self._inventory)
        with self._reading_lock:
            if generation and generation == self._generation:
                self._reading = inventory
        return inventory

    def _inventory(self) -> Inventory:
        driver = self._nvml("nvmlSystemGetDriverVersion")
        cuda = self._nvml("nvmlSystemGetCudaDriverVersion")
        gpus = tuple(self._gpu(index) for index in range(self._nvml("nvmlDeviceGetCount")))
        return Inventory(driver_version=driver, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}", gpus=gpus,
                         links=self.links(gpus))

    def pass_inventory(self) -> Inventory:
        """The inventory read earlier in this reconcile pass (the mig stage reads it just before discovery)
        when nothing the agent did has changed the GPUs since; else one read now. With MIG, a reading is
        hundreds of NVML calls."""
        reading = self._reading
        return reading if reading is not None else self.inventory()

    def begin_pass(self) -> None:
        """A reconcile pass starts: what was read before it is not reused (another tool may have changed
        the GPUs between passes)."""
        self.forget_inventory()

    def forget_inventory(self) -> None:
        """The GPUs changed (a MIG change, a GPU reset): the next pass_inventory() reads them again."""
        with self._reading_lock:
            self._generation += 1
            self._reading = None
            self._mig_handles = {}

    def _gpu(self, index: int) -> Gpu:
        handle = self._handle(index)
        mode = self._mig_mode(handle)
        identity = self._identities.get(index)
        if identity is None or identity.mig_mode != mode:  # a MIG mode change may rebind the GPU (a new minor)
            identity = self._identities[index] = self._identity(handle, mode)
        memory = self._nvml("nvmlDeviceGetMemoryInfo", handle)
        return Gpu(
            index=index,
            uuid=identity.uuid,
            pci_bus_id=identity.pci_bus_id,
            product=identity.product,
            memory_mib=memory.total // (1024 * 1024),
            compute_capability=identity.compute_capability,
            minor_number=identity.minor_number,
            mig=self._mig(handle, identity.uuid, mode),
            pci_device_id=identity.pci_device_id,
            pci_subsystem_id=identity.pci_subsystem_id,
            numa_node=identity.numa_node,
        )

    def _identity(self, handle: Any, mig_mode: Optional[tuple[int, int]]) -> _GpuIdentity:
        uuid = self._nvml("nvmlDeviceGetUUID", handle)
        pci = self._nvml("nvmlDeviceGetPciInfo", handle)
        major, minor = self._nvml("nvmlDeviceGetCudaComputeCapability", handle)
        bus_id = _short_bus_id(pci.busId)
        return _GpuIdentity(
            uuid=uuid, pci_bus_id=bus_id, product=self._nvml("nvmlDeviceGetName", handle),
            compute_capability=(major, minor), minor_number=self._nvml("nvmlDeviceGetMinorNumber", handle),
            pci_device_id=pci.pciDeviceId, pci_subsystem_id=pci.pciSubSystemId,
            numa_node=numa_node(self.root, bus_id) if self.root else None, mig_mode=mig_mode,
        )

    # --- topology --------------------------------------------------------------------------------

    def links(self, gpus: tuple[Gpu, ...]) -> tuple[GpuLink, ...]:
        """How each pair of GPUs is connected: NVLinks (direct, or through NVSwitch where NVML says the
        pair can talk over NVLink) and their nearest common PCIe ancestor. Read once per set of GPUs,
        as it changes only with the hardware; what NVML does not support stays unknown."""
        key = tuple(gpu.pci_bus_id for gpu in gpus)
        if key in self._links:
            return self._links[key]
        self._links_complete = True
        handles = [self._handle(gpu.index) for gpu in gpus]
        reach = [self._nvlink_reach(handle) for handle in handles]
        links = []
        for i, a in enumerate(gpus):
            for j in range(i + 1, len(gpus)):
                b = gpus[j]
                nvlinks = reach[i][0].get(b.pci_bus_id, 0)
                if reach[i][1] and reach[j][1] and self._p2p_over_nvlink(handles[i], handles[j]):
                    nvlinks += min(reach[i][1], reach[j][1])
                level = self._optional("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
                links.append(GpuLink(a.index, b.index, nvlinks, _PCIE_LEVELS.get(level, "")))
        if self._links_complete:
            self._links[key] = tuple(links)
        return tuple(links)

    def _nvlink_reach(self, handle: Any) -> tuple[dict[str, int], int]:
        """A GPU's active NVLinks: (links by the peer GPU's bus id, links into NVSwitches)."""
        lib = self.lib
        direct: dict[str, int] = {}
        switched = 0
        for link in range(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active = self._nvml("nvmlDeviceGetNvLinkState", handle, link)
            except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_InvalidArgument):
                break  # no NVLink, or past this GPU's last link (they are numbered from 0)
            except lib.NVMLError:
                self._links_complete = False
                break
            if active != lib.NVML_FEATURE_ENABLED:
                continue
            kind = self._optional("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind == getattr(lib, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                switched += 1
            elif kind == getattr(lib, "NVML_NVLINK_DEVICE_TYPE_GPU", 0):
                remote = self._optional("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                if remote is not None:
                    peer = _short_bus_id(_text(remote.busId))
                    direct[peer] = direct.get(peer, 0) + 1
        return direct, switched

    def _p2p_over_nvlink(self, a: Any, b: Any) -> bool:
        """Whether NVML says two GPUs can talk over NVLink (through NVSwitch this needs the fabric up);
        a driver that cannot say is taken at its links' word."""
        status = self._optional("nvmlDeviceGetP2PStatus", a, b, getattr(self.lib, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
        return status is None or status == getattr(self.lib, "NVML_P2P_STATUS_OK", 0)

    def _optional(self, name: str, *args: Any) -> Any:
        """A topology answer, or None where NVML does not have one (an unexpected error also leaves the
        topology unread for next time)."""
        lib = self.lib
        try:
            return self._nvml(name, *args)
        except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_InvalidArgument):
            return None
        except lib.NVMLError as exc:
            log.debug("%s", describe(exc))
            self._links_complete = False
            return None

    def _mig_mode(self, handle: Any) -> Optional[tuple[int, int]]:
        """(current, pending) MIG mode; None where the GPU has no MIG."""
        try:
            current, pending = self._nvml("nvmlDeviceGetMigMode", handle)
        except self.lib.NVMLError_NotSupported:
            return None
        return current, pending

    def _mig(self, handle: Any, uuid: str, mode: Optional[tuple[int, int]]) -> MigState:
        if mode is None:
            return MigState(capable=False)
        current, pending = mode
        enabled = current == self.lib.NVML_DEVICE_MIG_ENABLE
        if uuid not in self._static:
            self._static[uuid] = self._mig_profiles(handle)
        profiles = self._static[uuid]
        return MigState(
            capable=True,
            enabled=enabled,
            pending_enabled=pending == self.lib.NVML_DEVICE_MIG_ENABLE,
            gpu_instances=self._gpu_instances(handle, uuid, profiles) if enabled else (),
            profiles=profiles,
        )

    def _mig_profiles(self, handle: Any) -> tuple[MigProfile, ...]:
        profiles = []
        for constant in _GI_PROFILE_CONSTANTS:
            if not hasattr(self.lib, constant):
                continue
            try:
                info = self._nvml("nvmlDeviceGetGpuInstanceProfileInfo", handle, getattr(self.lib, constant))
            except (self.lib.NVMLError_NotSupported, self.lib.NVMLError_InvalidArgument):
                continue
            profiles.append(
                MigProfile(
                    name=_profile_name(info.name),
                    id=info.id,
                    slices=info.sliceCount,
                    instances=info.instanceCount,
                    multiprocessors=info.multiprocessorCount,
                    memory_mib=info.memorySizeMB,
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                    placements=self._placements(handle, info.id, info.instanceCount),
                )
            )
        return tuple(profiles)

    def _placements(self, handle: Any, profile_id: int, max_count: int) -> tuple[tuple[int, int], ...]:
        import ctypes

        placements = (self.lib.c_nvmlGpuInstancePlacement_t * max(max_count, 8))()
        count = ctypes.c_uint(len(placements))
        self._nvml("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, placements, ctypes.byref(count))
        return tuple((placements[i].start, placements[i].size) for i in range(count.value))

    def _gpu_instances(self, handle: Any, uuid: str, profiles: tuple[MigProfile, ...]) -> tuple[GpuInstance, ...]:
        """Every GPU instance, by profile, and under each its compute instances, as mig-parted walks them."""
        import ctypes

        devices = self._mig_device_uuids(handle, uuid)
        found = []
        taken: list[tuple[int, int]] = []  # the memory slices (start, size) of the GPU instances found so far
        for profile in profiles:
            if profile.placements and not any(_free(placement, taken) for placement in profile.placements):
                continue  # no GPU instance of this profile can sit beside those found: no need to ask NVML
            handles = (self.lib.c_nvmlGpuInstance_t * max(profile.instances, 1))()
            count = ctypes.c_uint(0)
            self._nvml("nvmlDeviceGetGpuInstances", handle, profile.id, handles, ctypes.byref(count))
            for gpu_instance in handles[: count.value]:
                info = self._nvml("nvmlGpuInstanceGetInfo", gpu_instance)
                taken.append((info.placement.start, info.placement.size))
                found.append(GpuInstance(
                    id=info.id, profile_id=profile.id, profile=profile.name, slices=profile.slices,
                    placement=(info.placement.start, info.placement.size), memory_mib=profile.memory_mib,
                    compute_instances=self._compute_instances(gpu_instance, info.id, profile, uuid, devices),
                ))
        return tuple(sorted(found, key=lambda gi: gi.id))

    def _compute_instance_profiles(self, gpu_instance: Any, key: tuple[str, int]) -> tuple[Any, ...]:
        """The compute instance profiles a GPU instance offers (the same for every GPU instance of a
        profile, so read once per GPU and profile)."""
        if key not in self._ci_profiles:
            profiles = []
            for constant in range(self.lib.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    profiles.append(self._nvml("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpu_instance, constant,
                                               self.lib.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED))
                except (self.lib.NVMLError_NotSupported, self.lib.NVMLError_InvalidArgument):
                    continue
            self._ci_profiles[key] = tuple(profiles)
        return self._ci_profiles[key]

    def _compute_instances(self, gpu_instance: Any, gi_id: int, gi_profile: MigProfile, uuid: str,
                           devices: dict[tuple[int, int], tuple[int, str]]) -> tuple[ComputeInstance, ...]:
        import ctypes

        found = []
        for profile in self._compute_instance_profiles(gpu_instance, (uuid, gi_profile.id)):
            handles = (self.lib.c_nvmlComputeInstance_t * max(profile.instanceCount, 1))()
            count = ctypes.c_uint(0)
            self._nvml("nvmlGpuInstanceGetComputeInstances", gpu_instance, profile.id, handles, ctypes.byref(count))
            for compute_instance in handles[: count.value]:
                info = self._nvml("nvmlComputeInstanceGetInfo", compute_instance)
                index, uuid = devices.get((gi_id, info.id), (-1, ""))
                found.append(ComputeInstance(
                    id=info.id, profile_id=profile.id, profile=_device_profile(gi_profile, profile.sliceCount),
                    slices=profile.sliceCount,
                    placement=(info.placement.start, info.placement.size),
                    multiprocessors=profile.multiprocessorCount, uuid=uuid, device_index=index,
                ))
        return tuple(sorted(found, key=lambda ci: ci.id))

    def _mig_device_uuids(self, handle: Any, gpu_uuid: str) -> dict[tuple[int, int], tuple[int, str]]:
        """(GPU instance id, compute instance id) -> (MIG device index, UUID). A MIG device's UUID is made
        with its compute instance and never names another, so its two ids are asked once per device:
        kept by UUID for the devices of the GPU's last reading."""
        known = self._mig_ids.get(gpu_uuid, {})
        seen: dict[str, tuple[int, int]] = {}
        devices = {}
        for slot in range(self._nvml("nvmlDeviceGetMaxMigDeviceCount", handle)):
            try:
                mig = self._nvml("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except self.lib.NVMLError_NotFound:
                continue
            uuid = self._nvml("nvmlDeviceGetUUID", mig)
            ids = known.get(uuid)
            if ids is None:
                ids = (self._nvml("nvmlDeviceGetGpuInstanceId", mig), self._nvml("nvmlDeviceGetComputeInstanceId", mig))
            seen[uuid] = ids
            devices[ids] = (slot, uuid)
        self._mig_ids[gpu_uuid] = seen
        return devices

    def mig_state(self, index: int) -> MigState:
        """One GPU's MIG mode and instances, read now (after a change)."""
        self.init()
        handle = self._handle(index)
        return self._mig(handle, self._nvml("nvmlDeviceGetUUID", handle), self._mig_mode(handle))

    # --- MIG changes -----------------------------------------------------------------------------

    @_changes_gpus
    def set_mig_mode(self, index: int, enabled: bool) -> Optional[str]:
        """Ask for MIG mode; None when it took effect, else why it is pending (NVML's activation status:
        Ampere needs a GPU reset, Hopper and later do not)."""
        self.init()
        handle = self._handle(index)
        mode = self.lib.NVML_DEVICE_MIG_ENABLE if enabled else self.lib.NVML_DEVICE_MIG_DISABLE
        status = self._nvml("nvmlDeviceSetMigMode", handle, mode)
        if status == self.lib.NVML_SUCCESS:
            return None
        return describe(self.lib.NVMLError(status))

    @_changes_gpus
    def create_gpu_instance(self, index: int, profile_id: int, placement: tuple[int, int]) -> int:
        """A GPU instance of the profile at exactly this placement; its id."""
        self.init()
        handle = self._handle(index)
        where = self.lib.c_nvmlGpuInstancePlacement_t()
        where.start, where.size = placement
        import ctypes

        gpu_instance = self._nvml("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id, ctypes.byref(where))
        return int(self._nvml("nvmlGpuInstanceGetInfo", gpu_instance).id)

    @_changes_gpus
    def create_compute_instance(self, index: int, gi_id: int, slices: int, start: int) -> int:
        """A compute instance of `slices` compute slices at `start` in GPU instance `gi_id`; its id."""
        import ctypes

        gpu_instance = self._gpu_instance(index, gi_id)
        constant = _CI_PROFILE_BY_SLICES.get(slices)
        if constant is None or not hasattr(self.lib, constant):
            raise self.lib.NVMLError(self.lib.NVML_ERROR_NOT_SUPPORTED)
        profile = self._nvml("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpu_instance, getattr(self.lib, constant),
                             self.lib.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        where = self.lib.c_nvmlComputeInstancePlacement_t()
        where.start, where.size = start, profile.sliceCount
        compute_instance = self._nvml("nvmlGpuInstanceCreateComputeInstanceWithPlacement", gpu_instance, profile.id,
                                      ctypes.byref(where))
        return int(self._nvml("nvmlComputeInstanceGetInfo", compute_instance).id)

    @_changes_gpus
    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        gpu_instance = self._gpu_instance(index, gi_id)
        compute_instance = self._nvml("nvmlGpuInstanceGetComputeInstanceById", gpu_instance, ci_id)
        self._nvml("nvmlComputeInstanceDestroy", compute_instance)

    @_changes_gpus
    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self._nvml("nvmlGpuInstanceDestroy", self._gpu_instance(index, gi_id))

    def _gpu_instance(self, index: int, gi_id: int) -> Any:
        self.init()
        handle = self._handle(index)
        return self._nvml("nvmlDeviceGetGpuInstanceById", handle, gi_id)

    # --- metrics and events --------------------------------------------------------------------

    def batch(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args), whose NVML calls go to a worker together, under one timeout (a timeout names the
        call that hung): for many quick queries, a thread hop each costs more than the queries."""
        self.init()
        return cast(_T, self._call(name, self._batched, fn, *args))

    def sample(self, index: int, mig: Optional[MigState] = None) -> GpuSample:
        """One GPU's metrics (and its GPU instances' framebuffer, given its MIG state); a metric the GPU
        does not support is left out, not faked. Its calls go to an NVML worker as one batch, under
        one timeout: a hop per call cost most of a sample's CPU."""
        self.init()
        return self._call(f"nvmlDeviceGet*(GPU {index})", self._batched, self._sample, index, mig)

    def _batched(self, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) on an NVML worker, asking for each GPU's handle once (a sample asks for it in every
        group of queries: metrics, processes, a GPM sample per GPU instance)."""
        if getattr(self._batch, "handles", None) is not None:  # a batch within a batch: the outer one's
            return fn(*args)
        self._batch.handles = {}
        try:
            return fn(*args)
        finally:
            self._batch.handles = None

    def _handle(self, index: int) -> Any:
        """The GPU's NVML handle; within a batch, asked for once."""
        handles: Optional[dict[int, Any]] = getattr(self._batch, "handles", None)
        if handles is None:
            return self._nvml("nvmlDeviceGetHandleByIndex", index)
        handle = handles.get(index)
        if handle is None:
            handle = handles[index] = self._nvml("nvmlDeviceGetHandleByIndex", index)
        return handle

    def _sample(self, index: int, mig: Optional[MigState]) -> GpuSample:
        handle = self._handle(index)
        lib = self.lib
        values: dict[str, Any] = {}

        def read(call: str, *args: Any, into: Callable[[Any], dict[str, float]]) -> None:
            try:
                values.update(into(self._nvml(call, handle, *args)))
            except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound):
                pass  # this GPU or driver does not report it

        read("nvmlDeviceGetUtilizationRates",
             into=lambda u: {"utilization_percent": float(u.gpu), "memory_copy_utilization_percent": float(u.memory)})
        read("nvmlDeviceGetTemperature", lib.NVML_TEMPERATURE_GPU, into=lambda c: {"temperature_c": float(c)})
        read("nvmlDeviceGetPowerUsage", into=lambda mw: {"power_w": mw / 1000.0})
        read("nvmlDeviceGetClockInfo", lib.NVML_CLOCK_SM, into=lambda mhz: {"sm_clock_mhz": float(mhz)})
        read("nvmlDeviceGetClockInfo", lib.NVML_CLOCK_MEM, into=lambda mhz: {"memory_clock_mhz": float(mhz)})
        read("nvmlDeviceGetTotalEnergyConsumption", into=lambda mj: {"energy_mj": float(mj)})
        read("nvmlDeviceGetPcieReplayCounter", into=lambda n: {"pcie_replays": float(n)})
        read("nvmlDeviceGetEncoderUtilization", into=lambda u: {"encoder_utilization_percent": float(u[0])})
        read("nvmlDeviceGetDecoderUtilization", into=lambda u: {"decoder_utilization_percent": float(u[0])})
        read("nvmlDeviceGetRemappedRows", into=lambda rows: {
            "correctable_remapped_rows": float(rows[0]), "uncorrectable_remapped_rows": float(rows[1]),
            "row_remap_failure": float(bool(rows[3]))})
        values.update(self._field_values(handle))
        try:
            values.update(_framebuffer(self._memory(handle)))
        except lib.NVMLError_NotSupported:
            pass
        if mig is not None and mig.enabled:
            values["mig"] = self._mig_samples(index, handle, mig)
        return GpuSample(**values)

    def _field_values(self, handle: Any) -> dict[str, float]:
        """SAMPLED_FIELDS in one call; a field the GPU does not report (its own nvmlReturn) is left out,
        and NVLink's counter only when both directions answer (no NVLink: no series)."""
        lib = self.lib
        wanted = [(key, getattr(lib, constant), scope) for key, constant, scope in SAMPLED_FIELDS
                  if hasattr(lib, constant)]
        try:
            answered = self._nvml("nvmlDeviceGetFieldValues", handle, [(field, scope) for _, field, scope in wanted])
        except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound):
            return {}
        found = {}
        for (key, _, _), value in zip(wanted, answered):
            if value.nvmlReturn == lib.NVML_SUCCESS and 0 <= value.valueType < len(_VALUE_MEMBERS):
                found[key] = float(getattr(value.value, _VALUE_MEMBERS[value.valueType]))
        rx, tx = found.pop("nvlink_rx_kib", None), found.pop("nvlink_tx_kib", None)
        if rx is not None and tx is not None:
            found["nvlink_data_kib"] = rx + tx
        return found

    def _mig_samples(self, index: int, handle: Any, mig: MigState) -> tuple[MigSample, ...]:
        samples = []
        for gi in mig.gpu_instances:
            first = min((ci.device_index for ci in gi.compute_instances if ci.device_index >= 0), default=None)
            if first is None:
                continue  # no compute instance: no MIG device to ask
            try:
                device = self._mig_device_handle(index, handle, mig, first)
                memory = _framebuffer(self._nvml("nvmlDeviceGetMemoryInfo", device))
            except self.lib.NVMLError_NotSupported:
                memory = {}
            samples.append(MigSample(gi.id, gi.profile, **memory))
        return tuple(samples)

    def _mig_device_handle(self, index: int, handle: Any, mig: MigState, device_index: int) -> Any:
        """A MIG device's handle, asked once per MIG layout of the GPU (and pass: see forget_inventory)."""
        known = self._mig_handles.get(index)
        if known is None or (known[0] is not mig and known[0] != mig):
            known = self._mig_handles[index] = (mig, {})
        device = known[1].get(device_index)
        if device is None:
            device = known[1][device_index] = self._nvml("nvmlDeviceGetMigDeviceHandleByIndex", handle, device_index)
        return device

    def _memory(self, handle: Any) -> Any:
        """NVML's v2 memory info, which reports the driver's reserved memory apart from `used` (v1
        counts it as used: 480 MiB on an idle H100), or v1 where the driver has no v2."""
        if self._memory_v2 is not False:
            try:
                memory = self._nvml("nvmlDeviceGetMemoryInfo", handle, self.lib.nvmlMemory_v2)
            except (self.lib.NVMLError_FunctionNotFound, self.lib.NVMLError_ArgumentVersionMismatch,
                    self.lib.NVMLError_NotSupported):
                self._memory_v2 = False
            else:
                self._memory_v2 = True
                return memory
        return self._nvml("nvmlDeviceGetMemoryInfo", handle)

    def health_reading(self, index: int) -> HealthReading:
        """What the periodic checks judge: pending and failed row remaps (or pending page retirements
        on a GPU without row remapping), the temperature and the slowdown threshold. One trip to a worker."""
        return self.batch(f"nvmlDeviceGet*(GPU {index} health)", self._health_reading, index)

    def _health_reading(self, index: int) -> HealthReading:
        handle = self._handle(index)
        lib = self.lib
        unsupported = (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound)
        found: dict[str, Any] = {}
        try:
            rows = self._nvml("nvmlDeviceGetRemappedRows", handle)
            found.update(pending_remaps=bool(rows[2]), remap_failed=bool(rows[3]))
        except unsupported:
            try:
                pending = self._nvml("nvmlDeviceGetRetiredPagesPendingStatus", handle)
                found.update(pending_remaps=pending == lib.NVML_FEATURE_ENABLED, pending_kind="page retirement")
            except unsupported:
                pass
        try:
            found["temperature_c"] = int(self._nvml("nvmlDeviceGetTemperature", handle, lib.NVML_TEMPERATURE_GPU))
            found["slowdown_c"] = int(self._nvml("nvmlDeviceGetTemperatureThreshold", handle,
                                                 lib.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except unsupported:
            pass
        return HealthReading(**found)

    # --- GPM: the profiling metrics of Hopper and later, without DCGM ---------------------------

    def gpm_unsupported(self, index: int) -> Optional[str]:
        """None when the GPU has NVML GPM, else why not (the PROF series are then left out)."""
        self.init()
        handle = self._handle(index)
        try:
            support = self._nvml("nvmlGpmQueryDeviceSupport", handle)
        except (self.lib.NVMLError_NotSupported, self.lib.NVMLError_FunctionNotFound) as exc:
            return f"NVML GPM unavailable ({describe(exc)}); DCGM's profiling module would be needed"
        if not support.isSupportedDevice:
            return "NVML GPM is not supported on this GPU (Hopper and later have it); DCGM would be needed"
        return None

    def gpm_alloc(self) -> Any:
        """A GPM sample buffer, filled by gpm_fill() as often as wanted; give it back with gpm_free()."""
        return self._nvml("nvmlGpmSampleAlloc")

    def gpm_fill(self, sample: Any, index: int, gpu_instance: Optional[int] = None) -> Any:
        """Take a GPM sample of the GPU, or of one of its GPU instances, into `sample` (NVML overwrites it)."""
        self.init()
        handle = self._handle(index)
        if gpu_instance is not None:
            return self._nvml("nvmlGpmMigSampleGet", handle, gpu_instance, sample)
        return self._nvml("nvmlGpmSampleGet", handle, sample)

    def gpm_free(self, sample: Any) -> None:
        try:
            self._nvml("nvmlGpmSampleFree", sample)
        except (self.lib.NVMLError, NvmlHung) as exc:
            log.debug("nvmlGpmSampleFree: %s", exc)

    def gpm_metrics(self, first: Any, second: Any) -> dict[str, float]:
        """GPM_METRICS over the interval between two samples; a metric NVML does not answer is left out."""
        lib = self.lib
        request = getattr(self._gpm_request, "request", None)
        if request is None:  # made once per thread (NVML fills its metrics in at each call): a sample asks 64 times
            request = self._gpm_request.request = lib.c_nvmlGpmMetricsGet_t()
            request.version = lib.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            for n, (_, constant, _) in enumerate(GPM_METRICS):
                request.metrics[n].metricId = getattr(lib, constant)
        request.sample1, request.sample2 = first, second
        answered = self._nvml("nvmlGpmMetricsGet", request).metrics
        success = lib.NVML_SUCCESS
        found = {}
        for n, (key, _, factor) in enumerate(GPM_METRICS):
            metric = answered[n]
            if metric.nvmlReturn == success:
                found[key] = metric.value * factor
        return found

    def driver_version(self) -> str:
        self.init()
        return self._nvml("nvmlSystemGetDriverVersion")

    def bus_ids(self) -> list[str]:
        """PCI bus id of every GPU NVML sees: a few calls (one batch), where inventory() makes dozens."""
        return self.batch("nvmlDeviceGetPciInfo(every GPU)", self._bus_ids)

    def _bus_ids(self) -> list[str]:
        handles = [self._handle(i) for i in range(self._nvml("nvmlDeviceGetCount"))]
        return [_short_bus_id(self._nvml("nvmlDeviceGetPciInfo", handle).busId) for handle in handles]

    def driver_view(self, persistence: bool) -> DriverView:
        """What the driver stage asks NVML, in one batch: the driver's version, every GPU's bus id, and
        (when `persistence`) their persistence modes."""
        return self.batch("nvmlSystemGetDriverVersion, nvmlDeviceGetPciInfo(every GPU)", self._driver_view,
                          persistence)

    def _driver_view(self, persistence: bool) -> DriverView:
        return DriverView(self._nvml("nvmlSystemGetDriverVersion"), self._bus_ids(),
                          self._persistence_modes() if persistence else None)

    def persistence_modes(self) -> list[bool]:
        """Persistence mode of each GPU, by index (one batch)."""
        return self.batch("nvmlDeviceGetPersistenceMode(every GPU)", self._persistence_modes)

    def _persistence_modes(self) -> list[bool]:
        handles = [self._handle(i) for i in range(self._nvml("nvmlDeviceGetCount"))]
        return [self._nvml("nvmlDeviceGetPersistenceMode", h) == self.lib.NVML_FEATURE_ENABLED for h in handles]

    def enable_persistence(self, index: int) -> None:
        self.init()
        handle = self._handle(index)
        self._nvml("nvmlDeviceSetPersistenceMode", handle, self.lib.NVML_FEATURE_ENABLED)

    def passthrough(self, index: int) -> bool:
        """Whether the GPU is passed through into this VM (NVML's virtualization mode): the VM cannot reset it."""
        self.init()
        handle = self._handle(index)
        try:
            mode = self._nvml("nvmlDeviceGetVirtualizationMode", handle)
        except self.lib.NVMLError_NotSupported:
            return False
        return bool(mode == self.lib.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH)

    def processes(self, index: int) -> list[tuple[int, float]]:
        """(pid, MiB of GPU memory used) of each compute process on the GPU."""
        self.init()
        handle = self._handle(index)
        found = self._nvml("nvmlDeviceGetComputeRunningProcesses", handle)
        return [(p.pid, (p.usedGpuMemory or 0) / (1024 * 1024)) for p in found]

    def watch_xids(self) -> XidWait:
        """Register every GPU for XID events; returns wait(timeout_ms) -> event or None."""
        self.init()
        event_set = self._nvml("nvmlEventSetCreate")
        for index in range(self._nvml("nvmlDeviceGetCount")):
            handle = self._handle(index)
            try:
                self._nvml("nvmlDeviceRegisterEvents", handle, self.lib.nvmlEventTypeXidCriticalError, event_set)
            except self.lib.NVMLError_NotSupported:
                log.warning("GPU %d does not report XID events; its health is not watched", index)

        return XidWait(self, event_set)


class XidWait:
    """A registered NVML event set: wait(timeout_ms) returns the next XID event or None."""

    def __init__(self, nvml: Nvml, event_set: Any) -> None:
        self._nvml = nvml._nvml
        self._lib = nvml.lib
        self._event_set = event_set

    def __call__(self, timeout_ms: int) -> Optional[XidEvent]:
        try:
            data = self._nvml("nvmlEventSetWait_v2", self._event_set, timeout_ms, extra_timeout=timeout_ms / 1000)
        except self._lib.NVMLError_Timeout:
            return None
        if data.eventType != self._lib.nvmlEventTypeXidCriticalError:
            return None
        gi, ci = (getattr(data, name, _NO_INSTANCE) for name in ("gpuInstanceId", "computeInstanceId"))
        return XidEvent(gpu_uuid=self._nvml("nvmlDeviceGetUUID", data.device), xid=data.eventData, at=time.time(),
                        gpu_instance_id=None if gi == _NO_INSTANCE else gi,
                        compute_instance_id=None if ci == _NO_INSTANCE or gi == _NO_INSTANCE else ci)

    def free(self) -> None:
        try:
            self._nvml("nvmlEventSetFree", self._event_set)
        except (self._lib.NVMLError, NvmlHung) as exc:
            log.debug("nvmlEventSetFree: %s", exc)


def _free(placement: tuple[int, int], taken: list[tuple[int, int]]) -> bool:
    """Whether a placement (start, size in memory slices) overlaps none of the taken ones."""
    start, size = placement
    return all(start + size <= other or other + other_size <= start for other, other_size in taken)


def _framebuffer(memory: Any) -> dict[str, float]:
    found = {"memory_used_mib": memory.used / MIB, "memory_free_mib": memory.free / MIB}
    if hasattr(memory, "reserved"):
        found["memory_reserved_mib"] = memory.reserved / MIB
    return found


def describe(exc: Exception) -> str:
    """An NVMLError as `nvmlDeviceGetUUID: GPU is lost`; one pynvml has no words for by its name
    (`InsufficientResources (NVML error 23)`, not `NVML Error with code 23`)."""
    call = getattr(exc, "call", None)
    text = str(exc)
    if text.startswith("NVML Error with code"):
        text = f"{type(exc).__name__.removeprefix('NVMLError_')} (NVML error {getattr(exc, 'value', '?')})"
    return f"{call}: {text}" if call else text


def _text(value: Any) -> str:
    return printable(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))


def _short_bus_id(bus_id: str) -> str:
    """NVML's 00000000:18:00.0 as the kernel and nvidia-smi write it: 0000:18:00.0."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower() if rest else bus_id.lower()


def _profile_name(nvml_name: str) -> str:
    """NVML names profiles "MIG 1g.10gb"; everyone else says "1g.10gb"."""
    return nvml_name.removeprefix("MIG ").strip()


def _device_profile(gi_profile: MigProfile, ci_slices: int) -> str:
    """A MIG device's profile name as NVML names its GPU instance's profile (never worked out from its
    memory: that rounding names an H200's 1g.18gb "1g.16gb"), with the compute slices in front when
    the compute instance is smaller than its GPU instance, as nvidia-smi and GFD write it."""
    return gi_profile.name if ci_slices == gi_profile.slices else f"{ci_slices}c.{gi_profile.name}"
