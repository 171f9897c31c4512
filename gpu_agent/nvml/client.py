"""The one narrow way into NVML.

`lib` is the pynvml module, or anything with its surface: same function names, same NVMLError
classes, so this code runs unchanged in tests. NVML is initialised once per process, and every
call runs on a worker thread with a timeout so a hung driver cannot hang the agent.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.nvml.model import Gpu, GpuSample, Inventory, MigDevice, MigProfile, MigState, XidEvent

log = logging.getLogger(__name__)

MIB = 1024 * 1024

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

_INIT_REMEDIES = {
    "NVMLError_LibraryNotFound": "NVML library (libnvidia-ml.so.1) not found: the NVIDIA driver is not installed",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded (modprobe nvidia, or check dmesg)",
    "NVMLError_NoPermission": "no permission to open /dev/nvidiactl: run the agent as root",
    "NVMLError_LibRmVersionMismatch": (
        "NVML library and kernel module versions differ (half-finished driver upgrade): "
        "reload the nvidia modules or reboot"
    ),
}


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
        for n in range(self._WORKERS):
            threading.Thread(target=self._work, name=f"nvml-{n}", daemon=True).start()
        self._lock = threading.Lock()
        self._stuck: dict[Future[Any], tuple[str, float]] = {}
        self.timeouts = 0

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, extra_timeout: float = 0.0) -> Any:
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
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)

    def close(self) -> None:
        for _ in range(self._WORKERS):
            self._queue.put(None)


class Nvml:
    def __init__(self, lib: Any, call_timeout: float = 5.0) -> None:
        self.lib = lib
        self._call = _TimedCalls(call_timeout)
        self._init_lock = threading.Lock()
        self._initialised = False
        self._static: dict[str, tuple[MigProfile, ...]] = {}  # MIG profile tables by GPU UUID
        self._memory_v2: Optional[bool] = None  # whether the driver has NVML's v2 memory info

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
            return self._call(name, getattr(self.lib, name), *args, extra_timeout=extra_timeout)
        except self.lib.NVMLError as exc:
            exc.call = name  # so a message can say which query failed
            raise

    def init(self) -> None:
        """Initialise NVML once per process; later calls are free. Raises NvmlUnavailable."""
        with self._init_lock:
            if self._initialised:
                return
            try:
                self._nvml("nvmlInit")
            except self.lib.NVMLError as exc:
                kind = type(exc).__name__
                reason = _INIT_REMEDIES.get(kind, f"NVML initialisation failed: {exc}")
                raise NvmlUnavailable(reason, no_driver=kind == "NVMLError_LibraryNotFound") from None
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
        self.init()
        driver = self._nvml("nvmlSystemGetDriverVersion")
        cuda = self._nvml("nvmlSystemGetCudaDriverVersion")
        count = self._nvml("nvmlDeviceGetCount")
        gpus = tuple(self._gpu(index) for index in range(count))
        return Inventory(driver_version=driver, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}", gpus=gpus)

    def _gpu(self, index: int) -> Gpu:
        handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
        uuid = self._nvml("nvmlDeviceGetUUID", handle)
        pci = self._nvml("nvmlDeviceGetPciInfo", handle)
        memory = self._nvml("nvmlDeviceGetMemoryInfo", handle)
        major, minor = self._nvml("nvmlDeviceGetCudaComputeCapability", handle)
        return Gpu(
            index=index,
            uuid=uuid,
            pci_bus_id=_short_bus_id(pci.busId),
            product=self._nvml("nvmlDeviceGetName", handle),
            memory_mib=memory.total // (1024 * 1024),
            compute_capability=(major, minor),
            minor_number=self._nvml("nvmlDeviceGetMinorNumber", handle),
            mig=self._mig(handle, uuid),
        )

    def _mig(self, handle: Any, uuid: str) -> MigState:
        try:
            current, pending = self._nvml("nvmlDeviceGetMigMode", handle)
        except self.lib.NVMLError_NotSupported:
            return MigState(capable=False)
        enabled = current == self.lib.NVML_DEVICE_MIG_ENABLE
        if uuid not in self._static:
            self._static[uuid] = self._mig_profiles(handle)
        return MigState(
            capable=True,
            enabled=enabled,
            pending_enabled=pending == self.lib.NVML_DEVICE_MIG_ENABLE,
            devices=self._mig_devices(handle, self._static[uuid]) if enabled else (),
            profiles=self._static[uuid],
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

    def _mig_devices(self, handle: Any, profiles: tuple[MigProfile, ...]) -> tuple[MigDevice, ...]:
        devices = []
        for slot in range(self._nvml("nvmlDeviceGetMaxMigDeviceCount", handle)):
            try:
                mig = self._nvml("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except self.lib.NVMLError_NotFound:
                continue
            gi_id = self._nvml("nvmlDeviceGetGpuInstanceId", mig)
            attributes = self._nvml("nvmlDeviceGetAttributes", mig)
            gpu_instance = self._nvml("nvmlDeviceGetGpuInstanceById", handle, gi_id)
            info = self._nvml("nvmlGpuInstanceGetInfo", gpu_instance)
            placement = info.placement
            devices.append(
                MigDevice(
                    uuid=self._nvml("nvmlDeviceGetUUID", mig),
                    gpu_instance_id=gi_id,
                    compute_instance_id=self._nvml("nvmlDeviceGetComputeInstanceId", mig),
                    profile=_mig_profile_of(attributes, profiles, info.profileId),
                    memory_mib=attributes.memorySizeMB,
                    multiprocessors=attributes.multiprocessorCount,
                    placement=(placement.start, placement.size),
                )
            )
        return tuple(devices)

    # --- metrics and events --------------------------------------------------------------------

    def sample(self, index: int) -> GpuSample:
        """One GPU's metrics; a metric the GPU does not support is left out, not faked."""
        self.init()
        handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
        values: dict[str, float] = {}

        def read(key: str, call: str, *args: Any, convert: Callable[[Any], float]) -> None:
            try:
                values[key] = convert(self._nvml(call, handle, *args))
            except self.lib.NVMLError_NotSupported:
                pass

        read("utilization_percent", "nvmlDeviceGetUtilizationRates", convert=lambda u: float(u.gpu))
        read("temperature_c", "nvmlDeviceGetTemperature", self.lib.NVML_TEMPERATURE_GPU, convert=float)
        read("power_w", "nvmlDeviceGetPowerUsage", convert=lambda mw: mw / 1000.0)
        try:
            memory = self._memory(handle)
        except self.lib.NVMLError_NotSupported:
            pass
        else:
            values["memory_used_mib"] = memory.used / MIB
            values["memory_free_mib"] = memory.free / MIB
            if hasattr(memory, "reserved"):
                values["memory_reserved_mib"] = memory.reserved / MIB
        return GpuSample(**values)

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

    def driver_version(self) -> str:
        self.init()
        return self._nvml("nvmlSystemGetDriverVersion")

    def bus_ids(self) -> list[str]:
        """PCI bus id of every GPU NVML sees: a few calls, where inventory() makes dozens."""
        self.init()
        handles = [self._nvml("nvmlDeviceGetHandleByIndex", i) for i in range(self._nvml("nvmlDeviceGetCount"))]
        return [_short_bus_id(self._nvml("nvmlDeviceGetPciInfo", handle).busId) for handle in handles]

    def persistence_modes(self) -> list[bool]:
        """Persistence mode of each GPU, by index."""
        self.init()
        handles = [self._nvml("nvmlDeviceGetHandleByIndex", i) for i in range(self._nvml("nvmlDeviceGetCount"))]
        return [self._nvml("nvmlDeviceGetPersistenceMode", h) == self.lib.NVML_FEATURE_ENABLED for h in handles]

    def enable_persistence(self, index: int) -> None:
        self.init()
        handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
        self._nvml("nvmlDeviceSetPersistenceMode", handle, self.lib.NVML_FEATURE_ENABLED)

    def processes(self, index: int) -> list[tuple[int, float]]:
        """(pid, MiB of GPU memory used) of each compute process on the GPU."""
        self.init()
        handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
        found = self._nvml("nvmlDeviceGetComputeRunningProcesses", handle)
        return [(p.pid, (p.usedGpuMemory or 0) / (1024 * 1024)) for p in found]

    def watch_xids(self) -> "XidWait":
        """Register every GPU for XID events; returns wait(timeout_ms) -> event or None."""
        self.init()
        event_set = self._nvml("nvmlEventSetCreate")
        for index in range(self._nvml("nvmlDeviceGetCount")):
            handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
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
        return XidEvent(gpu_uuid=self._nvml("nvmlDeviceGetUUID", data.device), xid=data.eventData, at=time.time())

    def free(self) -> None:
        try:
            self._nvml("nvmlEventSetFree", self._event_set)
        except (self._lib.NVMLError, NvmlHung) as exc:
            log.debug("nvmlEventSetFree: %s", exc)


def describe(exc: Exception) -> str:
    """An NVMLError as `nvmlDeviceGetUUID: GPU is lost`."""
    call = getattr(exc, "call", None)
    return f"{call}: {exc}" if call else str(exc)


def _short_bus_id(bus_id: str) -> str:
    """NVML's 00000000:18:00.0 as the kernel and nvidia-smi write it: 0000:18:00.0."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower() if rest else bus_id.lower()


def _profile_name(nvml_name: str) -> str:
    """NVML names profiles "MIG 1g.10gb"; everyone else says "1g.10gb"."""
    return nvml_name.removeprefix("MIG ").strip()


def _mig_profile_of(attributes: Any, profiles: tuple[MigProfile, ...], profile_id: int) -> str:
    """A MIG device's profile name as NVML names its GPU instance's profile (never worked out from its
    memory: that rounding names an H200's 1g.18gb "1g.16gb"), with the compute slices in front when
    the compute instance is smaller than its GPU instance, as nvidia-smi and GFD write it."""
    gi = next((profile.name for profile in profiles if profile.id == profile_id), None)
    if gi is None:
        raise NvmlUnavailable(f"MIG device of GPU instance profile {profile_id}, which the GPU does not list")
    gi_slices, ci_slices = attributes.gpuInstanceSliceCount, attributes.computeInstanceSliceCount
    return gi if gi_slices == ci_slices else f"{ci_slices}c.{gi}"
