"""DCGM's profiling series without DCGM: NVML GPM (Hopper and later) between two of the sampler's runs.

A GPM metric is worked out from two samples, so each GPU keeps its last sample until the next run.
Where the GPU has no GPM (Ampere and older without DCGM) the series are left out and the reason is
in the GPU's sample (profiling_unavailable, which /status shows): never a made-up value.
"""
from __future__ import annotations

import logging
from typing import Any

from gpu_agent.nvml.client import Nvml, describe
from gpu_agent.nvml.model import Gpu

log = logging.getLogger(__name__)

SECOND_SAMPLE = "waiting for a second GPM sample (the metrics are over the interval between two)"


class Profiling:
    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._last: dict[str, Any] = {}  # by GPU UUID: the GPM sample of the previous run
        self._unsupported: dict[str, str] = {}  # by GPU UUID: why it has no GPM (it does not change)

    def read(self, gpu: Gpu) -> dict[str, Any]:
        """GpuSample fields: the GPM metrics since the last read, or profiling_unavailable and why.
        NvmlHung and NvmlUnavailable are the sampler's to handle; an NVML error here is only a reason."""
        try:
            why = self._why_unsupported(gpu)
            if why:
                return {"profiling_unavailable": why}
            new = self.nvml.gpm_sample(gpu.index)
        except self.nvml.lib.NVMLError as exc:
            return {"profiling_unavailable": f"GPM sample failed: {describe(exc)}"}
        old = self._last.pop(gpu.uuid, None)
        self._last[gpu.uuid] = new
        if old is None:
            return {"profiling_unavailable": SECOND_SAMPLE}
        try:
            return self.nvml.gpm_metrics(old, new)
        except self.nvml.lib.NVMLError as exc:
            return {"profiling_unavailable": f"GPM metrics failed: {describe(exc)}"}
        finally:
            self.nvml.gpm_free(old)

    def _why_unsupported(self, gpu: Gpu) -> str:
        if gpu.uuid not in self._unsupported:
            why = self.nvml.gpm_unsupported(gpu.index) or ""
            if why:
                log.info("GPU %d: DCGM_FI_PROF_* series left out: %s", gpu.index, why)
            self._unsupported[gpu.uuid] = why
        return self._unsupported[gpu.uuid]

    def keep_only(self, uuids: set[str]) -> None:
        """Free the samples of GPUs no longer in the inventory."""
        for uuid in set(self._last) - uuids:
            self.nvml.gpm_free(self._last.pop(uuid))
