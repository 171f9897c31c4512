"""A fake of pynvml: same function names, return shapes and NVMLError classes, backed by MachineState.

Constants, structures and error classes are pynvml's own, so code written against pynvml (the
agent's NVML client) runs here unchanged. Faults injected with `gpu-agent sim fail` make a call
raise the NVMLError a real driver would, or hang.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pynvml

from gpu_agent.sim.kernel import loaded_version
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.profiles import MODELS, GpuModel

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


@dataclass
class SimEventSet:
    after_seq: int
    gpus: set[int]


@dataclass(frozen=True)
class SimEventData:
    """Fields of pynvml's c_nvmlEventData_t; `device` is a handle of this fake."""

    device: SimHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


def _nvml(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every fake call: NVML must be initialised, and an injected fault for it fires first."""

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        if self._init_count == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = args[0].gpu if args and isinstance(args[0], (SimHandle, SimGpuInstance)) else None
        self._fault(fn.__name__, gpu)
        return fn(self, *args, **kwargs)

    return call


class FakeNvml:
    """Stands in for the pynvml module. Anything not defined here is pynvml's own attribute."""

    def __init__(self, state: MachineState) -> None:
        self._state = state
        self.machine = state  # the simulator's own handle, not part of pynvml's surface
        self._init_count = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value):
            def not_simulated(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return not_simulated
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
        if not isinstance(handle, (SimHandle, SimGpuInstance)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpus = self._gpus()
        if not 0 <= handle.gpu < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpus[handle.gpu]

    def _model(self, gpu: dict[str, Any]) -> GpuModel:
        return MODELS[gpu["model"]]

    def _whole_gpu(self, handle: Any) -> dict[str, Any]:
        gpu = self._gpu(handle)
        if isinstance(handle, SimHandle) and handle.mig is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_instance(self, handle: SimHandle) -> dict[str, Any]:
        gpu = self._gpu(handle)
        if handle.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        instances = gpu["mig"]["instances"]
        if handle.mig >= len(instances):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return instances[handle.mig]

    def _mig_capable(self, handle: Any) -> tuple[dict[str, Any], GpuModel]:
        gpu = self._whole_gpu(handle)
        model = self._model(gpu)
        if not model.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, model

    def _utilization(self, gpu: dict[str, Any]) -> int:
        return min(100, 35 * len(gpu["processes"]))

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
        with self._lock:
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
        return len(self._gpus())

    @_nvml
    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        if not 0 <= index < len(self._gpus()):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimHandle(index)

    @_nvml
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> SimHandle:
        for index, gpu in enumerate(self._gpus()):
            if gpu["uuid"] == uuid:
                return SimHandle(index)
            for slot, instance in enumerate(gpu["mig"]["instances"]):
                if instance["uuid"] == uuid:
                    return SimHandle(index, slot)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml
    def nvmlDeviceGetIndex(self, handle: SimHandle) -> int:
        self._whole_gpu(handle)
        return handle.gpu

    @_nvml
    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        if handle.mig is not None:
            return self._mig_instance(handle)["uuid"]
        return self._gpu(handle)["uuid"]

    @_nvml
    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        model = self._model(self._gpu(handle))
        if handle.mig is None:
            return model.name
        profile = self._profile_by_id(model, self._mig_instance(handle)["profile_id"])
        return f"{model.name} {profile.name}"  # e.g. "NVIDIA H100 80GB HBM3 MIG 3g.40gb"

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
    def nvmlDeviceGetCudaComputeCapability(self, handle: SimHandle) -> tuple[int, int]:
        return self._model(self._gpu(handle)).compute_capability

    @_nvml
    def nvmlDeviceGetMemoryInfo(self, handle: SimHandle, version: Any = None) -> Any:
        """v1 counts the driver's reserved memory as used; v2 (pynvml.nvmlMemory_v2) reports it apart."""
        gpu = self._gpu(handle)
        mib = 1024 * 1024
        reserved = 0
        if handle.mig is not None:
            instance = self._mig_instance(handle)
            profile = self._profile_by_id(self._model(gpu), instance["profile_id"])
            total = profile.memory_mib
            used = sum(p["used_mib"] for p in gpu["processes"] if p.get("gpu_instance_id") == instance["gi_id"])
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
        return self._model(gpu).idle_temp_c + self._utilization(gpu) * 2 // 5

    @_nvml
    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        gpu = self._whole_gpu(handle)
        model = self._model(gpu)
        watts = model.idle_power_w + (model.max_power_w - model.idle_power_w) * self._utilization(gpu) * 0.8 / 100
        return int(watts * 1000)

    @_nvml
    def nvmlDeviceGetComputeRunningProcesses(self, handle: SimHandle) -> list[Any]:
        """pynvml's own answer: its friendly objects with the fields of c_nvmlProcessInfo_t."""
        gpu = self._whole_gpu(handle)
        return [
            pynvml.nvmlFriendlyObject({"pid": p["pid"], "usedGpuMemory": p["used_mib"] * 1024 * 1024,
                                       "gpuInstanceId": p.get("gpu_instance_id", 0xFFFFFFFF),
                                       "computeInstanceId": 0xFFFFFFFF})
            for p in gpu["processes"]
        ]

    # --- MIG -------------------------------------------------------------------------------

    @staticmethod
    def _profile_by_id(model: GpuModel, profile_id: int) -> Any:
        return next(p for p in model.mig_profiles if p.id == profile_id)

    @_nvml
    def nvmlDeviceGetMigMode(self, handle: SimHandle) -> list[int]:
        gpu, _ = self._mig_capable(handle)
        return [gpu["mig"]["current"], gpu["mig"]["pending"]]

    @_nvml
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: SimHandle, profile: int, version: int = 2) -> Any:
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
        size = count._obj if hasattr(count, "_obj") else count
        if placements is None or size.value < len(profile.starts):
            size.value = len(profile.starts)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(profile.starts):
            placements[i].start, placements[i].size = start, profile.size
        size.value = len(profile.starts)
        return pynvml.NVML_SUCCESS

    @_nvml
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: SimHandle) -> int:
        _, model = self._mig_capable(handle)
        return max(p.instances for p in model.mig_profiles)

    @_nvml
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: SimHandle, index: int) -> SimHandle:
        gpu, _ = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(gpu["mig"]["instances"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimHandle(handle.gpu, index)

    @_nvml
    def nvmlDeviceIsMigDeviceHandle(self, handle: SimHandle) -> bool:
        return handle.mig is not None

    @_nvml
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: SimHandle) -> SimHandle:
        self._mig_instance(handle)
        return SimHandle(handle.gpu)

    @_nvml
    def nvmlDeviceGetGpuInstanceId(self, handle: SimHandle) -> int:
        return self._mig_instance(handle)["gi_id"]

    @_nvml
    def nvmlDeviceGetComputeInstanceId(self, handle: SimHandle) -> int:
        return self._mig_instance(handle)["ci_id"]

    @_nvml
    def nvmlDeviceGetAttributes(self, handle: SimHandle) -> Any:
        gpu = self._gpu(handle)
        model = self._model(gpu)
        attributes = pynvml.c_nvmlDeviceAttributes()
        if handle.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile = self._profile_by_id(model, self._mig_instance(handle)["profile_id"])
        attributes.multiprocessorCount = profile.multiprocessors
        attributes.sharedCopyEngineCount, attributes.sharedDecoderCount = profile.copy_engines, profile.decoders
        attributes.sharedEncoderCount, attributes.sharedJpegCount = profile.encoders, profile.jpeg
        attributes.sharedOfaCount = profile.ofa
        attributes.gpuInstanceSliceCount = attributes.computeInstanceSliceCount = profile.slices
        attributes.memorySizeMB = profile.memory_mib
        return attributes

    @_nvml
    def nvmlDeviceGetGpuInstanceById(self, handle: SimHandle, gi_id: int) -> SimGpuInstance:
        gpu, _ = self._mig_capable(handle)
        if not gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_STATE)
        if not any(i["gi_id"] == gi_id for i in gpu["mig"]["instances"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimGpuInstance(handle.gpu, gi_id)

    @_nvml
    def nvmlGpuInstanceGetInfo(self, gpu_instance: SimGpuInstance) -> Any:
        gpu = self._gpu(gpu_instance)
        instance = next((i for i in gpu["mig"]["instances"] if i["gi_id"] == gpu_instance.gi_id), None)
        if instance is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # pynvml's own structure, so a capture records it; its `device` stays NULL (this fake's
        # handles are not ctypes pointers), the caller holds the device already.
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = instance["gi_id"], instance["profile_id"]
        info.placement.start, info.placement.size = instance["start"], instance["size"]
        return info

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
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            for xid in self._state.read()["xids"]:
                if xid["seq"] >= event_set.after_seq and xid["gpu"] in event_set.gpus:
                    event_set.after_seq = xid["seq"] + 1
                    return SimEventData(SimHandle(xid["gpu"]), pynvml.nvmlEventTypeXidCriticalError, xid["xid"],
                                        0xFFFFFFFF, 0xFFFFFFFF)
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    nvmlEventSetWait = nvmlEventSetWait_v2

    @_nvml
    def nvmlEventSetFree(self, event_set: SimEventSet) -> None:
        event_set.gpus.clear()
