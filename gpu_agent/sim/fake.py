"""A fake of pynvml: same function names, return shapes and NVMLError classes, backed by MachineState.

Constants, structures and error classes are pynvml's own, so code written against pynvml (the
agent's NVML client) runs here unchanged. Faults injected with `gpu-agent sim fail` make a call
raise the NVMLError a real driver would, or hang.
"""
from __future__ import annotations

import collections
import copy
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import pynvml

from gpu_agent.host.inotify import DirectoryWatch
from gpu_agent.sim import topology
from gpu_agent.sim.kernel import loaded_version
from gpu_agent.sim.pci import on_nvidia
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mig import (
    CiProfile,
    ci_profile,
    create_compute_instance,
    create_gpu_instance,
    destroy_compute_instance,
    destroy_gpu_instance,
    find_ci,
    find_gi,
    gi_profile,
    mig_devices,
    set_mode,
)
from gpu_agent.sim.profiles import MODELS, GpuModel

# (SM clock idle, SM clock max, memory clock) in MHz, by model, as nvidia-smi -q shows them.
_CLOCKS_MHZ = {
    "H100-80GB-HBM3": (345, 1980, 2619),  # the committed H100 capture's answers
    "H200": (345, 1980, 3201),
    "A100-SXM4-40GB": (210, 1410, 1215),
    "A100-SXM4-80GB": (210, 1410, 1593),
    "A30": (210, 1440, 1215),
    "T4": (300, 1590, 5000),
    "default": (300, 1500, 1500),
}

# The slowdown temperature threshold in C (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), by model: the H100's
# is the real H100's with driver 580; the others are what nvidia-smi -q shows as "GPU Slowdown Temp".
_SLOWDOWN_C = {"H100-80GB-HBM3": 89, "H200": 89, "A100-SXM4-40GB": 92, "A100-SXM4-80GB": 92, "A30": 92, "T4": 93,
               "default": 90}

PROCESS_SM_UTIL = 35  # % of the SMs a simulated process keeps busy, unless it says its own (sm_util)
HANG = "hang"  # a fault that blocks the call until the fault is cleared
_HANG_LIMIT_S = 3600.0
_POLL_S = 0.05


def error_class(name: str) -> type:
    """`GpuIsLost` or `NVMLError_GpuIsLost` or `GPU_IS_LOST` to pynvml's error class."""
    wanted = name.removeprefix("NVMLError_").replace("_", "").lower()
    for attr in dir(pynvml):
        if attr.startswith("NVMLError_") and attr[len("NVMLError_"):].lower() == wanted:
            return getattr(pynvml, attr)
    raise ValueError(name)


def error_names() -> list[str]:
    return sorted(a[len("NVMLError_"):] for a in dir(pynvml) if a.startswith("NVMLError_"))


@dataclass(frozen=True)
class SimHandle:
    gpu: int
    mig: Optional[int] = None  # position among the GPU's MIG devices


@dataclass(frozen=True)
class SimGpuInstance:
    gpu: int
    gi_id: int


@dataclass(frozen=True)
class SimComputeInstance:
    gpu: int
    gi_id: int
    ci_id: int


@dataclass
class SimEventSet:
    after_seq: int
    gpus: set[int]
    changes: Optional[DirectoryWatch] = None  # wakes a wait when the machine's state is written

    def wait_for_change(self, state: MachineState, timeout: float) -> None:
        """Block until the simulated machine changes (inotify) or `timeout` passes; poll if need be."""
        if self.changes is None:
            time.sleep(min(_POLL_S, timeout))
        else:
            self.changes.wait(timeout)

    def watch(self, state: MachineState) -> None:
        if self.changes is None:
            try:
                self.changes = DirectoryWatch()
                self.changes.watch_for([state.path, state.writes_path])  # a wait reads at either's change
            except OSError:
                self.close()

    def close(self) -> None:
        if self.changes is not None:
            self.changes.close()
            self.changes = None


@dataclass(frozen=True)
class SimEventData:
    """Fields of pynvml's c_nvmlEventData_t; `device` is a handle of this fake."""

    device: SimHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass
class SimGpmSample:
    """Stands in for a c_nvmlGpmSample_t: the GPU's load when it was taken."""

    gpu: Optional[int] = None
    load: int = 0
    at: float = 0.0
    freed: bool = False


@dataclass
class SimGpmMetric:
    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0


class SimGpmMetricsGet:
    """The fields of pynvml's c_nvmlGpmMetricsGet_t that nvmlGpmMetricsGet reads and fills."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Optional[SimGpmSample] = None
        self.sample2: Optional[SimGpmSample] = None
        self.metrics = _GpmMetricSlots()


_GPM_METRIC_SLOTS = int(pynvml.NVML_GPM_METRIC_MAX)


class _GpmMetricSlots:
    """NVML_GPM_METRIC_MAX metric slots, as the C array is; each made when first used (making them all,
    at every request of every GPU instance, was most of a simulated sample's CPU)."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[int, SimGpmMetric] = {}

    def __len__(self) -> int:
        return _GPM_METRIC_SLOTS

    def __getitem__(self, key: Any) -> Any:
        if key.__class__ is int:
            slot = self._slots.get(key)
            if slot is not None:
                return slot
            if not 0 <= key < _GPM_METRIC_SLOTS:
                raise IndexError(key)
            slot = self._slots[key] = SimGpmMetric()
            return slot
        if isinstance(key, slice):
            return [self[n] for n in range(*key.indices(_GPM_METRIC_SLOTS))]
        raise TypeError(f"metric slots are indexed by int or slice, not {type(key).__name__}")


# What a GPM metric reads at a load of L %: the share of L each utilisation shows, and MiB/s per % for PCIe.
_GPM_PER_LOAD = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 1.0, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 0.6,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 0.5, pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 40.0,
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 60.0,
}


def _nvml(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every fake call: NVML must be initialised, and an injected fault for it fires first."""

    name = fn.__name__

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        if self._init_count == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.calls[name] += 1
        machine = self._state
        state = machine.read()
        if state["faults"]:
            self._fault(name, _target_gpu(name, args))  # `sim fail nvmlDeviceGetHandleByIndex --gpu 3` too
            state = machine.read()  # the fault may have changed it
        lost = state.get("lost_gpus")
        if lost and name not in _ANSWERED_WHEN_LOST and _target_gpu(name, args) in lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        machine.hold(state)  # one state for the whole call, and one look at the file
        try:
            return fn(self, *args, **kwargs)
        finally:
            machine.release()

    return call


# A GPU off the bus (`sim inject-xid --xid 79`, until `sim clear` or `sim reboot`) fails every call for it with
# GPU_IS_LOST, as the driver does, but its UUID: NVML read that when it attached the GPU, and an XID event's
# handle still names its GPU.
_ANSWERED_WHEN_LOST = frozenset({"nvmlDeviceGetUUID"})


def _target_gpu(call: str, args: tuple[Any, ...]) -> Optional[int]:
    """The GPU a call is about, by index; None for a call about no one GPU."""
    if not args:
        return None
    if isinstance(args[0], (SimHandle, SimGpuInstance, SimComputeInstance)):
        return args[0].gpu
    return args[0] if call == "nvmlDeviceGetHandleByIndex" and isinstance(args[0], int) else None


class _HandleArrayType(type):
    """`(c_nvmlGpuInstance_t * n)()` makes n slots for this fake's handles, as ctypes does for real ones."""

    def __mul__(cls, count: int) -> Callable[[], list[Any]]:
        return lambda: [None] * count


class _HandleSlot(metaclass=_HandleArrayType):
    pass


class FakeNvml:
    """Stands in for the pynvml module. Anything not defined here is pynvml's own attribute."""

    # Arrays that nvmlDeviceGetGpuInstances and nvmlGpuInstanceGetComputeInstances fill.
    c_nvmlGpuInstance_t = _HandleSlot
    c_nvmlComputeInstance_t = _HandleSlot
    c_nvmlGpmMetricsGet_t = SimGpmMetricsGet

    def __init__(self, state: MachineState) -> None:
        self._state = state
        self.machine = state  # the simulator's own handle, not part of pynvml's surface
        self._init_count = 0
        self._lock = threading.Lock()
        self._waits_done = threading.Condition(self._lock)
        self._waits = 0  # nvmlEventSetWait calls in flight: nvmlShutdown returns only once none is
        self.calls: collections.Counter[str] = collections.Counter()  # by NVML function, for tests and rehearsals
        self._started = time.monotonic()
        self._devices_memo: Optional[tuple[dict[str, Any], list[Any]]] = None  # (GPU as read, its MIG devices)
        self._nvlink_counters: dict[int, tuple[float, float]] = {}  # by GPU: NVLink data (KiB), when it was read

    def __getattr__(self, name: str) -> Any:
        """pynvml's constants, structures and errors; its functions this fake lacks answer FunctionNotFound.
        Kept once looked up (they never change): the agent asks for NVML_SUCCESS and the errors hundreds
        of times a sample."""
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value):
            def not_simulated(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            value = not_simulated
        self.__dict__[name] = value
        return value

    # --- faults ----------------------------------------------------------------------------

    def _fault(self, call: str, gpu: Optional[int]) -> None:
        faults = self._state.read()["faults"]
        if not any(self._matches(f, call, gpu) for f in faults):
            return
        with self._state.edit() as state:
            fault = next((f for f in state["faults"] if self._matches(f, call, gpu)), None)
            if fault is None:
                return
            if fault.get("times") is not None:
                fault["times"] -= 1
                # A spent hang stays listed (matching nothing) so the calls it holds wait for `sim clear`.
                if fault["times"] <= 0 and fault["error"] != HANG:
                    state["faults"].remove(fault)
        if fault["error"] == HANG:
            deadline = time.monotonic() + _HANG_LIMIT_S
            while time.monotonic() < deadline and any(f["id"] == fault["id"] for f in self._state.read()["faults"]):
                time.sleep(_POLL_S)
            return
        raise error_class(fault["error"])()

    @staticmethod
    def _matches(fault: dict[str, Any], call: str, gpu: Optional[int]) -> bool:
        return (fault["call"] == call and (fault.get("gpu") is None or fault["gpu"] == gpu)
                and (fault.get("times") is None or fault["times"] > 0))

    # --- helpers ---------------------------------------------------------------------------

    def _gpus(self) -> list[dict[str, Any]]:
        return self._state.read()["gpus"]

    def _gpu(self, handle: Any) -> dict[str, Any]:
        if not isinstance(handle, (SimHandle, SimGpuInstance, SimComputeInstance)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpus = self._gpus()
        if not 0 <= handle.gpu < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.gpu not in self._visible():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # unbound from nvidia since the handle was had
        return gpus[handle.gpu]

    def _visible(self) -> Sequence[int]:
        """The GPUs the nvidia driver holds, by their place in the machine: NVML's indices count only those (a GPU
        bound to vfio-pci, or to no driver, is outside NVML)."""
        state = self._state.read()
        if not state["pci"].get("bound") and not state["pci"].get("override"):
            return range(len(state["gpus"]))  # nothing was moved: every GPU probed by nvidia
        return [index for index, gpu in enumerate(state["gpus"]) if on_nvidia(state, gpu)]

    def _model(self, gpu: dict[str, Any]) -> GpuModel:
        return MODELS[gpu["model"]]

    def _whole_gpu(self, handle: Any) -> dict[str, Any]:
        gpu = self._gpu(handle)
        if isinstance(handle, SimHandle) and handle.mig is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_device(self, handle: SimHandle) -> tuple[dict[str, Any], dict[str, Any]]:
        """(GPU instance, compute instance) of a MIG device handle."""
        gpu = self._gpu(handle)
        if handle.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._mig_devices(gpu)
        if handle.mig >= len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return devices[handle.mig]

    def _mig_devices(self, gpu: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """mig_devices() of a GPU as read (never of one being edited), once per reading: a reading is
        never changed (an edit parses its own), and an inventory asks 4 times per MIG device."""
        memo = self._devices_memo
        if memo is None or memo[0] is not gpu:
            memo = self._devices_memo = (gpu, mig_devices(gpu))
        return memo[1]

    def _ci_profile_of(self, handle: SimHandle) -> CiProfile:
        gi, ci = self._mig_device(handle)
        return ci_profile(self._model(self._gpu(handle)), gi, ci["profile_id"])

    def _mig_capable(self, handle: Any) -> tuple[dict[str, Any], GpuModel]:
        gpu = self._whole_gpu(handle)
        model = self._model(gpu)
        if not model.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, model

    def _utilization(self, gpu: dict[str, Any]) -> int:
        return min(100, sum(p.get("sm_util", PROCESS_SM_UTIL) for p in gpu["processes"]))

    # --- init and system -------------------------------------------------------------------

    def nvmlInit(self) -> None:
        state = self._state.read()
        if state["driver_version"] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        module = loaded_version(state, "nvidia")
        if module is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if module != state["driver_version"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        self._fault("nvmlInit", None)
        with self._lock:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        """As a real driver's does (an H200, driver 580.159.04): it returns only once the event waits in
        flight have returned, at their timeout if no event comes (4.5 s behind a 5 s wait)."""
        with self._lock:
            self._waits_done.wait_for(lambda: self._waits == 0)
            if self._init_count == 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
            self._init_count -= 1

    @_nvml
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._state.read()["driver_version"]

    @_nvml
    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self._state.read()["driver_version"]

    @_nvml
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._state.read()["cuda_version"]

    # --- devices ---------------------------------------------------------------------------

    @_nvml
    def nvmlDeviceGetCount(self) -> int:
        return len(self._visible())

    @_nvml
    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        visible = self._visible()
        if not 0 <= index < len(visible):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimHandle(visible[index])

    @_nvml
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> SimHandle:
        lost = self._state.read().get("lost_gpus") or ()
        visible = self._visible()
        for index, gpu in enumerate(self._gpus()):
            if index not in visible:
                continue
            found = SimHandle(index) if gpu["uuid"] == uuid else next(
                (SimHandle(index, slot) for slot, (_, ci) in enumerate(mig_devices(gpu)) if ci["uuid"] == uuid), None)
            if found is not None and index in lost:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if found is not None:
                return found
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml
    def nvmlDeviceGetIndex(self, handle: SimHandle) -> int:
        self._whole_gpu(handle)
        return list(self._visible()).index(handle.gpu)

    @_nvml
    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        if handle.mig is not None:
            return self._mig_device(handle)[1]["uuid"]
        return self._gpu(handle)["uuid"]

    @_nvml
    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        model = self._model(self._gpu(handle))
        if handle.mig is None:
            return model.name
        return f"{model.name} {self._ci_profile_of(handle).name}"  # e.g. "NVIDIA H100 80GB HBM3 MIG 3g.40gb"

    @_nvml
    def nvmlDeviceGetMinorNumber(self, handle: SimHandle) -> int:
        return self._whole_gpu(handle)["minor"]

    @_nvml
    def nvmlDeviceGetPciInfo(self, handle: SimHandle) -> Any:
        gpu = self._gpu(handle)
        bus_id = gpu["pci_bus_id"]
        domain, bus, rest = bus_id.split(":")
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = f"{domain[-4:]}:{bus}:{rest}".encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        info.pciDeviceId = self._model(gpu).pci_device_id
        return info

    @_nvml
    def nvmlDeviceGetPersistenceMode(self, handle: SimHandle) -> int:
        return self._whole_gpu(handle).get("persistence", pynvml.NVML_FEATURE_DISABLED)

    @_nvml
    def nvmlDeviceSetPersistenceMode(self, handle: SimHandle, mode: int) -> None:
        self._whole_gpu(handle)
        if mode not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._state.edit() as state:
            state["gpus"][handle.gpu]["persistence"] = mode

    @_nvml
    def nvmlDeviceGetComputeMode(self, handle: SimHandle) -> int:
        return self._whole_gpu(handle).get("compute_mode", pynvml.NVML_COMPUTEMODE_DEFAULT)

    @_nvml
    def nvmlDeviceSetComputeMode(self, handle: SimHandle, mode: int) -> None:
        """As the driver documents it: a mode outside nvmlComputeMode_t is INVALID_ARGUMENT; EXCLUSIVE_THREAD,
        whose support was removed, is taken here as NOT_SUPPORTED (not checked on a real GPU). Not persistent:
        `sim reboot` sets DEFAULT again, as a reboot does on Linux."""
        self._whole_gpu(handle)
        if mode not in range(pynvml.NVML_COMPUTEMODE_COUNT):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._state.edit() as state:
            state["gpus"][handle.gpu]["compute_mode"] = mode

    @_nvml
    def nvmlDeviceGetCudaComputeCapability(self, handle: SimHandle) -> tuple[int, int]:
        return self._model(self._gpu(handle)).compute_capability

    @_nvml
    def nvmlDeviceGetMemoryInfo(self, handle: SimHandle, version: Any = None) -> Any:
        """v1 counts the driver's reserved memory as used; v2 (pynvml.nvmlMemory_v2) reports it apart."""
        gpu = self._gpu(handle)
        mib = 1024 * 1024
        reserved = 0
        if handle.mig is not None:
            gi, _ = self._mig_device(handle)
            total = gi_profile(self._model(gpu), gi["profile_id"]).memory_mib
            used = sum(p["used_mib"] for p in gpu["processes"] if p.get("gpu_instance_id") == gi["id"])
        else:
            total = self._model(gpu).memory_mib
            reserved = self._model(gpu).reserved_mib
            used = sum(p["used_mib"] for p in gpu["processes"])
        used = min(used, total - reserved)
        free = total - reserved - used
        if version:
            if version != pynvml.nvmlMemory_v2:
                raise error_class("ArgumentVersionMismatch")()
            memory = pynvml.c_nvmlMemory_v2_t()
            memory.version, memory.reserved = version, reserved * mib
        else:
            memory = pynvml.c_nvmlMemory_t()
            used += reserved
        memory.total, memory.used, memory.free = total * mib, used * mib, free * mib
        return memory

    @_nvml
    def nvmlDeviceGetUtilizationRates(self, handle: SimHandle) -> Any:
        gpu = self._whole_gpu(handle)
        if gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = self._utilization(gpu)
        rates.memory = rates.gpu // 2
        return rates

    @_nvml
    def nvmlDeviceGetTemperature(self, handle: SimHandle, sensor: int) -> int:
        gpu = self._whole_gpu(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._temperature(gpu)

    def _temperature(self, gpu: dict[str, Any]) -> int:
        if gpu.get("temperature_c") is not None:  # `gpu-agent sim set --temperature`
            return int(gpu["temperature_c"])
        return self._model(gpu).idle_temp_c + self._utilization(gpu) * 2 // 5

    @_nvml
    def nvmlDeviceGetFieldValues(self, handle: SimHandle, field_ids: list[Any]) -> Any:
        """pynvml's answer: an array of c_nvmlFieldValue_t, each with its own nvmlReturn. The memory
        temperature (HBM runs 2 C above the GPU: 35 against 33 on the real idle H100), and where the
        GPU has NVLink (its topology) the NVLink data counters, which grow with its load; else NotSupported."""
        gpu = self._whole_gpu(handle)
        nvlink = bool(topology.of(gpu)["nvlinks"])
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, wanted in zip(values, field_ids):
            value.fieldId, value.scopeId = wanted if isinstance(wanted, (list, tuple)) else (wanted, 0)
            value.timestamp = int(time.time() * 1e6)
            value.nvmlReturn = pynvml.NVML_SUCCESS
            if value.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP and self._model(gpu).mig_capable:  # HBM GPUs
                value.valueType, value.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, self._temperature(gpu) + 2
            elif nvlink and value.fieldId in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                                              pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX):
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = int(self._nvlink_kib(handle.gpu, gpu) / 2)
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def _nvlink_kib(self, index: int, gpu: dict[str, Any]) -> float:
        """KiB sent and received over NVLink since this fake started: 1 GiB/s per % of load, never less."""
        now = time.monotonic()
        total, then = self._nvlink_counters.get(index, (0.0, now))
        total += self._utilization(gpu) * 1024 * 1024 * (now - then)
        self._nvlink_counters[index] = (total, now)
        return total

    @_nvml
    def nvmlDeviceGetTemperatureThreshold(self, handle: SimHandle, threshold: int) -> int:
        gpu = self._whole_gpu(handle)
        if threshold != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _SLOWDOWN_C.get(gpu["model"], _SLOWDOWN_C["default"])

    @_nvml
    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        return self._power_mw(self._whole_gpu(handle))

    def _power_mw(self, gpu: dict[str, Any]) -> int:
        model = self._model(gpu)
        watts = model.idle_power_w + (model.max_power_w - model.idle_power_w) * self._utilization(gpu) * 0.8 / 100
        return int(watts * 1000)

    # Metrics as an idle-to-busy GPU of the model reports them (dcgm-exporter's defaults).

    @_nvml
    def nvmlDeviceGetClockInfo(self, handle: SimHandle, clock: int) -> int:
        gpu = self._whole_gpu(handle)
        sm_idle, sm_max, memory = _CLOCKS_MHZ.get(gpu["model"], _CLOCKS_MHZ["default"])
        if clock == pynvml.NVML_CLOCK_MEM:
            return memory
        if clock in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return sm_idle + (sm_max - sm_idle) * self._utilization(gpu) // 100
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @_nvml
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: SimHandle) -> int:
        """mJ since this fake started, at the power the GPU draws now: it only grows, like the driver's."""
        watts = self._power_mw(self._whole_gpu(handle)) / 1000
        return int(watts * 1000 * (time.monotonic() - self._started))

    @_nvml
    def nvmlDeviceGetPcieReplayCounter(self, handle: SimHandle) -> int:
        self._whole_gpu(handle)
        return 0

    @_nvml
    def nvmlDeviceGetEncoderUtilization(self, handle: SimHandle) -> list[int]:
        self._whole_gpu(handle)
        return [0, 167000]  # % and the sampling period in us; the simulated processes are compute only

    @_nvml
    def nvmlDeviceGetDecoderUtilization(self, handle: SimHandle) -> list[int]:
        self._whole_gpu(handle)
        return [0, 167000]

    @_nvml
    def nvmlDeviceGetRemappedRows(self, handle: SimHandle) -> list[int]:
        """(correctable, uncorrectable, pending, failure). HBM GPUs (here: the MIG-capable ones) remap
        rows; a T4 retires pages instead."""
        gpu = self._whole_gpu(handle)
        if not self._model(gpu).mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rows = gpu.get("remapped_rows", {})  # `gpu-agent sim set --pending-remaps/--remap-failure`
        return [0, 0, int(rows.get("pending", 0)), int(rows.get("failure", 0))]

    @_nvml
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: SimHandle) -> int:
        """GPUs without HBM row remapping retire pages instead; the others answer NotSupported, as an H100 does."""
        gpu = self._whole_gpu(handle)
        if self._model(gpu).mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pending = gpu.get("remapped_rows", {}).get("pending", 0)
        return pynvml.NVML_FEATURE_ENABLED if pending else pynvml.NVML_FEATURE_DISABLED

    @_nvml
    def nvmlDeviceGetComputeRunningProcesses(self, handle: SimHandle) -> list[Any]:
        """pynvml's own answer: its friendly objects with the fields of c_nvmlProcessInfo_t."""
        gpu = self._whole_gpu(handle)
        return [
            pynvml.nvmlFriendlyObject({"pid": p["pid"], "usedGpuMemory": p["used_mib"] * 1024 * 1024,
                                       "gpuInstanceId": p.get("gpu_instance_id", 0xFFFFFFFF),
                                       "computeInstanceId": p.get("compute_instance_id", 0xFFFFFFFF)})
            for p in gpu["processes"]
        ]

    @_nvml
    def nvmlDeviceGetProcessUtilization(self, handle: SimHandle, since: int) -> list[Any]:
        """A sample per process of the whole GPU, as the driver keeps them; none: NVML's NOT_FOUND."""
        gpu = self._whole_gpu(handle)
        if gpu["mig"]["current"]:  # NVML has no per-process utilisation in MIG mode
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = int(time.time() * 1_000_000)
        samples = []
        for process in gpu["processes"]:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp = process["pid"], now
            sample.smUtil = process.get("sm_util", PROCESS_SM_UTIL)
            samples.append(sample)
        if not samples or now <= since:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    @_nvml
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: SimHandle) -> int:
        """The machine's clock_event_reasons of the GPU; an idle GPU's clocks are down for idleness."""
        gpu = self._whole_gpu(handle)
        return int(gpu.get("clock_event_reasons", 0x1 if not gpu["processes"] else 0))

    # --- GPM: Hopper and later (compute capability 9.0+) -------------------------------------

    @_nvml
    def nvmlGpmQueryDeviceSupport(self, handle: SimHandle) -> Any:
        gpu = self._whole_gpu(handle)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self._model(gpu).compute_capability >= (9, 0))
        return support

    @_nvml
    def nvmlGpmSampleAlloc(self) -> SimGpmSample:
        return SimGpmSample()

    @_nvml
    def nvmlGpmSampleGet(self, handle: SimHandle, sample: SimGpmSample) -> SimGpmSample:
        gpu = self._whole_gpu(handle)
        if self._model(gpu).compute_capability < (9, 0):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample.gpu, sample.load, sample.at = handle.gpu, self._utilization(gpu), time.monotonic()
        return sample

    @_nvml
    def nvmlGpmMigSampleGet(self, handle: SimHandle, gi_id: int, sample: SimGpmSample) -> SimGpmSample:
        """A GPU instance's load: its own processes'."""
        gpu = self._whole_gpu(handle)
        if self._model(gpu).compute_capability < (9, 0) or not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        find_gi(gpu, gi_id)
        load = min(100, 35 * sum(1 for p in gpu["processes"] if p.get("gpu_instance_id") == gi_id))
        sample.gpu, sample.load, sample.at = handle.gpu * 1000 + gi_id, load, time.monotonic()
        return sample

    @_nvml
    def nvmlGpmSampleFree(self, sample: SimGpmSample) -> None:
        sample.freed = True

    @_nvml
    def nvmlGpmMetricsGet(self, request: SimGpmMetricsGet) -> SimGpmMetricsGet:
        """Each metric at the mean load of the two samples; two samples of one GPU, the second later."""
        first, second = request.sample1, request.sample2
        if (first is None or second is None or first.gpu is None or first.gpu != second.gpu
                or first.freed or second.freed or second.at <= first.at):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        load = (first.load + second.load) / 2
        metrics = request.metrics
        for n in range(min(request.numMetrics, _GPM_METRIC_SLOTS)):
            metric = metrics[n]
            share = _GPM_PER_LOAD.get(metric.metricId)
            metric.nvmlReturn = pynvml.NVML_SUCCESS if share is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            metric.value = load * share if share is not None else 0.0
        return request

    # --- MIG -------------------------------------------------------------------------------
    # The rules (placements, ids, IN_USE, pending modes) are gpu_agent.sim.mig's; these calls hold the
    # machine's lock while they change it, as the driver serialises them.

    @staticmethod
    def _profile_by_id(model: GpuModel, profile_id: int) -> Any:
        return gi_profile(model, profile_id)

    @_nvml
    def nvmlDeviceGetMigMode(self, handle: SimHandle) -> list[int]:
        gpu, _ = self._mig_capable(handle)
        return [gpu["mig"]["current"], gpu["mig"]["pending"]]

    @_nvml
    def nvmlDeviceGetVirtualizationMode(self, handle: SimHandle) -> int:
        """NONE on bare metal; PASSTHROUGH for a GPU whose state says `"passthrough": true` (in a VM)."""
        gpu = self._whole_gpu(handle)
        return (pynvml.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH if gpu.get("passthrough")
                else pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)

    @_nvml
    def nvmlDeviceSetMigMode(self, handle: SimHandle, mode: int) -> int:
        self._mig_capable(handle)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._state.edit() as state:
            gpu = state["gpus"][handle.gpu]
            return set_mode(gpu, self._model(gpu), mode == pynvml.NVML_DEVICE_MIG_ENABLE)

    @_nvml
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: SimHandle, profile: int, version: int = 2) -> Any:
        """Answers with MIG mode disabled too, as 580-series drivers do."""
        _, model = self._mig_capable(handle)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for p in model.mig_profiles:
            if getattr(pynvml, p.constant) == profile:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id, info.isP2pSupported, info.sliceCount = p.id, 0, p.slices
                info.instanceCount, info.multiprocessorCount = p.instances, p.multiprocessors
                info.memorySizeMB = p.memory_mib
                info.copyEngineCount, info.decoderCount, info.encoderCount = p.copy_engines, p.decoders, p.encoders
                info.jpegCount, info.ofaCount, info.name = p.jpeg, p.ofa, p.name.encode()
                return info
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_nvml
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: SimHandle, profile_id: int,
                                                   placements: Any, count: Any) -> int:
        _, model = self._mig_capable(handle)
        profile = next((p for p in model.mig_profiles if p.id == profile_id), None)
        if profile is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        size = _deref(count)
        if placements is None or size.value < len(profile.starts):
            size.value = len(profile.starts)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(profile.starts):
            placements[i].start, placements[i].size = start, profile.size
        size.value = len(profile.starts)
        return pynvml.NVML_SUCCESS

    @_nvml
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: SimHandle, profile_id: int) -> int:
        gpu, model = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile = gi_profile(model, profile_id)
        probe = copy.deepcopy(gpu)
        count = 0
        while count < profile.instances:
            try:
                create_gpu_instance(probe, model, profile_id, None)
            except pynvml.NVMLError:
                break
            count += 1
        return count

    @_nvml
    def nvmlDeviceCreateGpuInstance(self, handle: SimHandle, profile_id: int) -> SimGpuInstance:
        return self._create_gpu_instance(handle, profile_id, None)

    @_nvml
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: SimHandle, profile_id: int,
                                                 placement: Any) -> SimGpuInstance:
        where = _deref(placement)
        return self._create_gpu_instance(handle, profile_id, (where.start, where.size))

    def _create_gpu_instance(self, handle: SimHandle, profile_id: int,
                             placement: Optional[tuple[int, int]]) -> SimGpuInstance:
        self._mig_capable(handle)
        with self._state.edit() as state:
            gpu = state["gpus"][handle.gpu]
            instance = create_gpu_instance(gpu, self._model(gpu), profile_id, placement)
        return SimGpuInstance(handle.gpu, instance["id"])

    @_nvml
    def nvmlDeviceGetGpuInstances(self, handle: SimHandle, profile_id: int, instances: Any, count: Any) -> int:
        gpu, model = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gi_profile(model, profile_id)
        found = [gi for gi in gpu["mig"]["gpu_instances"] if gi["profile_id"] == profile_id]
        for i, gi in enumerate(found):
            instances[i] = SimGpuInstance(handle.gpu, gi["id"])
        _deref(count).value = len(found)
        return pynvml.NVML_SUCCESS

    @_nvml
    def nvmlDeviceGetGpuInstanceById(self, handle: SimHandle, gi_id: int) -> SimGpuInstance:
        gpu, _ = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_STATE)
        find_gi(gpu, gi_id)
        return SimGpuInstance(handle.gpu, gi_id)

    @_nvml
    def nvmlGpuInstanceGetInfo(self, gpu_instance: SimGpuInstance) -> Any:
        gi = self._gi(gpu_instance)
        # pynvml's own structure, so a capture records it; its `device` stays NULL (this fake's
        # handles are not ctypes pointers), the caller holds the device already.
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi["id"], gi["profile_id"]
        info.placement.start, info.placement.size = gi["start"], gi["size"]
        return info

    @_nvml
    def nvmlGpuInstanceDestroy(self, gpu_instance: SimGpuInstance) -> int:
        with self._state.edit() as state:
            gpu = state["gpus"][gpu_instance.gpu]
            destroy_gpu_instance(gpu, self._gi(gpu_instance, gpu))
        return pynvml.NVML_SUCCESS

    def _gi(self, gpu_instance: Any, gpu: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        if not isinstance(gpu_instance, SimGpuInstance):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = gpu if gpu is not None else self._gpu(gpu_instance)
        try:
            return find_gi(gpu, gpu_instance.gi_id)
        except pynvml.NVMLError:  # a handle to a destroyed GPU instance
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    # --- compute instances ---

    @_nvml
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gpu_instance: SimGpuInstance, profile: int,
                                                     eng_profile: int, version: int = 2) -> Any:
        gi = self._gi(gpu_instance)
        if eng_profile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        p = ci_profile(self._model(self._gpu(gpu_instance)), gi, profile)
        g = gi_profile(self._model(self._gpu(gpu_instance)), gi["profile_id"])
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = p.id, p.slices, p.instances
        info.multiprocessorCount = p.multiprocessors
        info.sharedCopyEngineCount, info.sharedDecoderCount = g.copy_engines, g.decoders
        info.sharedEncoderCount = g.encoders
        info.sharedJpegCount, info.sharedOfaCount, info.name = g.jpeg, g.ofa, p.name.encode()
        return info

    @_nvml
    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(self, gpu_instance: SimGpuInstance, profile_id: int,
                                                            placements: Any, count: Any) -> int:
        gi = self._gi(gpu_instance)
        p = ci_profile(self._model(self._gpu(gpu_instance)), gi, profile_id)
        size = _deref(count)
        if placements is None or size.value < len(p.starts):
            size.value = len(p.starts)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(p.starts):
            placements[i].start, placements[i].size = start, p.slices
        size.value = len(p.starts)
        return pynvml.NVML_SUCCESS

    @_nvml
    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: SimGpuInstance, profile_id: int) -> SimComputeInstance:
        return self._create_compute_instance(gpu_instance, profile_id, None)

    @_nvml
    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(self, gpu_instance: SimGpuInstance, profile_id: int,
                                                          placement: Any) -> SimComputeInstance:
        where = _deref(placement)
        ci = self._gi(gpu_instance)
        p = ci_profile(self._model(self._gpu(gpu_instance)), ci, profile_id)
        if where.size != p.slices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._create_compute_instance(gpu_instance, profile_id, where.start)

    def _create_compute_instance(self, gpu_instance: SimGpuInstance, profile_id: int,
                                 start: Optional[int]) -> SimComputeInstance:
        with self._state.edit() as state:
            gpu = state["gpus"][gpu_instance.gpu]
            gi = self._gi(gpu_instance, gpu)
            instance = create_compute_instance(gpu, self._model(gpu), gi, profile_id, start)
        return SimComputeInstance(gpu_instance.gpu, gpu_instance.gi_id, instance["id"])

    @_nvml
    def nvmlGpuInstanceGetComputeInstances(self, gpu_instance: SimGpuInstance, profile_id: int,
                                           instances: Any, count: Any) -> int:
        gi = self._gi(gpu_instance)
        ci_profile(self._model(self._gpu(gpu_instance)), gi, profile_id)
        found = [ci for ci in gi["compute_instances"] if ci["profile_id"] == profile_id]
        for i, ci in enumerate(found):
            instances[i] = SimComputeInstance(gpu_instance.gpu, gi["id"], ci["id"])
        _deref(count).value = len(found)
        return pynvml.NVML_SUCCESS

    @_nvml
    def nvmlGpuInstanceGetComputeInstanceById(self, gpu_instance: SimGpuInstance, ci_id: int) -> SimComputeInstance:
        find_ci(self._gi(gpu_instance), ci_id)
        return SimComputeInstance(gpu_instance.gpu, gpu_instance.gi_id, ci_id)

    def _ci(self, compute_instance: Any, gpu: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(compute_instance, SimComputeInstance):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._gi(SimGpuInstance(compute_instance.gpu, compute_instance.gi_id), gpu)
        try:
            return gi, find_ci(gi, compute_instance.ci_id)
        except pynvml.NVMLError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    @_nvml
    def nvmlComputeInstanceGetInfo(self, compute_instance: SimComputeInstance) -> Any:
        _, ci = self._ci(compute_instance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()  # pynvml's own; `device` and `gpuInstance` stay NULL
        info.id, info.profileId = ci["id"], ci["profile_id"]
        info.placement.start, info.placement.size = ci["start"], ci["size"]
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    @_nvml
    def nvmlComputeInstanceDestroy(self, compute_instance: SimComputeInstance) -> int:
        with self._state.edit() as state:
            gpu = state["gpus"][compute_instance.gpu]
            gi, ci = self._ci(compute_instance, gpu)
            destroy_compute_instance(gpu, gi, ci)
        return pynvml.NVML_SUCCESS

    # --- MIG devices ---

    @_nvml
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: SimHandle) -> int:
        _, model = self._mig_capable(handle)
        return max(p.instances for p in model.mig_profiles)

    @_nvml
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: SimHandle, index: int) -> SimHandle:
        gpu, _ = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(self._mig_devices(gpu)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimHandle(handle.gpu, index)

    @_nvml
    def nvmlDeviceIsMigDeviceHandle(self, handle: SimHandle) -> bool:
        return handle.mig is not None

    @_nvml
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: SimHandle) -> SimHandle:
        self._mig_device(handle)
        return SimHandle(handle.gpu)

    @_nvml
    def nvmlDeviceGetGpuInstanceId(self, handle: SimHandle) -> int:
        return self._mig_device(handle)[0]["id"]

    @_nvml
    def nvmlDeviceGetComputeInstanceId(self, handle: SimHandle) -> int:
        return self._mig_device(handle)[1]["id"]

    @_nvml
    def nvmlDeviceGetAttributes(self, handle: SimHandle) -> Any:
        gpu = self._gpu(handle)
        if handle.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        model = self._model(gpu)
        gi, ci = self._mig_device(handle)
        g = gi_profile(model, gi["profile_id"])
        c = ci_profile(model, gi, ci["profile_id"])
        attributes = pynvml.c_nvmlDeviceAttributes()
        attributes.multiprocessorCount = c.multiprocessors
        attributes.sharedCopyEngineCount, attributes.sharedDecoderCount = g.copy_engines, g.decoders
        attributes.sharedEncoderCount, attributes.sharedJpegCount = g.encoders, g.jpeg
        attributes.sharedOfaCount = g.ofa
        attributes.gpuInstanceSliceCount, attributes.computeInstanceSliceCount = g.slices, c.slices
        attributes.memorySizeMB = g.memory_mib
        return attributes

    # --- topology (gpu_agent.sim.topology's rules) ---------------------------------------------

    def _nvlink(self, handle: SimHandle, link: int) -> dict[str, Any]:
        gpu = self._whole_gpu(handle)
        links = topology.of(gpu)["nvlinks"]
        if not links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    @_nvml
    def nvmlDeviceGetNvLinkState(self, handle: SimHandle, link: int) -> int:
        self._nvlink(handle, link)
        return pynvml.NVML_FEATURE_ENABLED

    @_nvml
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: SimHandle, link: int) -> int:
        self._nvlink(handle, link)
        return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH

    @_nvml
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: SimHandle, link: int) -> Any:
        gpu = self._nvlink(handle, link)
        switches = self._state.read()["pci"]["nvswitches"]
        info = pynvml.nvmlPciInfo_t()
        address = topology.nvswitch_of_link(link, topology.of(gpu)["nvlinks"], switches)
        info.busId = f"0000{address}".upper().encode()
        return info

    @_nvml
    def nvmlDeviceGetTopologyCommonAncestor(self, a: SimHandle, b: SimHandle) -> int:
        return topology.common_ancestor(self._whole_gpu(a), self._whole_gpu(b))

    @_nvml
    def nvmlDeviceGetP2PStatus(self, a: SimHandle, b: SimHandle, index: int) -> int:
        first, second = self._whole_gpu(a), self._whole_gpu(b)
        nvlink = bool(topology.of(first)["nvlinks"] and topology.of(second)["nvlinks"])
        if index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            return pynvml.NVML_P2P_STATUS_OK if nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        near = topology.common_ancestor(first, second) <= pynvml.NVML_TOPOLOGY_MULTIPLE
        return pynvml.NVML_P2P_STATUS_OK if nvlink or near else pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED

    # --- events ----------------------------------------------------------------------------

    @_nvml
    def nvmlEventSetCreate(self) -> SimEventSet:
        return SimEventSet(after_seq=self._state.read()["next_seq"], gpus=set())

    @_nvml
    def nvmlDeviceRegisterEvents(self, handle: SimHandle, event_types: int, event_set: SimEventSet) -> None:
        self._whole_gpu(handle)
        if event_types & ~(pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.gpus.add(handle.gpu)

    @_nvml
    def nvmlEventSetWait_v2(self, event_set: SimEventSet, timeout_ms: int) -> SimEventData:
        with self._lock:
            self._waits += 1
        try:
            return self._wait_for_event(event_set, timeout_ms)
        finally:
            event_set.close()  # its watch is the wait's: a set never freed (its process killed) holds none
            with self._lock:
                self._waits -= 1
                self._waits_done.notify_all()

    def _wait_for_event(self, event_set: SimEventSet, timeout_ms: int) -> SimEventData:
        deadline = time.monotonic() + timeout_ms / 1000
        self._state.release()  # it waits for a change: each read looks at the file
        event_set.watch(self._state)  # before reading: an XID raised after the read wakes the wait
        while True:
            for xid in self._state.read()["xids"]:
                if xid["seq"] >= event_set.after_seq and xid["gpu"] in event_set.gpus:
                    event_set.after_seq = xid["seq"] + 1
                    return SimEventData(SimHandle(xid["gpu"]), pynvml.nvmlEventTypeXidCriticalError, xid["xid"],
                                        xid.get("gpu_instance_id", 0xFFFFFFFF),
                                        xid.get("compute_instance_id", 0xFFFFFFFF))
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            event_set.wait_for_change(self._state, max(0.0, deadline - time.monotonic()))

    nvmlEventSetWait = nvmlEventSetWait_v2

    @_nvml
    def nvmlEventSetFree(self, event_set: SimEventSet) -> None:
        event_set.gpus.clear()
        event_set.close()


def _deref(value: Any) -> Any:
    """What a ctypes.byref() points to (NVML's out-parameters and placements), or the value itself."""
    return value._obj if hasattr(value, "_obj") else value
