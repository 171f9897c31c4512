"""A GPU's metrics through NVML: utilisation, temperature, power, clocks, counters, field values and
framebuffer, and each GPU instance's framebuffer on a MIG GPU."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from gpu_agent.nvml.model import GpuSample, MigSample, MigState
from gpu_agent.nvml.session import NvmlSession

MIB = 1024 * 1024
ALL_LINKS = 0xFFFFFFFF  # a field value's scopeId for "every NVLink of the GPU", as DCGM passes it

# The NVML field values sampled: (GpuSample field or part of one, pynvml constant, scope).
SAMPLED_FIELDS = (
    ("memory_temperature_c", "NVML_FI_DEV_MEMORY_TEMP", 0),
    ("nvlink_rx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS),
    ("nvlink_tx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS),
)
# The union member each NVML_VALUE_TYPE_* is read from, by its number.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class NvmlSampling:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self._memory_v2: Optional[bool] = None  # whether the driver has NVML's v2 memory info
        # By GPU index: the session's generation, the MIG layout sampled last and its MIG devices'
        # handles by device index. A MIG device's handle lasts as long as the device; a new layout,
        # or a pass's start or a change (a new generation), asks again.
        self._mig_handles: dict[int, tuple[int, MigState, dict[int, Any]]] = {}
        self._lock = threading.Lock()

    def sample(self, index: int, mig: Optional[MigState] = None) -> GpuSample:
        """One GPU's metrics (and its GPU instances' framebuffer, given its MIG state); a metric the GPU
        does not support is left out, not faked. Its calls go to an NVML worker as one batch, under
        one timeout: a hop per call cost most of a sample's CPU."""
        return self.session.batch(f"nvmlDeviceGet*(GPU {index})", self._sample, index, mig)

    def _sample(self, index: int, mig: Optional[MigState]) -> GpuSample:
        handle = self.session.handle(index)
        lib = self.session.lib
        values: dict[str, Any] = {}

        def read(call: str, *args: Any, into: Callable[[Any], dict[str, float]]) -> None:
            try:
                values.update(into(self.session.call(call, handle, *args)))
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
        read("nvmlDeviceGetCurrentClocksEventReasons", into=lambda reasons: {"clock_event_reasons": int(reasons)})
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
        lib = self.session.lib
        wanted = [(key, getattr(lib, constant), scope) for key, constant, scope in SAMPLED_FIELDS
                  if hasattr(lib, constant)]
        try:
            answered = self.session.call("nvmlDeviceGetFieldValues", handle,
                                         [(field, scope) for _, field, scope in wanted])
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
                memory = _framebuffer(self.session.call("nvmlDeviceGetMemoryInfo", device))
            except self.session.lib.NVMLError_NotSupported:
                memory = {}
            samples.append(MigSample(gi.id, gi.profile, **memory))
        return tuple(samples)

    def _mig_device_handle(self, index: int, handle: Any, mig: MigState, device_index: int) -> Any:
        """A MIG device's handle, asked once per MIG layout of the GPU and generation of the session."""
        generation = self.session.generation
        with self._lock:
            known = self._mig_handles.get(index)
            if known is None or known[0] != generation or (known[1] is not mig and known[1] != mig):
                known = self._mig_handles[index] = (generation, mig, {})
        device = known[2].get(device_index)
        if device is None:
            device = known[2][device_index] = self.session.call("nvmlDeviceGetMigDeviceHandleByIndex", handle,
                                                                device_index)
        return device

    def _memory(self, handle: Any) -> Any:
        """NVML's v2 memory info, which reports the driver's reserved memory apart from `used` (v1
        counts it as used: 480 MiB on an idle H100), or v1 where the driver has no v2."""
        lib = self.session.lib
        if self._memory_v2 is not False:
            try:
                memory = self.session.call("nvmlDeviceGetMemoryInfo", handle, lib.nvmlMemory_v2)
            except (lib.NVMLError_FunctionNotFound, lib.NVMLError_ArgumentVersionMismatch, lib.NVMLError_NotSupported):
                self._memory_v2 = False
            else:
                self._memory_v2 = True
                return memory
        return self.session.call("nvmlDeviceGetMemoryInfo", handle)


def _framebuffer(memory: Any) -> dict[str, float]:
    found = {"memory_used_mib": memory.used / MIB, "memory_free_mib": memory.free / MIB}
    if hasattr(memory, "reserved"):
        found["memory_reserved_mib"] = memory.reserved / MIB
    return found
