"""DCGM's profiling series without DCGM: NVML GPM (Hopper and later) between two of the sampler's runs,
for each GPU and, on a MIG GPU, for each of its GPU instances (as dcgm-exporter reports them).

A GPM metric is worked out from two samples, so each GPU (and GPU instance) keeps its last sample until
the next run, and the buffer of the one before it to take the next sample into: two buffers each, allocated
once, so a run costs NVML two calls per GPU and GPU instance (sample, metrics), not four. Where the
GPU has no GPM (Ampere and older without DCGM) the series are left out and the reason is in the GPU's
sample (profiling_unavailable, which /status shows): never a made-up value.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import describe
from gpu_agent.nvml.model import Gpu, GpuSample

log = logging.getLogger(__name__)

SECOND_SAMPLE = "waiting for a second GPM sample (the metrics are over the interval between two)"
_Key = tuple[str, Optional[int]]  # (GPU UUID, GPU instance id or None for the whole GPU)


class Profiling:
    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._last: dict[_Key, Any] = {}  # the GPM sample of the previous run
        self._spare: dict[_Key, Any] = {}  # the buffer of the run before, to take the next sample into
        self._unsupported: dict[str, str] = {}  # by GPU UUID: why it has no GPM (it does not change)

    def add_to(self, sample: GpuSample, gpu: Gpu) -> GpuSample:
        """The sample with the GPM metrics since the last run, for the GPU and each GPU instance in the
        sample, or with profiling_unavailable saying why not. NvmlHung and NvmlUnavailable are the
        sampler's to handle; an NVML error here is only a reason."""
        try:
            why = self._why_unsupported(gpu)
        except self.nvml.lib.NVMLError as exc:
            why = f"GPM support unknown: {describe(exc)}"
        if why:
            return replace(sample, profiling_unavailable=why)
        metrics, problem = self._read(gpu, None)
        instances = tuple(replace(instance, **self._read(gpu, instance.gpu_instance_id)[0]) for instance in sample.mig)
        return replace(sample, **metrics, profiling_unavailable=problem, mig=instances)

    def _read(self, gpu: Gpu, gpu_instance: Optional[int]) -> tuple[dict[str, Any], Optional[str]]:
        key = (gpu.uuid, gpu_instance)
        buffer = self._spare.pop(key, None)
        try:
            if buffer is None:
                buffer = self.nvml.gpm.alloc()
            new = self.nvml.gpm.fill(buffer, gpu.index, gpu_instance)
        except self.nvml.lib.NVMLError as exc:
            if buffer is not None:
                self.nvml.gpm.free(buffer)
            self._forget(key)
            return {}, f"GPM sample failed: {describe(exc)}"
        old = self._last.pop(key, None)
        self._last[key] = new
        if old is None:
            return {}, SECOND_SAMPLE
        self._spare[key] = old
        try:
            return self.nvml.gpm.metrics(old, new), None
        except self.nvml.lib.NVMLError as exc:
            return {}, f"GPM metrics failed: {describe(exc)}"

    def _why_unsupported(self, gpu: Gpu) -> str:
        if gpu.uuid not in self._unsupported:
            why = self.nvml.gpm.unsupported(gpu.index) or ""
            if why:
                log.info("GPU %d: DCGM_FI_PROF_* series left out: %s", gpu.index, why)
            self._unsupported[gpu.uuid] = why
        return self._unsupported[gpu.uuid]

    def _forget(self, key: _Key) -> None:
        for kept in (self._last, self._spare):
            old = kept.pop(key, None)
            if old is not None:
                self.nvml.gpm.free(old)

    def keep_only(self, kept: dict[str, GpuSample]) -> None:
        """Free the samples of GPUs and GPU instances no longer sampled."""
        wanted: set[_Key] = {(uuid, None) for uuid in kept}
        wanted |= {(uuid, instance.gpu_instance_id) for uuid, sample in kept.items() for instance in sample.mig}
        for key in (set(self._last) | set(self._spare)) - wanted:
            self._forget(key)
