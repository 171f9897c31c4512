"""The one model of what the agent knows. The engine records the stages' outcomes and results in it,
the watchers publish through its publish_* methods, and every output reads it; a stage never writes it.
It imports nothing above it (kube/, plugin/): what is computed from it there is computed there."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Mapping, Optional

from gpu_agent import __version__
from gpu_agent.config import LoadedConfig
from gpu_agent.config.plugin import configured_api
from gpu_agent.health.policy import GPU_CHECKS, NVML_RESPONSIVE, gates_readiness, recovers_at
from gpu_agent.health.policy import meaning as xid_meaning
from gpu_agent.nvml.model import Gpu, GpuHealth, GpuSample, Inventory, MigDevice, UnidentifiedGpu, to_json
from gpu_agent.nvml.session import short_bus_id

PENDING, OK, FAILED, WAITING = "pending", "ok", "failed", "waiting"
_PUBLISH = threading.Lock()  # the watcher threads' updates of the model, one at a time


@dataclass(frozen=True)
class Outcome:
    """A stage's outcome as readiness reads it: recorded in the model, or the one of a pass in progress."""

    state: str
    message: str
    gates_readiness: bool = True


@dataclass
class StageStatus:
    name: str
    state: str = PENDING
    message: str = "not run yet"
    last_error: Optional[str] = None
    last_change: Optional[float] = None  # when the outcome last changed, or the stage last changed the host
    last_run: Optional[float] = None
    duration_seconds: float = 0.0
    failures: int = 0  # consecutive
    backoff_failures: int = 0  # consecutive, on the stage's own backoff (a TransientError has its schedule)
    next_retry: Optional[float] = None
    changes_applied: int = 0
    gates_readiness: bool = True
    facts: dict[str, Any] = field(default_factory=dict)
    last_plan: list[dict[str, Any]] = field(default_factory=list)  # the typed changes the stage last made
    last_plan_at: Optional[float] = None

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.state, self.message, self.gates_readiness)

    def record(self, state: str, message: str, error: Optional[str], now: float) -> None:
        if (state, message) != (self.state, self.message):
            self.last_change = now
        self.state, self.message, self.last_run = state, message, now
        if error is not None:
            self.last_error = error


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: float
    sm_util: Optional[int] = None  # % of the GPU's SMs, NVML's last sample of it (read with metrics.virtual_gpus)
    pod_uid: str = ""  # of the pod whose cgroup it runs in (read with metrics.virtual_gpus)
    gpu_instance_id: Optional[int] = None  # on a MIG GPU: the GPU instance it runs in


@dataclass(frozen=True)
class Verdict:
    """plugin.api both: whether the cluster serves nvidia.com/gpu through DRA, as dra/extended.py read it."""

    device_class: Optional[str]  # the DeviceClass serving nvidia.com/gpu through DRA; None: refused (`refused`)
    refused: Optional[str] = None  # why both does not hold

    def to_json(self) -> dict[str, Any]:
        return {"device_class": self.device_class, "refused": self.refused}


@dataclass(frozen=True)
class ClaimMps:
    """The MPS control daemon a prepared DRA claim asks for: its whole GPUs (UUIDs) and the limits of its
    mpsConfig (the default active thread percentage; each GPU's pinned memory in MiB, 0 for none)."""

    gpus: tuple[str, ...]
    threads: Optional[int] = None
    pinned_mib: Optional[tuple[int, ...]] = None


# The results stages record (their `produces`), each kept in the attribute of that name: inventory
# (discovery), pci_gpus and mellanox_nics (driver), mig (mig), runtimes (toolkit), driver_mismatch
# (driver), driver_upgrade (driver-upgrade), device_path (device-path), cdi_devices (cdi), workload (vfio).
STAGE_OUTPUTS = ("inventory", "pci_gpus", "mellanox_nics", "mig", "runtimes", "driver_mismatch", "driver_upgrade",
                 "device_path", "cdi_devices", "workload")


XID_LOG_LENGTH = 1024  # XIDs kept per GPU for DCGM_EXP_XID_ERRORS_COUNT: a window holds no more that matter


@dataclass
class AgentState:
    config: LoadedConfig
    hardware: str = "real"  # or what the composition root put in its place, e.g. "simulated dgx-h100"
    machine: Optional[str] = None  # the DMI product name, for the gpu.machine label
    started_at: float = field(default_factory=time.time)
    config_loaded_at: float = field(default_factory=time.time)
    config_error: Optional[str] = None  # the last rejected reload
    http_error: Optional[str] = None  # why http.listen is not served now (it is bound again with backoff)
    stages: dict[str, StageStatus] = field(default_factory=dict)
    inventory: Optional[Inventory] = None
    last_inventory: Optional[Inventory] = None  # the last good one: labels outlive a failing discovery
    runtimes: Optional[tuple[str, ...]] = None  # container runtimes found, as the toolkit stage last saw them
    device_path: Optional[Any] = None  # the device-path stage's choice (toolkit.devicepath.DevicePath)
    cdi_devices: Optional[frozenset[str]] = None  # the device names of the CDI spec the cdi stage wrote
    pci_gpus: Optional[int] = None  # NVIDIA GPUs on the PCI bus, as the driver stage last saw them
    mellanox_nics: Optional[int] = None  # Mellanox NICs on the PCI bus, as the driver stage last saw them
    driver_mismatch: Optional[str] = None  # "loaded X, installed Y" (driver stage)
    driver_upgrade: Optional[str] = None  # the GPU Operator's upgrade state of this node (driver-upgrade stage)
    mig: Optional[Any] = None  # the mig stage's last result (stages.mig.MigResult)
    workload: Optional[Any] = None  # the vfio stage's last result (stages.vfio.WorkloadResult): GPUs and their modes
    health: dict[str, GpuHealth] = field(default_factory=dict)  # by GPU or MIG device UUID: see device_health()
    gpu_checks: dict[str, dict[str, str]] = field(default_factory=dict)  # periodic check -> {GPU UUID: why it fails}
    nvml_check: Optional[str] = None  # why NVML failed the last periodic check (hung), or None
    checked_at: Optional[float] = None  # when the periodic checks last ran
    health_transitions: dict[tuple[str, str], int] = field(default_factory=dict)  # by (GPU UUID, "healthy"/"unhealthy")
    samples: dict[str, GpuSample] = field(default_factory=dict)  # by GPU UUID
    sampled_at: Optional[float] = None  # when `samples` were taken (unix time)
    processes: dict[str, tuple[GpuProcess, ...]] = field(default_factory=dict)  # by GPU UUID
    pods: Optional[Any] = None  # who holds each GPU (metrics.pods.PodAttribution); None: metrics.pod_labels off
    hpc_jobs: Optional[Any] = None  # the jobs on each GPU (metrics.hpc.HpcJobs); None: no hpc_job_mapping_dir
    # For dcgm-exporter's own series, by GPU UUID: (when, XID), newest last; (when, clock event reasons) of the
    # samples in the window; (peer GPU index, NVML's NVLink P2P status).
    xid_log: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    clock_events: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    p2p: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    nvml_error: Optional[str] = None  # NVML hung or failing for the health watchers
    runtime_restarts: dict[str, int] = field(default_factory=dict)  # by container runtime
    claims: dict[str, set[str]] = field(default_factory=dict)  # by stage: the files it wants (engine only)
    plugin: Optional[dict[str, Any]] = None  # the device plugin's /status section, replaced whole by its service
    mps: Optional[dict[str, Any]] = None  # the MPS control daemons' /status section (mps/daemons.py)
    dra: Optional[dict[str, Any]] = None  # the DRA kubelet plugin's /status section (dra/service.py)
    serving_api: Optional[str] = None  # the plugin.api this node serves now; None: the configured one, at start
    api_switch: Optional[str] = None  # why a change of plugin.api waits (pods hold GPUs of the API serving now)
    both: Optional[Verdict] = None  # plugin.api both: whether the cluster serves nvidia.com/gpu through DRA (dra/)
    mps_down: dict[str, str] = field(default_factory=dict)  # by MPS resource: why its daemon does not run as asked
    mps_running: frozenset[str] = frozenset()  # the MPS resources whose daemon runs as asked: healthy only then
    claim_mps: dict[str, ClaimMps] = field(default_factory=dict)  # by MPS resource: the prepared claims' (dra/)
    kube_api: Optional[dict[str, Any]] = None  # the Kubernetes API's /status section (kube/api_state.py)
    reconciles: int = 0
    first_reconcile_done: bool = False
    published: int = 0  # bumped each time the daemon publishes the model: the endpoints render again

    @property
    def version(self) -> Optional[int]:
        """What the endpoints cache their renderings by; None (do not cache) before the first reconcile."""
        return self.published if self.first_reconcile_done else None

    # --- what the watchers publish: each through its own method, each dict replaced, never changed in
    # place, so that a reader on another thread sees the old one or the new one ------------------------

    def update_health(self, uuid: str, change: Callable[[GpuHealth], GpuHealth]) -> GpuHealth:
        """Publish a GPU's new health (the XID watcher, the sampler, the periodic checks, a reset)."""
        with _PUBLISH:
            old = self.health.get(uuid, GpuHealth())
            new = change(old)
            if new.healthy != old.healthy:
                key = (uuid, "healthy" if new.healthy else "unhealthy")
                self.health_transitions = {**self.health_transitions, key: self.health_transitions.get(key, 0) + 1}
            self.health = {**self.health, uuid: new}
            return new

    def publish_samples(self, samples: Mapping[str, GpuSample], processes: Mapping[str, tuple[GpuProcess, ...]],
                        at: float) -> None:
        """The sampler's readings of every GPU, taken at `at` (unix time): NVML answered them."""
        with _PUBLISH:
            self.samples, self.processes = dict(samples), dict(processes)
            self.sampled_at, self.nvml_error = at, None

    def note_xid(self, uuid: str, xid: int, at: float) -> None:
        """An XID of the GPU `uuid` (a MIG device's: its GPU's), for DCGM_EXP_XID_ERRORS_COUNT's window."""
        with _PUBLISH:
            kept = self.xid_log.get(uuid, ())[-(XID_LOG_LENGTH - 1):]
            self.xid_log = {**self.xid_log, uuid: (*kept, (at, xid))}

    def publish_exporter_readings(self, clock_events: Mapping[str, tuple[tuple[float, int], ...]],
                                  p2p: Mapping[str, tuple[tuple[int, int], ...]], hpc_jobs: Optional[Any]) -> None:
        """What the sampler read for dcgm-exporter's own series and the hpc_job label."""
        with _PUBLISH:
            self.clock_events, self.p2p, self.hpc_jobs = dict(clock_events), dict(p2p), hpc_jobs

    def publish_nvml_error(self, error: str) -> None:
        """The sampler found NVML hung or failing: the samples stay as last read."""
        with _PUBLISH:
            self.nvml_error = error

    def publish_checks(self, failing: Mapping[str, Mapping[str, str]], at: float) -> None:
        """A round of the periodic checks, run at `at`: by check, the GPUs that fail it and why."""
        with _PUBLISH:
            self.gpu_checks = {name: dict(gpus) for name, gpus in failing.items()}
            self.nvml_check, self.checked_at = None, at

    def publish_nvml_hung(self, reason: str, at: float) -> None:
        """NVML did not answer a round of the periodic checks in time; the GPU checks keep their last results."""
        with _PUBLISH:
            self.nvml_check, self.checked_at = reason, at

    def publish_plugin(self, section: dict[str, Any]) -> bool:
        """The device plugin's /status section, replaced whole; False (and nothing to render again) when
        it is the one already published."""
        with _PUBLISH:
            if section == self.plugin:
                return False
            self.plugin = section
            self.published += 1  # the endpoints render /status again
            return True

    def serving(self) -> str:
        """The plugin.api this node serves its GPUs through now (a configured change may wait: api_switch)."""
        return self.serving_api or self.wanted_api()

    def wanted_api(self) -> str:
        """plugin.api as configured, but `both` where the cluster is known not to serve nvidia.com/gpu through
        DRA (dra/extended.py): device-plugin then."""
        config = self.config.config
        configured = configured_api(config.plugin, config.dra)
        if configured == "both" and self.both is not None and self.both.device_class is None:
            return "device-plugin"
        return configured

    def publish_dra(self, section: dict[str, Any]) -> bool:
        """The DRA plugin's /status section, replaced whole; False when it is the one already published."""
        with _PUBLISH:
            if section == self.dra:
                return False
            self.dra = section
            self.published += 1
            return True

    def publish_mps(self, section: Optional[dict[str, Any]], down: Mapping[str, str],
                    running: Collection[str] = ()) -> bool:
        """The MPS control daemons' /status section, by resource why its daemon does not run as asked, and
        the resources whose daemon does (their devices are Healthy only then); False when all are as
        published."""
        with _PUBLISH:
            if section == self.mps and dict(down) == self.mps_down and frozenset(running) == self.mps_running:
                return False
            self.mps, self.mps_down, self.mps_running = section, dict(down), frozenset(running)
            self.published += 1
            return True

    def publish_claim_mps(self, daemons: Mapping[str, ClaimMps]) -> bool:
        """The MPS control daemons the prepared DRA claims ask for, by resource, replaced whole (the DRA
        plugin's service is their one writer); False when they are those already published."""
        with _PUBLISH:
            if dict(daemons) == self.claim_mps:
                return False
            self.claim_mps = dict(daemons)
            self.published += 1
            return True

    def publish_kube_api(self, section: Optional[dict[str, Any]]) -> None:
        """How the node's Kubernetes API requests go (kube/api_state.py), replaced whole at each change."""
        with _PUBLISH:
            if section != self.kube_api:
                self.kube_api = section
                self.published += 1

    def publish_pods(self, pods: Optional[Any]) -> None:
        """Who holds each GPU (metrics.pods.PodAttribution), or None while pod labels are off."""
        with _PUBLISH:
            self.pods = pods

    def gpu_name(self, uuid: str) -> str:
        """`GPU 3 (GPU-...)` or `GPU 3 MIG device 3g.40gb (GI 1, CI 0, MIG-...)` for a log line, or the
        UUID alone for a device not in the inventory."""
        inventory = self.inventory or self.last_inventory
        for gpu in inventory.gpus if inventory else ():
            if gpu.uuid == uuid:
                return f"GPU {gpu.index} ({uuid})"
            device = next((d for d in gpu.mig.devices if d.uuid == uuid), None)
            if device is not None:
                return _mig_name(gpu, device)
        return f"GPU {uuid}"

    def health_of(self, inventory: Optional[Inventory]) -> Mapping[str, GpuHealth]:
        """By GPU or MIG device UUID, the watchers' health with discovery's word on each GPU of `inventory` that
        NVML could not read: unhealthy for that (as query_error) until a watcher has found its own reason."""
        health = self.health
        unread = [gpu for gpu in inventory.gpus if gpu.unreadable] if inventory else []
        if not unread:
            return health
        merged = dict(health)
        for gpu in unread:
            own = merged.get(gpu.uuid, GpuHealth())
            if not own.query_error:
                merged[gpu.uuid] = replace(own, query_error=f"NVML cannot read it: {gpu.unreadable}")
        return merged

    def device_health(self, uuid: str) -> GpuHealth:
        """The health of a GPU or of a MIG device, by UUID, as the device plugin should read it: a MIG
        device is unhealthy when it is (an XID attributed to its GPU instance) or when its GPU is."""
        inventory = self.inventory or self.last_inventory
        health = self.health_of(inventory)
        own = health.get(uuid, GpuHealth())
        parent = next((gpu.uuid for gpu in inventory.gpus if any(d.uuid == uuid for d in gpu.mig.devices)),
                      None) if inventory else None
        whole = health.get(parent, GpuHealth()) if parent else GpuHealth()
        return own if not own.healthy or whole.healthy else whole

    # --- stage results (written by the engine only) ----------------------------------------------

    def output(self, name: str) -> Any:
        """A stage result as last recorded (STAGE_OUTPUTS), or last_inventory: the last inventory that
        was not None."""
        if name != "last_inventory" and name not in STAGE_OUTPUTS:
            raise KeyError(name)
        return getattr(self, name)

    def record_runtime_restarts(self, restarts: Mapping[str, int]) -> None:
        """Add a pass's restarts of the container runtimes, by runtime, to the counts."""
        if restarts:
            counts = dict(self.runtime_restarts)
            for runtime, count in restarts.items():
                counts[runtime] = counts.get(runtime, 0) + count
            self.runtime_restarts = counts

    def record_output(self, name: str, value: Any) -> None:
        if name not in STAGE_OUTPUTS:
            raise ValueError(f"no stage result called {name!r}")
        setattr(self, name, value)
        if name == "inventory" and value is not None:
            self.last_inventory = value

    # --- readiness -----------------------------------------------------------------------------

    def checks(self) -> list[Check]:
        return self._checks(self._recorded(), self.inventory)

    def _recorded(self) -> dict[str, Outcome]:
        return {name: status.outcome for name, status in self.stages.items()}

    def _checks(self, outcomes: Mapping[str, Outcome], inventory: Optional[Inventory]) -> list[Check]:
        """The stages' outcomes, then the GPUs' health as the watchers last published it (one reading)."""
        health = self.health_of(inventory)
        checks = [Check(name, outcome.state == OK, outcome.message) for name, outcome in outcomes.items()]
        checks.append(self._gpu_health_check(inventory, health))
        if self.checked_at is not None:  # the periodic checks, once they have run
            nvml_check, gpu_checks = self.nvml_check, self.gpu_checks
            total = inventory.count if inventory else 0
            checks.append(Check(NVML_RESPONSIVE, nvml_check is None, nvml_check or "NVML answers within its timeout"))
            checks += [self._periodic_check(name, gpu_checks.get(name, {}), total) for name in GPU_CHECKS]
        return checks

    def _gpu_health_check(self, inventory: Optional[Inventory], health: Mapping[str, GpuHealth]) -> Check:
        if self.nvml_error:
            return Check("gpu-health", False, self.nvml_error)
        if inventory is None:
            # Discovery fails (NVML does not answer at all): name the sick GPUs it last found, if any.
            sick, _ = _sick(self.last_inventory, health)
            return Check("gpu-health", False, "; ".join(sick) or "no GPU discovered")
        sick, failing = _sick(inventory, health)
        return self._gated("gpu-health", failing, inventory.count, "; ".join(sick), f"{inventory.count} GPUs healthy")

    def _periodic_check(self, name: str, failing: dict[str, str], total: int) -> Check:
        why = "; ".join(f"{self.gpu_name(uuid)}: {reason}" for uuid, reason in failing.items())
        return self._gated(name, len(failing), total, why, f"{total} GPUs pass")

    def _gated(self, name: str, failing: int, total: int, why: str, fine: str) -> Check:
        """A GPU check as health.unready_when has it: with `all`, some GPUs failing is shown, not fatal."""
        if not failing:
            return Check(name, True, fine)
        if gates_readiness(failing, total, self.config.config.health):
            return Check(name, False, why)
        return Check(name, True, f"{failing} of {total} GPUs failing, not all (health.unready_when: all): {why}")

    def readiness(self, one_shot: bool = False) -> tuple[bool, Optional[Check]]:
        """(ready, the first failing check that gates readiness) as recorded: one consistent reading, as
        watcher threads may change health between two calls of checks(). `one_shot`: for a command that
        ran its one pass to the end (`gpu-agent labels`), where no first reconcile of a daemon is awaited."""
        return self._readiness(self._recorded(), self.inventory, one_shot or self.first_reconcile_done)

    def readiness_of(self, outcomes: Mapping[str, Outcome],
                     inventory: Optional[Inventory]) -> tuple[bool, Optional[Check]]:
        """Readiness as a pass in progress computes it, for what it publishes (the labels stage): from its
        own outcomes and inventory, with the GPUs' health as the watchers last published it."""
        return self._readiness(outcomes, inventory, True)

    def _readiness(self, outcomes: Mapping[str, Outcome], inventory: Optional[Inventory],
                   started: bool) -> tuple[bool, Optional[Check]]:
        sinks = {name for name, outcome in outcomes.items() if not outcome.gates_readiness}
        failing = next((check for check in self._checks(outcomes, inventory) if not check.ok
                        and check.name not in sinks), None)
        return started and failing is None, failing

    @property
    def ready(self) -> bool:
        return self.readiness()[0]

    @property
    def degraded(self) -> bool:
        """Ready or not, something is wrong that is not about the GPUs: a rejected reload, a failing sink."""
        sinks_failing = any(s.state == FAILED for s in self.stages.values() if not s.gates_readiness)
        return self.config_error is not None or sinks_failing

    def summary_line(self) -> str:
        """One line for `systemctl status` (sd_notify STATUS=) and `gpu-agent status`."""
        if not self.first_reconcile_done:
            return "starting: first reconcile in progress"
        ready, failing = self.readiness()
        if ready or failing is None:
            inventory = self.inventory
            line = f"ready: {inventory.summary()}" if inventory else "ready"
            if self.config_error is not None:
                line += " (config reload rejected, see /status)"
            sink = next((s for s in self.stages.values() if not s.gates_readiness and s.state == FAILED), None)
            return line + (f" (degraded: {sink.name}: {sink.message})" if sink else "")
        return f"not ready: {failing.name}: {failing.reason}"

    # --- /status ---------------------------------------------------------------------------------

    def to_json(self, labels: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        """/status; `labels`: the node labels this state gives (kube.labels.node_labels), computed by the caller."""
        inventory = self.inventory
        return {
            "version": __version__,
            "ready": self.ready,
            "degraded": self.degraded,
            "summary": self.summary_line(),
            "hardware": self.hardware,
            "started_at": self.started_at,
            "reconciles": self.reconciles,
            "config": {
                "source": self.config.source,
                "digest": self.config.digest,
                "loaded_at": self.config_loaded_at,
                "reload_error": self.config_error,
            },
            "http": {"listen": self.config.config.http.listen, "socket": self.config.config.http.socket,
                     "error": self.http_error},
            "driver": self._driver_json(),
            "pod_labels": self.pods.to_json() if self.pods is not None else None,
            "hpc_jobs": self.hpc_jobs.to_json() if self.hpc_jobs is not None else None,
            "stages": [to_json(stage) for stage in self.stages.values()],
            "runtime_restarts": dict(self.runtime_restarts),
            "checks": [to_json(check) for check in self.checks()],
            "gpus": self._gpus_json(inventory),
            "labels": dict(labels) if labels is not None else None,
            "plugin": self.plugin,
            "mps": self.mps,
            "dra": self.dra,
            "api": {"configured": configured_api(self.config.config.plugin, self.config.config.dra),
                    "serving": self.serving(), "switch": self.api_switch,
                    "both": self.both.to_json() if self.both is not None else None},
            "kubernetes_api": self.kube_api,
            "device_path": self.device_path.to_json() if self.device_path is not None else None,
        }

    def _driver_json(self) -> Optional[dict[str, Any]]:
        """What NVML says of the driver, and what the driver stage saw of its kernel module."""
        inventory = self.inventory
        stage = self.stages.get("driver")
        facts = stage.facts if stage is not None else {}
        if inventory is None and not facts:
            return None
        versions = {"version": inventory.driver_version, "cuda_version": inventory.cuda_version} if inventory else {}
        return {**versions, **{key: value for key, value in facts.items() if key != "module_version"}}

    def _links_json(self, index: int) -> dict[str, str]:
        """How this GPU reaches each other one, by index, as `nvidia-smi topo -m` writes it (NV18, PIX, SYS)."""
        links = self.inventory.links if self.inventory else ()
        return {str(link.b if link.a == index else link.a): link.kind for link in links if index in (link.a, link.b)}

    def _gpus_json(self, inventory: Optional[Inventory]) -> list[dict[str, Any]]:
        """Every GPU NVML counts, by index: those it cannot read too, as far as they are known; then those the
        vfio stage passed through to VMs (outside NVML), by PCI address. Each with its workload mode and the
        driver its PCI function is bound to."""
        workload = {gpu.address: gpu for gpu in self.workload.gpus} if self.workload is not None else {}
        found: list[tuple[int, dict[str, Any]]] = []
        if inventory is not None:
            health = self.health_of(inventory)
            for gpu in inventory.gpus:
                seen = workload.pop(short_bus_id(gpu.pci_bus_id), None)
                found.append((gpu.index, {**self._gpu_json(gpu, health), **_binding_json(seen, "nvidia")}))
            found += [(unnamed.index, {**_unidentified_json(unnamed), **_binding_json(None, None)})
                      for unnamed in inventory.unidentified]
        ordered = [doc for _, doc in sorted(found, key=lambda pair: pair[0])]
        return ordered + [_outside_nvml_json(gpu) for _, gpu in sorted(workload.items())]

    def _gpu_json(self, gpu: Gpu, healths: Mapping[str, GpuHealth]) -> dict[str, Any]:
        health = healths.get(gpu.uuid, GpuHealth())
        settings = self.config.config.health
        known = gpu.details_known
        return {
            "index": gpu.index,
            "uuid": gpu.uuid,
            "pci_bus_id": gpu.pci_bus_id,
            "product": gpu.product,
            "unreadable": gpu.unreadable or None,  # why NVML cannot read it now: the rest is what is known of it
            "known_from": gpu.known_from,  # nvml (read now), "last reading", "identity only" (no MIG, memory)
            "memory_mib": gpu.memory_mib if known else None,
            "compute_capability": "{}.{}".format(*gpu.compute_capability) if known else None,
            "numa_node": gpu.numa_node,
            "links": self._links_json(gpu.index),
            "health": "healthy" if health.healthy else "unhealthy",
            "health_reason": health.reason or None,
            "last_xid": None if health.last_xid is None else {"xid": health.last_xid,
                                                              "meaning": xid_meaning(health.last_xid)},
            "recovers_at": recovers_at(health, settings),
            "lost": health.lost,  # off the bus: recovers only once NVML answers for it again at pci_bus_id
            "query_error": health.query_error or None,  # NVML fails for it: healthy once it answers again
            "failing_checks": health.check_reason or None,  # periodic checks: healthy once they pass
            "xid_counts": {str(xid): count for xid, count in health.xid_counts},
            "mig": None if not known else {
                "capable": gpu.mig.capable,
                "mode": "enabled" if gpu.mig.enabled else "disabled",
                "pending_mode": "enabled" if gpu.mig.pending_enabled else "disabled",
                "instances": [{**to_json(device), **self._device_health_json(device.uuid)}
                              for device in gpu.mig.devices],
                "gpu_instances": [to_json(instance) for instance in gpu.mig.gpu_instances],
                "profiles": [to_json(profile) for profile in gpu.mig.profiles],
            },
            "processes": [to_json(process) for process in self.processes.get(gpu.uuid, ())],
            "metrics": to_json(self.samples[gpu.uuid]) if gpu.uuid in self.samples else None,
        }

    def _device_health_json(self, uuid: str) -> dict[str, Any]:
        """A MIG device's own health (XIDs attributed to its GPU instance); its GPU's is the GPU's."""
        health = self.health.get(uuid, GpuHealth())
        return {
            "health": "healthy" if health.healthy else "unhealthy",
            "health_reason": health.reason or None,
            "last_xid": None if health.last_xid is None else {"xid": health.last_xid,
                                                              "meaning": xid_meaning(health.last_xid)},
            "recovers_at": recovers_at(health, self.config.config.health),
        }


def _unidentified_json(unnamed: UnidentifiedGpu) -> dict[str, Any]:
    """/status of a GPU NVML counts and cannot read, which nothing else names: its index and why."""
    reason = f"NVML cannot read it: {unnamed.reason}"
    return {"index": unnamed.index, "uuid": None, "pci_bus_id": None, "product": None, "unreadable": unnamed.reason,
            "known_from": None, "memory_mib": None, "compute_capability": None, "numa_node": None, "links": {},
            "health": "unhealthy", "health_reason": reason, "last_xid": None, "recovers_at": None, "lost": False,
            "query_error": reason, "failing_checks": None, "xid_counts": {}, "mig": None, "processes": [],
            "metrics": None}


def _binding_json(gpu: Optional[Any], in_nvml: Optional[str]) -> dict[str, Any]:
    """A GPU's workload mode (container | vm-passthrough) and its PCI function's binding, from the vfio stage's
    result (stages.vfio.GpuWorkload) where it ran; without it, every GPU serves containers, and one NVML reads
    is bound to nvidia (`in_nvml`)."""
    if gpu is None:
        return {"mode": "container", "binding": {"driver": in_nvml, "iommu_group": None, "step": None,
                                                 "reason": None}}
    return {"mode": gpu.mode, "binding": {"driver": gpu.driver, "iommu_group": gpu.group, "step": gpu.step,
                                          "reason": gpu.reason or None}}


def _outside_nvml_json(gpu: Any) -> dict[str, Any]:
    """/status of a GPU NVML does not see because it is bound to vfio-pci (or on its way): what the vfio stage
    knows of it. `index` is None (NVML gives it none); `pci_index` is its place among the NVIDIA GPUs."""
    return {"index": None, "pci_index": gpu.index, "uuid": gpu.uuid, "pci_bus_id": gpu.address, "product": None,
            "unreadable": None, "known_from": "vfio", "memory_mib": None, "compute_capability": None,
            "numa_node": gpu.numa_node, "links": {}, "health": "n/a", "health_reason": None, "last_xid": None,
            "recovers_at": None, "lost": False, "query_error": None, "failing_checks": None, "xid_counts": {},
            "mig": None, "processes": [], "metrics": None, **_binding_json(gpu, None)}


def _sick(inventory: Optional[Inventory], health: Mapping[str, GpuHealth]) -> tuple[list[str], int]:
    """What is unhealthy among the inventory's GPUs (those NVML cannot name among them) and MIG devices, by
    GPU index, and how many GPUs that touches."""
    found: list[tuple[int, list[str]]] = [
        (unnamed.index, [f"GPU {unnamed.index}: NVML cannot read it: {unnamed.reason}"])
        for unnamed in (inventory.unidentified if inventory else ())]
    for gpu in inventory.gpus if inventory else ():
        own = health.get(gpu.uuid)
        reasons = [f"GPU {gpu.index} ({gpu.uuid}): {own.reason}"] if own and not own.healthy else []
        reasons += [f"{_mig_name(gpu, device)}: {health[device.uuid].reason}" for device in gpu.mig.devices
                    if device.uuid in health and not health[device.uuid].healthy]
        if reasons:
            found.append((gpu.index, reasons))
    found.sort(key=lambda pair: pair[0])
    return [reason for _, reasons in found for reason in reasons], len(found)


def _mig_name(gpu: Gpu, device: MigDevice) -> str:
    return (f"GPU {gpu.index} MIG device {device.profile} (GI {device.gpu_instance_id}, "
            f"CI {device.compute_instance_id}, {device.uuid})")
