"""/metrics: the agent's own gpu_agent_* series and dcgm-exporter-compatible GPU series.

Everything is read from the state model at scrape time; the GPU values come from the background
sampler, so a scrape never calls NVML. The agent's own families are written as prometheus_client
would write them (metrics/text.py); the DCGM series as dcgm-exporter does, which names a counter X
where a client library would name it X_total, and keeps its own label order.
"""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional

from gpu_agent import __version__
from gpu_agent.metrics import exp, text
from gpu_agent.metrics.dcgm import DEFAULT_COUNTERS, LABELS, XID_ERRORS, XID_LABELS, Counter, dcgm_bus_id, xid_labels
from gpu_agent.metrics.text import Family
from gpu_agent.metrics.view import PER_PROCESS
from gpu_agent.metrics.view import SeriesView as _View
from gpu_agent.nvml.model import Gpu
from gpu_agent.state import AgentState

if TYPE_CHECKING:
    from gpu_agent.metrics.own_process import OwnProcessCollector

class AgentCollector:
    def __init__(self, state: AgentState, nvml_timeouts: Callable[[], int], hostname: Optional[str]) -> None:
        self.state = state
        self.nvml_timeouts = nvml_timeouts
        self.hostname = hostname or socket.gethostname()
        self.connection_errors: Mapping[str, int] = {}  # the HTTP endpoint's, by reason (daemon/http.py sets it)

    def collect(self) -> Iterator[Family]:
        yield from self._agent()
        yield from self._stages()
        yield from self._gpus()
        yield self._health_transitions()

    def _agent(self) -> Iterator[Family]:
        state = self.state
        info = text.gauge("gpu_agent_build_info", "gpu-agent version.", labels=["version"])
        info.add([__version__], 1)
        yield info
        yield text.gauge("gpu_agent_ready", "1 when every stage converged and every GPU is healthy.",
                         value=int(state.ready))
        yield text.gauge("gpu_agent_config_reload_failed", "1 when the last configuration reload was rejected.",
                         value=int(state.config_error is not None))
        yield text.counter("gpu_agent_reconciles", "Reconcile passes run.", value=state.reconciles)
        yield text.counter("gpu_agent_nvml_call_timeouts", "NVML calls abandoned after their timeout.",
                           value=self.nvml_timeouts())
        yield text.gauge("gpu_agent_gpus", "GPUs visible through NVML.",
                         value=state.inventory.count if state.inventory else 0)
        restarts = text.counter("gpu_agent_runtime_restarts", "Container runtime restarts by the agent.",
                                labels=["runtime"])
        for runtime, count in sorted(state.runtime_restarts.items()):
            restarts.add([runtime], count)
        yield restarts
        if state.mps:  # only where MPS shares: the families of a node without it stay as they were
            mps = text.counter("gpu_agent_mps_daemon_restarts", "MPS control daemon restarts by the agent, by "
                               "shared resource.", labels=["resource"])
            up = text.gauge("gpu_agent_mps_daemon_up", "1 while the resource's MPS control daemon answers.",
                            labels=["resource"])
            for daemon in state.mps["daemons"]:
                mps.add([daemon["resource"]], daemon["restarts"])
                up.add([daemon["resource"]], int(daemon["up"]))
            yield mps
            yield up
        yield from self._kube_api()
        errors = text.counter("gpu_agent_http_connection_errors",
                              "HTTP connections ended by their socket's error (ECONNRESET, EPIPE, ENOTCONN...) "
                              "or closed for not reading their answers, by reason.", labels=["reason"])
        for reason, count in sorted(self.connection_errors.items()):
            errors.add([reason], count)
        yield errors

    def _kube_api(self) -> Iterator[Family]:
        section = self.state.kube_api or {}
        yield text.counter("gpu_agent_kube_api_conflicts", "409 Conflict answers to the agent's writes to its Node, "
                           "each followed by a fresh read and the write made again.",
                           value=section.get("conflicts", 0))
        retries = text.counter("gpu_agent_kube_api_retries", "Kubernetes API requests that failed and were retried "
                               "on the API's own schedule, by reason.", labels=["reason"])
        for reason, count in (section.get("retries") or {}).items():
            retries.add([reason], count)
        yield retries

    def _stages(self) -> Iterator[Family]:
        up = text.gauge("gpu_agent_stage_ok", "1 when the stage converged on its last run.", labels=["stage"])
        failures = text.gauge("gpu_agent_stage_consecutive_failures", "Failed runs since the last success.",
                              labels=["stage"])
        duration = text.gauge("gpu_agent_stage_duration_seconds", "Duration of the stage's last run.",
                              labels=["stage"])
        last_run = text.gauge("gpu_agent_stage_last_run_timestamp_seconds", "When the stage last ran.",
                              labels=["stage"])
        changes = text.counter("gpu_agent_stage_changes", "Changes the stage applied to the host.",
                               labels=["stage"])
        for stage in self.state.stages.values():
            up.add([stage.name], int(stage.state == "ok"))
            failures.add([stage.name], stage.failures)
            duration.add([stage.name], stage.duration_seconds)
            last_run.add([stage.name], stage.last_run or 0)
            changes.add([stage.name], stage.changes_applied)
        yield from (up, failures, duration, last_run, changes)

    def _gpus(self) -> Iterator[Family]:
        inventory = self.state.inventory
        if inventory is None:
            return
        xid_total = text.counter("gpu_agent_xid_events", "XID events seen, by XID.",
                                 labels=["gpu", "UUID", "xid"])
        healthy = text.gauge("gpu_agent_gpu_healthy", "1 when the GPU is healthy.", labels=list(LABELS))
        healths = self.state.health_of(inventory)
        for gpu in inventory.gpus:
            health = healths.get(gpu.uuid)
            healthy.add(self._labels(gpu), int(health.healthy) if health else 1)
            for code, count in health.xid_counts if health else ():
                xid_total.add([str(gpu.index), gpu.uuid, str(code)], count)
        yield from (xid_total, healthy)
        if self.state.sampled_at is not None:
            yield text.gauge("gpu_agent_sample_age_seconds", "Age of the GPU metrics sample /metrics shows.",
                             value=max(0.0, time.time() - self.state.sampled_at))

    def _labels(self, gpu: Gpu) -> list[str]:
        """dcgm-exporter's labels of a whole GPU, in LABELS' order."""
        inventory = self.state.inventory
        driver = inventory.driver_version if inventory else ""
        return [str(gpu.index), gpu.uuid, dcgm_bus_id(gpu.pci_bus_id), f"nvidia{gpu.index}", gpu.product,
                self.hostname, driver]

    def dcgm_inputs(self) -> tuple[object, ...]:
        """Everything dcgm_text() reads of the state; each is replaced whole when it changes, never changed in
        place (state.py), so the same objects give the same text, but for the XID and clock-event windows,
        which move on at the next sample."""
        state = self.state
        return (state.config, state.inventory, state.samples, state.processes, state.pods, state.hpc_jobs,
                state.health, state.xid_log, state.clock_events, state.p2p)

    def dcgm_text(self) -> str:
        """dcgm-exporter's default counters, then the DCGM_EXP_* series asked for, in its text format: one
        block per counter name."""
        inventory = self.state.inventory
        if inventory is None:
            return ""
        view = _View(self.state, self.hostname)
        blocks = []
        for counter in DEFAULT_COUNTERS + (XID_ERRORS,):
            lines = [line for gpu in inventory.gpus for line in self._series(view, counter, gpu)]
            if lines:
                blocks.append(f"# HELP {counter.name} {counter.help}\n# TYPE {counter.name} {counter.kind}\n"
                              + "".join(lines))
        for name in view.settings.exporter_series:
            lines = [line for gpu in inventory.gpus for line in self._exp_series(view, exp.SERIES[name], gpu)]
            if lines:
                blocks.append(f"# HELP {name} {exp.SERIES[name].help}\n# TYPE {name} {exp.KIND}\n" + "".join(lines))
        return "".join(blocks)

    def _series(self, view: _View, counter: Counter, gpu: Gpu) -> Iterator[str]:
        """As dcgm-exporter's default (flex) monitoring: a GPU without GPU instances is one series; a GPU
        with GPU instances is monitored through them only, one series each with GPU_I_PROFILE and GPU_I_ID:
        its own value for what a GPU instance has (framebuffer, GPM), its GPU's for the rest."""
        sample = self.state.samples.get(gpu.uuid)
        if counter is XID_ERRORS:
            value: Optional[float] = self._last_xid(gpu.uuid)
        elif sample is None:
            return
        else:
            value = getattr(sample, counter.field)
        per_process = counter.name if counter.name in PER_PROCESS else None
        instances = sample.mig if sample is not None else ()
        if not instances:
            if value is not None:
                yield from view.expanded(counter.name, view.fixed(gpu), gpu, None, {},
                                         _attributes(counter, value), value, per_process)
            return
        for instance in instances:
            own: Optional[float]
            if counter is XID_ERRORS:
                own = self._last_xid(gpu.uuid, self._devices_of(gpu, instance.gpu_instance_id))
            else:
                own = getattr(instance, counter.field) if counter.per_gpu_instance else value
            if own is not None:
                yield from view.expanded(counter.name, view.fixed(gpu, instance.profile, instance.gpu_instance_id),
                                         gpu, instance.gpu_instance_id, {}, _attributes(counter, own), own,
                                         per_process)

    def _exp_series(self, view: _View, series: exp.ExpSeries, gpu: Gpu) -> Iterator[str]:
        rows = list(self._exp_rows(view, series.name, gpu))
        sample = self.state.samples.get(gpu.uuid)
        instances = sample.mig if sample is not None and series.per_gpu_instance else ()
        entities: list[tuple[list[tuple[str, str]], Optional[int]]] = [
            (view.fixed(gpu, i.profile, i.gpu_instance_id), i.gpu_instance_id) for i in instances]
        if not entities:
            entities.append((view.fixed(gpu), None))
        for fixed, gpu_instance in entities:
            for labels, value in rows:
                yield from view.expanded(series.name, fixed, gpu, gpu_instance, labels, {}, value, None)

    def _exp_rows(self, view: _View, name: str, gpu: Gpu) -> Iterator[tuple[dict[str, str], int]]:
        settings, now = view.settings, time.time()
        if name == exp.XID_COUNT:
            yield from exp.xid_rows(self.state.xid_log.get(gpu.uuid, ()), now, settings.xid_count_window_seconds)
        elif name == exp.CLOCK_EVENTS_COUNT:
            if gpu.uuid in self.state.samples:  # a GPU NVML cannot read has no reasons to count
                yield from exp.clock_event_rows(self.state.clock_events.get(gpu.uuid, ()), now,
                                                settings.clock_events_count_window_seconds)
        elif name == exp.HEALTH_STATUS:
            yield from exp.health_rows(self.state.health.get(gpu.uuid))
        elif name == exp.P2P_STATUS:
            yield from exp.p2p_rows(self.state.p2p.get(gpu.uuid, ()))

    def _last_xid(self, uuid: str, mig_devices: tuple[str, ...] = ()) -> float:
        """The last XID of a GPU, or of a GPU instance's MIG devices when they have one of their own."""
        for device in mig_devices + (uuid,):
            health = self.state.health.get(device)
            if health is not None and health.last_xid:
                return health.last_xid
        return 0

    @staticmethod
    def _devices_of(gpu: Gpu, gpu_instance: int) -> tuple[str, ...]:
        return tuple(device.uuid for device in gpu.mig.devices if device.gpu_instance_id == gpu_instance)

    def _health_transitions(self) -> Family:
        transitions = text.counter("gpu_agent_gpu_health_transitions",
                                   "GPU health changes, by the state the GPU went to.", labels=["gpu", "UUID", "to"])
        inventory = self.state.inventory or self.state.last_inventory
        index = {gpu.uuid: str(gpu.index) for gpu in inventory.gpus} if inventory else {}
        for (uuid, to), count in sorted(self.state.health_transitions.items()):
            transitions.add([index.get(uuid, ""), uuid, to], count)
        return transitions


class AgentRegistry:
    """What /metrics shows: the agent's collector (its own families, then the DCGM series) and the
    process' own resources, whose collector is made at the first render or by prepare()."""

    def __init__(self, collector: AgentCollector) -> None:
        self.collector = collector
        self._own: Optional[OwnProcessCollector] = None

    def prepare(self) -> OwnProcessCollector:
        if self._own is None:
            from gpu_agent.metrics.own_process import OwnProcessCollector  # the daemon's, not every CLI's

            self._own = OwnProcessCollector()
        return self._own

    def families(self) -> Iterator[Family]:
        yield from self.collector.collect()
        yield from self.prepare().collect()


def make_registry(collector: AgentCollector) -> AgentRegistry:
    return AgentRegistry(collector)


def render(registry: AgentRegistry) -> bytes:
    return render_own(registry) + registry.collector.dcgm_text().encode()


def render_own(registry: AgentRegistry) -> bytes:
    """The agent's own families and the process' resources: what /metrics renders every second."""
    return text.render(registry.families()).encode()


class DcgmText:
    """The DCGM series as bytes, rendered again only when one of dcgm_inputs() is another object: once per
    sample (or pods list, health change, reload), not once per second as the rest of /metrics. The inputs are
    held, so none of their ids is reused while they are compared."""

    def __init__(self, collector: AgentCollector) -> None:
        self.collector = collector
        self._inputs: tuple[object, ...] = ()
        self._text = b""
        self.renders = 0

    def get(self) -> bytes:
        inputs = self.collector.dcgm_inputs()
        if self.renders and len(inputs) == len(self._inputs) and all(a is b for a, b in zip(inputs, self._inputs)):
            return self._text
        self._inputs, self._text = inputs, self.collector.dcgm_text().encode()
        self.renders += 1
        return self._text


def content_type() -> str:
    return text.CONTENT_TYPE


def _attributes(counter: Counter, value: float) -> dict[str, str]:
    return dict(zip(XID_LABELS, xid_labels(int(value)))) if counter is XID_ERRORS else {}
