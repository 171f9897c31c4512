"""Driver reload after a package upgrade: the installed driver (libraries, module on disk) is newer than
the loaded module, so NVML fails with "Driver/library version mismatch" until the module is reloaded.

The sequence and its node label follow the GPU Operator's upgrade controller (NVIDIA/k8s-operator-libs
pkg/upgrade/consts.go and common_manager.go, commit 11e747a5): upgrade-required, cordon-required,
wait-for-jobs-required, pod-deletion-required, drain-required, pod-restart-required,
validation-required, uncordon-required, upgrade-done, or upgrade-failed. The agent deletes and drains
no pods (the Operator's pod deletion and drain off: those states are passed through, and recorded, but
not published as labels of their own); the pod restart is the reload itself. Each step is recorded in
the ledger before it is taken, so an agent killed midway finds where it was and goes on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from gpu_agent.config.driver import DriverConfig
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import processes
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.modules import KernelModules, ModuleLoader, ModuleUnloader, ModuleUnloadError
from gpu_agent.host.paths import Root
from gpu_agent.mig.hooks import UnitControl
from gpu_agent.nvml.client import Nvml
from gpu_agent.plan import DriverReloadStep
from gpu_agent.plugin.gate import PluginGate
from gpu_agent.stages.base import OUTCOMES, Action, Stage

log = logging.getLogger(__name__)

STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
SKIP_LABEL = "nvidia.com/gpu-driver-upgrade.skip"  # k8s-operator-libs: "true" skips the node
ENABLED_KEY = "nvidia.com/gpu-driver-upgrade-enabled"  # label or annotation: "false" turns it off here
UPGRADE_REQUIRED = "upgrade-required"
CORDON_REQUIRED = "cordon-required"
WAIT_FOR_JOBS = "wait-for-jobs-required"
POD_DELETION = "pod-deletion-required"
DRAIN = "drain-required"
POD_RESTART = "pod-restart-required"
VALIDATION = "validation-required"
UNCORDON = "uncordon-required"
DONE = "upgrade-done"
FAILED = "upgrade-failed"
ORDER = (UPGRADE_REQUIRED, CORDON_REQUIRED, WAIT_FOR_JOBS, POD_DELETION, DRAIN, POD_RESTART, VALIDATION,
         UNCORDON, DONE)
QUIET = (POD_DELETION, DRAIN)  # passed through within one step: not published as labels of their own
UNLOAD_ORDER = ("nvidia_drm", "nvidia_peermem", "nvidia_fs", "gdrdrv", "nvidia_modeset", "nvidia_uvm", "nvidia")
VALIDATED = ("mig", "discovery", "cdi")  # stages whose outcome after the reload must be ok
POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"


class NodeAccess(Protocol):
    """This node's Node object, through the agent's own credentials (stages/labels.py KubeSink)."""

    def node_metadata(self, fresh: bool = True) -> tuple[dict[str, str], dict[str, str], bool]:
        """(labels, annotations, spec.unschedulable), read now or (not `fresh`) as last read."""

    def patch_node(self, unschedulable: Optional[bool], labels: dict[str, str]) -> None:
        """One merge patch of spec.unschedulable (None: left alone) and labels; StageError on failure
        (its status in the message)."""


@dataclass
class Progress:
    """The ledger's driver_reload entry."""

    step: str
    target: str  # the installed version being loaded
    loaded: str  # the version loaded when the sequence began
    started: float = field(default_factory=time.time)
    modules: list[str] = field(default_factory=list)  # the NVIDIA modules loaded then, loaded again after
    cordoned: bool = False  # the agent cordoned the node (so it uncordons it)
    notes: list[str] = field(default_factory=list)
    stopped_units: list[str] = field(default_factory=list)
    waiting_since: Optional[float] = None
    failed_step: Optional[str] = None
    failure: Optional[str] = None
    forced: bool = False
    plugin_stopped: bool = False  # the device plugin is held off until the reload is validated

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        known = {key: data[key] for key in cls.__dataclass_fields__ if key in data}
        progress = cls(**known)
        if progress.step not in (*ORDER, FAILED):
            raise AgentError(f"ledger driver_reload.step {progress.step!r} is no upgrade state")
        return progress


class Reload:
    """The sequence, shared by the driver stage (through pod-restart-required) and the driver-upgrade
    stage (validation to upgrade-done, once this pass's MIG, discovery and CDI stages ran)."""

    def __init__(self, root: Root, nvml: Nvml, loader: ModuleLoader, unloader: Optional[ModuleUnloader],
                 units: Optional[UnitControl], unit_active: Callable[[str], bool], settings: DriverConfig,
                 node: Optional[NodeAccess] = None, gate: Optional[PluginGate] = None) -> None:
        self.root = root
        self.nvml = nvml
        self.loader = loader
        self.unloader = unloader
        self.units = units
        self.unit_active = unit_active
        self.settings = settings
        self.node = node
        self.gate = gate
        self.ledger = Ledger(root)
        self.kernel = KernelModules(root)
        self.force = False  # `gpu-agent driver reload --force`: unload while GPU processes run
        self.requested = False  # `gpu-agent driver reload`: whatever driver.reload says
        self.wait_seconds = settings.reload_wait_seconds
        try:
            self.progress()  # the plugin held off from a new process's first pass, as the record says
        except AgentError:
            pass  # the driver stage reports the ledger

    # --- the record ------------------------------------------------------------------------------

    def progress(self) -> Optional[Progress]:
        """The record; the plugin gate follows it (closed while it says the plugin is stopped)."""
        entry = self.ledger.driver_reload()
        progress = Progress.from_json(entry) if entry is not None else None
        if self.gate is not None:
            if progress is not None and progress.plugin_stopped:
                self.gate.close(f"driver reload to {progress.target} in progress")
            else:
                self.gate.open()
        return progress

    def _enter(self, progress: Progress, step: str, patch_unschedulable: Optional[bool] = None) -> None:
        """Record `step` before taking it; publish it as the node's label (one patch with the cordon)."""
        progress.step = step
        self.ledger.save_driver_reload(asdict(progress))
        log.info("driver reload: %s", step)
        if self.node is None or (step in QUIET and patch_unschedulable is None):
            return
        try:
            self.node.patch_node(patch_unschedulable, {STATE_LABEL: step})
        except AgentError as exc:
            if patch_unschedulable is not None:
                raise
            log.warning("driver reload: could not label the node %s: %s", step, exc)

    def fail(self, progress: Progress, step: str, reason: str) -> StageError:
        progress.failed_step, progress.failure = step, reason
        self._enter(progress, FAILED)
        cordon = "the node stays cordoned; " if progress.cordoned else ""
        return StageError(f"driver reload to {progress.target} failed at {step}: {reason} ({cordon}"
                          "tried again with backoff)")

    # --- what it would do ------------------------------------------------------------------------

    def planned(self, loaded: str, target: str) -> list[DriverReloadStep]:
        units = ", ".join(self.settings.reload_units) or "none configured"
        return [
            DriverReloadStep(CORDON_REQUIRED, "cordon the node (spec.unschedulable) with its own credentials"),
            DriverReloadStep(WAIT_FOR_JOBS, f"wait up to {self.wait_seconds:g} s until no pod holds a GPU "
                                            "(kubelet pod-resources) and no process has one open (/proc)"),
            DriverReloadStep(POD_RESTART, f"stop the running units of driver.reload_units ({units}) and the "
                                          "device plugin; let NVML go"),
            DriverReloadStep(POD_RESTART, f"unload the {loaded} modules in dependency order (rmmod)"),
            DriverReloadStep(POD_RESTART, f"load the installed {target} modules (modprobe) and verify the "
                                          "version, NVML and the GPUs"),
            DriverReloadStep(POD_RESTART, "start the stopped units again"),
            DriverReloadStep(VALIDATION, "MIG geometry re-applied, GPUs discovered, CDI spec regenerated; "
                                         "device plugin serving again"),
            DriverReloadStep(UNCORDON, "uncordon the node if the agent cordoned it"),
        ]

    def skipped(self) -> Optional[str]:
        """Why this node's Node says not to reload (the Operator's skip label, or upgrade-enabled=false)."""
        if self.node is None:
            return None
        try:
            labels, annotations, _ = self.node.node_metadata(fresh=False)
        except AgentError:
            return None
        if labels.get(SKIP_LABEL) == "true":
            return f"the node's label {SKIP_LABEL}=true"
        for where, values in (("label", labels), ("annotation", annotations)):
            if values.get(ENABLED_KEY) == "false":
                return f"the node's {where} {ENABLED_KEY}=false"
        return None

    # --- driver stage: up to the loaded new driver -----------------------------------------------

    def run(self, loaded: str, target: str, loaded_modules: Sequence[str]) -> None:
        progress = self.progress()
        if progress is None or progress.step in (DONE,) or progress.target != target:
            modules = [m for m in UNLOAD_ORDER[::-1] if m in loaded_modules]
            progress = Progress(UPGRADE_REQUIRED, target, loaded, modules=modules, forced=self.force)
            self._enter(progress, CORDON_REQUIRED)
        elif progress.step == FAILED:
            log.info("driver reload: trying %s again after: %s", progress.failed_step, progress.failure)
            progress.step, progress.failure = progress.failed_step or CORDON_REQUIRED, None
            progress.forced = False  # each attempt is forced or not by its own request
            if progress.step == WAIT_FOR_JOBS:
                progress.waiting_since = None
            self._enter(progress, progress.step)  # VALIDATION, UNCORDON: the driver-upgrade stage's to retry
        progress.forced = progress.forced or self.force
        if progress.step == CORDON_REQUIRED:
            self._cordon(progress)
        if progress.step == WAIT_FOR_JOBS:
            self._wait(progress)
            self._enter(progress, POD_DELETION)  # the agent deletes no pods
        if progress.step == POD_DELETION:
            self._enter(progress, DRAIN)  # nor drains them: what runs on the node was waited for
        if progress.step == DRAIN:
            self._enter(progress, POD_RESTART)
        if progress.step == POD_RESTART:
            self._restart(progress)

    def _cordon(self, progress: Progress) -> None:
        if self.node is None:
            progress.notes.append("not cordoned: the Kubernetes API is off")
            self._enter(progress, WAIT_FOR_JOBS)
            return
        try:
            _, _, unschedulable = self.node.node_metadata()
        except AgentError as exc:
            raise self.fail(progress, CORDON_REQUIRED, f"cannot read the node: {exc}") from None
        if unschedulable:  # cordoned by someone else: theirs to uncordon (the Operator's initial-state rule)
            progress.notes.append("the node was already cordoned: it is left cordoned")
            self._enter(progress, WAIT_FOR_JOBS)
            return
        progress.cordoned = True  # recorded before the patch: an agent killed after it still uncordons
        try:
            self._enter(progress, WAIT_FOR_JOBS, patch_unschedulable=True)
        except AgentError as exc:
            progress.cordoned = False
            if "403" in str(exc) or "Forbidden" in str(exc):
                progress.notes.append(f"not cordoned: the node's credentials may not ({exc}); going on with "
                                      "the label and condition")
                self._enter(progress, WAIT_FOR_JOBS)
                return
            raise self.fail(progress, CORDON_REQUIRED, f"cannot cordon the node: {exc}") from None

    def consumers(self) -> list[str]:
        """What uses a GPU now: pods with NVIDIA devices (the kubelet's pod-resources), processes with an
        NVIDIA device file open."""
        users = [f"process {p.describe()}" for p in processes.device_users(self.root)]
        return users + [f"pod {pod}" for pod in self._gpu_pods()]

    def _gpu_pods(self) -> list[str]:
        socket = self.root(POD_RESOURCES)
        if not socket.exists():
            return []
        from gpu_agent.metrics.pods import list_pod_resources

        try:
            response = asyncio.run(list_pod_resources(socket, 5.0))
        except Exception as exc:  # grpclib's and the socket's errors: the kubelet did not answer
            raise StageError(f"cannot ask the kubelet which pods hold GPUs ({POD_RESOURCES}): "
                             f"{type(exc).__name__}: {exc}") from None
        return sorted(f"{pod.namespace}/{pod.name}" for pod in response.pod_resources
                      if any(device.resource_name.startswith("nvidia.com/")
                             for container in pod.containers for device in container.devices))

    def _wait(self, progress: Progress) -> None:
        busy = self.consumers()
        if not busy:
            return
        if progress.forced:
            progress.notes.append(f"--force: reloading while {', '.join(busy)} used a GPU")
            return
        now = time.time()
        if progress.waiting_since is None:
            progress.waiting_since = now
            self.ledger.save_driver_reload(asdict(progress))
        if now - progress.waiting_since > self.wait_seconds:
            raise self.fail(progress, WAIT_FOR_JOBS, f"still in use after {self.wait_seconds:g} s: {', '.join(busy)}")
        raise StageError(f"reload required: loaded {progress.loaded}, installed {progress.target}; {WAIT_FOR_JOBS}: "
                         f"waiting for {', '.join(busy)} to end (node cordoned: "
                         f"{'yes' if progress.cordoned else 'no'}; "
                         f"gives up {self.wait_seconds - (now - progress.waiting_since):.0f} s from now)")

    def _restart(self, progress: Progress) -> None:
        loaded = self.kernel.loaded()
        drm = loaded.get("nvidia_drm")
        if drm is not None and (drm.refcnt or 0) > 0:
            raise self.fail(progress, POD_RESTART, f"nvidia_drm is held (refcount {drm.refcnt}): a display uses the "
                                                   "GPU; the agent never unloads it from under one")
        if self.unloader is None:
            raise self.fail(progress, POD_RESTART, "no way to unload modules here")
        progress.plugin_stopped = True  # recorded first: a restarted agent keeps the plugin off
        self.ledger.save_driver_reload(asdict(progress))
        if self.gate is not None:
            self.gate.close(f"driver reload to {progress.target} in progress")
        for unit in self.settings.reload_units:
            if unit not in progress.stopped_units and self.unit_active(unit) and self.units is not None:
                progress.stopped_units.append(unit)
                self.ledger.save_driver_reload(asdict(progress))
                try:
                    self.units("stop", unit)
                except AgentError as exc:
                    raise self.fail(progress, POD_RESTART, str(exc)) from None
        self.nvml.session.pause(f"the driver is being reloaded ({progress.loaded} -> {progress.target})")
        try:
            if not progress.forced:
                busy = self.consumers()
                if busy:
                    raise self.fail(progress, POD_RESTART, f"a GPU is in use again: {', '.join(busy)}")
            for module in UNLOAD_ORDER:
                if module in self.kernel.loaded():
                    try:
                        self.unloader.unload(module)
                    except ModuleUnloadError as exc:
                        raise self.fail(progress, POD_RESTART, f"could not unload {module}: {exc.output}") from None
            from gpu_agent.stages.driver import load_module

            for module in progress.modules or ["nvidia", "nvidia_uvm"]:
                try:
                    load_module(self.loader, module)
                except AgentError as exc:
                    raise self.fail(progress, POD_RESTART, f"could not load {module}: {exc}") from None
            version = self.kernel.version("nvidia")
            if version != progress.target:
                raise self.fail(progress, POD_RESTART, f"the loaded nvidia module is {version}, not {progress.target}")
        finally:
            self.nvml.session.resume()
        try:
            view = self.nvml.inventory.driver_view(persistence=False)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            raise self.fail(progress, POD_RESTART, f"NVML fails with the new driver: {exc}") from None
        if view.version != progress.target:
            raise self.fail(progress, POD_RESTART, f"NVML reports driver {view.version}, not {progress.target}")
        failures = []
        for unit in reversed(progress.stopped_units):
            try:
                if self.units is not None:
                    self.units("start", unit)
            except AgentError as exc:
                failures.append(str(exc))
        progress.stopped_units = []
        if failures:
            raise self.fail(progress, POD_RESTART, "; ".join(failures))
        self._enter(progress, VALIDATION)

    # --- driver-upgrade stage: after this pass's MIG, discovery and CDI --------------------------

    def finish(self, progress: Progress, outcomes: dict[str, Any]) -> None:
        failing = [f"{name}: {outcome.message}" for name in VALIDATED
                   if (outcome := outcomes.get(name)) is not None and outcome.state != "ok"]
        if failing:
            raise self.fail(progress, VALIDATION, "; ".join(failing))
        progress.plugin_stopped = False
        if progress.step != UNCORDON:
            self._enter(progress, UNCORDON)
        if self.gate is not None:
            self.gate.open()
        if progress.cordoned and self.node is not None:
            try:  # uncordoned before DONE is recorded: an agent killed between them uncordons again
                self.node.patch_node(False, {STATE_LABEL: DONE})
            except AgentError as exc:
                raise self.fail(progress, UNCORDON, f"cannot uncordon the node: {exc}") from None
        progress.cordoned = False
        self._enter(progress, DONE)


class DriverUpgrade(Stage):
    """Finishes a reload the driver stage began (validation, uncordon, done) and says the node's upgrade
    state: the label the sink publishes, and readiness while a reload is under way or failed."""

    name = "driver-upgrade"
    consumes = ("driver_mismatch", OUTCOMES)
    produces = ("driver_upgrade",)

    def __init__(self, reload: Reload) -> None:
        self.reload = reload
        self.settings = reload.settings

    def observe(self) -> Optional[Progress]:
        return self.reload.progress()

    def plan(self, progress: Optional[Progress]) -> list[Action]:
        if progress is None or progress.step not in (VALIDATION, UNCORDON):
            return []
        outcomes = dict(self.inputs.get(OUTCOMES, {}))
        return [Action.of(DriverReloadStep(VALIDATION, "validate and uncordon"),
                          lambda: self.reload.finish(progress, outcomes))]

    def outputs(self, progress: Optional[Progress]) -> dict[str, Any]:
        mismatch = self.inputs.get("driver_mismatch")
        if mismatch and (progress is None or progress.step == DONE):
            return {"driver_upgrade": UPGRADE_REQUIRED}
        return {"driver_upgrade": progress.step if progress is not None else None}

    def facts(self, progress: Optional[Progress]) -> dict[str, Any]:
        return {"reload": asdict(progress) if progress is not None else None}

    def verify(self, progress: Optional[Progress]) -> str:
        if progress is None:
            return "no driver reload recorded"
        if progress.step == FAILED:
            raise StageError(f"driver reload to {progress.target} failed at {progress.failed_step}: {progress.failure}"
                             + ("; the node stays cordoned" if progress.cordoned else ""))
        if progress.step == DONE:
            notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
            return f"driver reloaded {progress.loaded} -> {progress.target}{notes}"
        raise StageError(f"driver reload to {progress.target} at {progress.step}"
                         + ("; the node is cordoned" if progress.cordoned else ""))
