"""The periodic GPU health checks (health.check_interval_seconds): each is a named check in
/readyz?verbose, and a GPU that fails one is unhealthy until it passes again.

- nvml-responsive: NVML answers within its timeout (a hung call fails it; the caller's thread gets
  NvmlHung after nvml.call_timeout_seconds, so the event loop and the watchdog never wait for it);
- row-remap-pending: rows waiting to be remapped at the next GPU reset (pages waiting for retirement
  on a GPU without row remapping; an H100 has only the former);
- row-remap-failure: a row remapping failed (the GPU has run out of spare rows);
- temperature: at or above the slowdown threshold.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Union

from gpu_agent.health.policy import GPU_CHECKS, NVML_RESPONSIVE
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlHung, NvmlUnavailable, describe
from gpu_agent.nvml.model import Gpu, GpuHealth, HealthReading
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)


def judge(reading: HealthReading) -> dict[str, str]:
    """Why the GPU fails each check it fails (check name -> reason); empty when it passes them all."""
    failed = {}
    if reading.pending_remaps:
        failed["row-remap-pending"] = (f"{reading.pending_kind} pending: takes effect at the next GPU reset; "
                                       "drain the node and reset the GPU")
    if reading.remap_failed:
        failed["row-remap-failure"] = "row remapping failed (no spare rows left): replace the GPU"
    if reading.temperature_c is not None and reading.slowdown_c is not None \
            and reading.temperature_c >= reading.slowdown_c:
        failed["temperature"] = (f"{reading.temperature_c} C, at or above its slowdown threshold of "
                                 f"{reading.slowdown_c} C: check the cooling")
    return failed


class HealthChecks:
    """One round of checks per run(), on a worker thread; the results go to the state model."""

    def __init__(self, nvml: Nvml, state: AgentState, clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml
        self.state = state
        self.clock = clock

    def run(self) -> None:
        inventory = self.state.inventory
        if inventory is None:
            return
        failing: dict[str, dict[str, str]] = {name: {} for name in GPU_CHECKS}
        try:
            readings = self.nvml.session.batch("nvmlDeviceGet*(health of every GPU)", self._read_every, inventory.gpus)
        except (NvmlHung, NvmlUnavailable) as exc:
            self._publish_hung(str(exc))
            return
        for gpu, reading in zip(inventory.gpus, readings):
            if isinstance(reading, HealthReading):
                for name, reason in judge(reading).items():
                    failing[name][gpu.uuid] = reason
            else:  # this GPU does not answer: the sampler says so
                log.debug("GPU %d health checks skipped: %s", gpu.index, describe(reading))
        self._publish(failing)

    def _read_every(self, gpus: tuple[Gpu, ...]) -> list[Union[HealthReading, Exception]]:
        """On an NVML worker, in one trip: each GPU's reading, or the NVMLError it answered."""
        readings: list[Union[HealthReading, Exception]] = []
        for gpu in gpus:
            try:
                readings.append(self.nvml.health.reading(gpu.index))
            except self.nvml.lib.NVMLError as exc:
                readings.append(exc)
        return readings

    def _publish_hung(self, reason: str) -> None:
        """NVML did not answer in time: that check fails; the GPU checks keep their last results."""
        if self.state.nvml_check != reason:
            log.error("health check %s failed: %s", NVML_RESPONSIVE, reason)
        self.state.publish_nvml_hung(reason, self.clock())

    def _publish(self, failing: dict[str, dict[str, str]]) -> None:
        if self.state.nvml_check is not None:
            log.info("health check %s passes again", NVML_RESPONSIVE)
        before = self.state.gpu_checks
        for name in GPU_CHECKS:
            for uuid in failing[name].keys() - before.get(name, {}).keys():
                log.error("%s fails health check %s: %s", self.state.gpu_name(uuid), name, failing[name][uuid])
            for uuid in before.get(name, {}).keys() - failing[name].keys():
                log.info("%s passes health check %s again", self.state.gpu_name(uuid), name)
        self.state.publish_checks(failing, self.clock())
        for gpu in self.state.inventory.gpus if self.state.inventory else ():
            reason = "; ".join(f"{name}: {failing[name][gpu.uuid]}" for name in GPU_CHECKS if gpu.uuid in failing[name])
            current = self.state.health.get(gpu.uuid)
            if (current.check_reason if current else "") != reason:
                self.state.update_health(gpu.uuid, _with_check_reason(reason))


def _with_check_reason(reason: str) -> Callable[[GpuHealth], GpuHealth]:
    return lambda health: replace(health, check_reason=reason)
