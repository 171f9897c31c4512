"""NVML GPM: the profiling metrics of Hopper and later, without DCGM. A sample buffer is filled per
GPU (or GPU instance) and the metrics are worked out over the interval between two samples."""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from gpu_agent.nvml.session import NvmlHung, NvmlSession, NvmlUnavailable, describe

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# The NVML GPM metrics sampled: (GpuSample field, pynvml constant, factor to DCGM's unit). GPM answers
# percentages where DCGM's PROF fields are ratios, and MiB/s where DCGM says bytes/s.
GPM_METRICS = (
    ("gr_engine_active", "NVML_GPM_METRIC_GRAPHICS_UTIL", 0.01),
    ("pipe_tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    ("pcie_tx_bytes", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", float(MIB)),
    ("pcie_rx_bytes", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", float(MIB)),
)


class NvmlGpm:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self._request = threading.local()  # `request`: this thread's nvmlGpmMetricsGet request

    def unsupported(self, index: int) -> Optional[str]:
        """None when the GPU has NVML GPM, else why not (the PROF series are then left out)."""
        self.session.init()
        lib = self.session.lib
        handle = self.session.handle(index)
        try:
            support = self.session.call("nvmlGpmQueryDeviceSupport", handle)
        except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound) as exc:
            return f"NVML GPM unavailable ({describe(exc)}); DCGM's profiling module would be needed"
        if not support.isSupportedDevice:
            return "NVML GPM is not supported on this GPU (Hopper and later have it); DCGM would be needed"
        return None

    def alloc(self) -> Any:
        """A GPM sample buffer, filled by fill() as often as wanted; give it back with free()."""
        return self.session.call("nvmlGpmSampleAlloc")

    def fill(self, sample: Any, index: int, gpu_instance: Optional[int] = None) -> Any:
        """Take a GPM sample of the GPU, or of one of its GPU instances, into `sample` (NVML overwrites it)."""
        self.session.init()
        handle = self.session.handle(index)
        if gpu_instance is not None:
            return self.session.call("nvmlGpmMigSampleGet", handle, gpu_instance, sample)
        return self.session.call("nvmlGpmSampleGet", handle, sample)

    def free(self, sample: Any) -> None:
        try:
            self.session.call("nvmlGpmSampleFree", sample)
        except (self.session.lib.NVMLError, NvmlHung, NvmlUnavailable) as exc:  # let go: shutdown freed it
            log.debug("nvmlGpmSampleFree: %s", exc)

    def metrics(self, first: Any, second: Any) -> dict[str, float]:
        """GPM_METRICS over the interval between two samples; a metric NVML does not answer is left out."""
        lib = self.session.lib
        request = getattr(self._request, "request", None)
        if request is None:  # made once per thread (NVML fills its metrics in at each call): a sample asks 64 times
            request = self._request.request = lib.c_nvmlGpmMetricsGet_t()
            request.version = lib.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            for n, (_, constant, _) in enumerate(GPM_METRICS):
                request.metrics[n].metricId = getattr(lib, constant)
        request.sample1, request.sample2 = first, second
        answered = self.session.call("nvmlGpmMetricsGet", request).metrics
        success = lib.NVML_SUCCESS
        found = {}
        for n, (key, _, factor) in enumerate(GPM_METRICS):
            metric = answered[n]
            if metric.nvmlReturn == success:
                found[key] = metric.value * factor
        return found
