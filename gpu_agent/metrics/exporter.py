"""/metrics: the agent's own gpu_agent_* series and dcgm-exporter-compatible GPU series.

Everything is read from the state model at scrape time; the GPU values come from the background
sampler, so a scrape never calls NVML.
"""
from __future__ import annotations

import socket
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpu_agent import __version__
from gpu_agent.state import AgentState

DCGM_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]

# (name, help, GpuSample field); help texts are dcgm-exporter's default counters file.
_DCGM_FIELDS = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_percent"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "memory_free_mib"),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", "memory_reserved_mib"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
)


class AgentCollector:
    def __init__(self, state: AgentState, nvml_timeouts: Callable[[], int], hostname: Optional[str]) -> None:
        self.state = state
        self.nvml_timeouts = nvml_timeouts
        self.hostname = hostname or socket.gethostname()

    def collect(self) -> Iterator[Metric]:
        yield from self._agent()
        yield from self._stages()
        yield from self._gpus()

    def _agent(self) -> Iterator[Metric]:
        state = self.state
        info = GaugeMetricFamily("gpu_agent_build_info", "gpu-agent version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily("gpu_agent_ready", "1 when every stage converged and every GPU is healthy.",
                                value=int(state.ready))
        yield GaugeMetricFamily("gpu_agent_config_reload_failed", "1 when the last configuration reload was rejected.",
                                value=int(state.config_error is not None))
        yield CounterMetricFamily("gpu_agent_reconciles", "Reconcile passes run.", value=state.reconciles)
        yield CounterMetricFamily("gpu_agent_nvml_call_timeouts", "NVML calls abandoned after their timeout.",
                                  value=self.nvml_timeouts())
        yield GaugeMetricFamily("gpu_agent_gpus", "GPUs visible through NVML.",
                                value=len(state.inventory.gpus) if state.inventory else 0)
        restarts = CounterMetricFamily("gpu_agent_runtime_restarts", "Container runtime restarts by the agent.",
                                       labels=["runtime"])
        for runtime, count in sorted(state.runtime_restarts.items()):
            restarts.add_metric([runtime], count)
        yield restarts

    def _stages(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gpu_agent_stage_ok", "1 when the stage converged on its last run.", labels=["stage"])
        failures = GaugeMetricFamily("gpu_agent_stage_consecutive_failures", "Failed runs since the last success.",
                                     labels=["stage"])
        duration = GaugeMetricFamily("gpu_agent_stage_duration_seconds", "Duration of the stage's last run.",
                                     labels=["stage"])
        last_run = GaugeMetricFamily("gpu_agent_stage_last_run_timestamp_seconds", "When the stage last ran.",
                                     labels=["stage"])
        changes = CounterMetricFamily("gpu_agent_stage_changes", "Changes the stage applied to the host.",
                                      labels=["stage"])
        for stage in self.state.stages.values():
            up.add_metric([stage.name], int(stage.state == "ok"))
            failures.add_metric([stage.name], stage.failures)
            duration.add_metric([stage.name], stage.duration_seconds)
            last_run.add_metric([stage.name], stage.last_run or 0)
            changes.add_metric([stage.name], stage.changes_applied)
        yield from (up, failures, duration, last_run, changes)

    def _gpus(self) -> Iterator[Metric]:
        inventory = self.state.inventory
        if inventory is None:
            return
        families = {
            field: GaugeMetricFamily(name, help_text, labels=DCGM_LABELS) for name, help_text, field in _DCGM_FIELDS
        }
        xid = GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.",
                                labels=DCGM_LABELS)
        xid_total = CounterMetricFamily(
            "gpu_agent_xid_events", "XID events seen, by XID.", labels=["gpu", "UUID", "xid"]
        )
        healthy = GaugeMetricFamily("gpu_agent_gpu_healthy", "1 when the GPU is healthy.", labels=DCGM_LABELS)
        for gpu in inventory.gpus:
            labels = [str(gpu.index), gpu.uuid, gpu.device_node, gpu.product, self.hostname]
            sample = self.state.samples.get(gpu.uuid)
            if sample is not None:
                for field, family in families.items():
                    value = getattr(sample, field)
                    if value is not None:
                        family.add_metric(labels, value)
            health = self.state.health.get(gpu.uuid)
            xid.add_metric(labels, health.last_xid if health and health.last_xid is not None else 0)
            healthy.add_metric(labels, int(health.healthy) if health else 1)
            for code, count in health.xid_counts if health else ():
                xid_total.add_metric([str(gpu.index), gpu.uuid, str(code)], count)
        yield from families.values()
        yield from (xid, xid_total, healthy)


def make_registry(collector: AgentCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
