"""What the health checks and the GPU reset ask NVML: row remaps, temperatures, passthrough."""
from __future__ import annotations

from typing import Any

from gpu_agent.nvml.model import HealthReading
from gpu_agent.nvml.session import NvmlSession


class NvmlHealth:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session

    def reading(self, index: int) -> HealthReading:
        """What the periodic checks judge: pending and failed row remaps (or pending page retirements
        on a GPU without row remapping), the temperature and the slowdown threshold. One trip to a worker."""
        return self.session.batch(f"nvmlDeviceGet*(GPU {index} health)", self._reading, index)

    def _reading(self, index: int) -> HealthReading:
        call = self.session.call
        handle = self.session.handle(index)
        lib = self.session.lib
        unsupported = (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound)
        found: dict[str, Any] = {}
        try:
            rows = call("nvmlDeviceGetRemappedRows", handle)
            found.update(pending_remaps=bool(rows[2]), remap_failed=bool(rows[3]))
        except unsupported:
            try:
                pending = call("nvmlDeviceGetRetiredPagesPendingStatus", handle)
                found.update(pending_remaps=pending == lib.NVML_FEATURE_ENABLED, pending_kind="page retirement")
            except unsupported:
                pass
        try:
            found["temperature_c"] = int(call("nvmlDeviceGetTemperature", handle, lib.NVML_TEMPERATURE_GPU))
            found["slowdown_c"] = int(call("nvmlDeviceGetTemperatureThreshold", handle,
                                           lib.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except unsupported:
            pass
        return HealthReading(**found)

    def passthrough(self, index: int) -> bool:
        """Whether the GPU is passed through into this VM (NVML's virtualization mode): the VM cannot reset it."""
        self.session.init()
        lib = self.session.lib
        handle = self.session.handle(index)
        try:
            mode = self.session.call("nvmlDeviceGetVirtualizationMode", handle)
        except lib.NVMLError_NotSupported:
            return False
        return bool(mode == lib.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH)
