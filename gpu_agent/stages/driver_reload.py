"""Driver reload after a package upgrade: the installed driver (libraries, module on disk) is newer than
the loaded module, so NVML fails with "Driver/library version mismatch" until the module is reloaded.

The sequence and its node label follow the GPU Operator's upgrade controller (NVIDIA/k8s-operator-libs
pkg/upgrade/consts.go and common_manager.go, commit 11e747a5): upgrade-required, cordon-required,
wait-for-jobs-required, pod-deletion-required, drain-required, pod-restart-required,
validation-required, uncordon-required, upgrade-done, or upgrade-failed; and the agent's own
upgrade-abandoned. The agent deletes and drains no pods (the Operator's pod deletion and drain off: those
states are passed through, and recorded, but not published as labels of their own); the pod restart is the
reload itself.

Which step comes next is reload_transitions.decide()'s, from the ledger's record and what the node shows
now; this module observes, takes the move and records it before it acts, so an agent killed midway finds
where it was, and a node that changed meanwhile (a reboot, another install, a rollback) is seen as it is.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from gpu_agent.config.driver import DriverConfig
from gpu_agent.dra.devices import DRIVER as DRA_DRIVER
from gpu_agent.errors import AgentError, StageError, TransientError
from gpu_agent.host import display, driver_version, processes
from gpu_agent.host.display import ConsoleControl
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.modules import KernelModules, ModuleLoader, ModuleUnloader, ModuleUnloadError
from gpu_agent.host.paths import Root
from gpu_agent.host import procfs
from gpu_agent.mig.hooks import UnitControl
from gpu_agent.nvml.client import Nvml
from gpu_agent.plan import DriverReloadStep
from gpu_agent.plugin.gate import PluginGate
from gpu_agent.stages import module_options
from gpu_agent.stages.base import OUTCOMES, Action, Stage
from gpu_agent.stages.reload_transitions import (  # noqa: F401 (the names other modules take from here)
    ABANDONED,
    ABORT,
    ADVANCE,
    BIND_CONSOLE,
    CORDON,
    CORDON_REQUIRED,
    DONE,
    DRAIN,
    FAILED,
    FINAL,
    FINISH,
    FINISHING,
    GIVE_UP,
    HOLD_PLUGIN,
    IDLE,
    IDLE_ABANDONED,
    IDLE_NEVER,
    IDLE_OPTIONS,
    IDLE_SKIP,
    INVALID,
    LATER,
    LOAD,
    MISLOADED,
    MOOT,
    NEW_BOOT,
    OPTIONS,
    ORDER,
    POD_DELETION,
    POD_RESTART,
    QUIT_MPS,
    REFUSE,
    REFUSE_DISPLAY,
    RELEASE,
    RELOADING,
    RETARGET,
    RETRY,
    START,
    START_MPS,
    STOP_UNIT,
    UNBIND_CONSOLE,
    UNCORDON,
    UNCORDON_NODE,
    UNLOAD,
    UNLOAD_ORDER,
    UPGRADE_REQUIRED,
    VALIDATION,
    VERIFY,
    VERSION,
    WAIT,
    WAIT_FOR_JOBS,
    Facts,
    Move,
    Progress,
    Request,
    Rules,
    decide,
    label,
)

if TYPE_CHECKING:
    from gpu_agent.mps.reload import ReloadMps

log = logging.getLogger(__name__)

STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
SKIP_LABEL = "nvidia.com/gpu-driver-upgrade.skip"  # k8s-operator-libs: "true" skips the node
ENABLED_KEY = "nvidia.com/gpu-driver-upgrade-enabled"  # label or annotation: "false" turns it off here
QUIET = (POD_DELETION, DRAIN)  # passed through within one step: not published as labels of their own
VALIDATED = ("mig", "discovery", "cdi")  # stages whose outcome after the reload must be ok
POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"
AGENT = "gpu-agent"  # who ended a reload the node showed was no longer needed
_MOVES_PER_PASS = 64  # each move changes the record or the node; more in one pass is a loop


class NodeAccess(Protocol):
    """This node's Node object, through the agent's own credentials (stages/labels.py KubeSink)."""

    def node_metadata(self, fresh: bool = True) -> tuple[dict[str, str], dict[str, str], bool]:
        """(labels, annotations, spec.unschedulable), read now or (not `fresh`) as last read."""

    def patch_node(self, unschedulable: Optional[bool], labels: dict[str, str]) -> None:
        """One merge patch of spec.unschedulable (None: left alone) and labels; StageError on failure
        (its status in the message)."""


class Reload:
    """Observes the facts, takes decide()'s moves and records them: for the driver stage up to the loaded
    new driver, for the driver-upgrade stage the validation and the end."""

    def __init__(self, root: Root, nvml: Nvml, loader: ModuleLoader, unloader: Optional[ModuleUnloader],
                 units: Optional[UnitControl], unit_active: Callable[[str], bool], settings: DriverConfig,
                 node: Optional[NodeAccess] = None, gate: Optional[PluginGate] = None,
                 console: Optional[ConsoleControl] = None, mps: Optional[ReloadMps] = None) -> None:
        self.root = root
        self.nvml = nvml
        self.loader = loader
        self.unloader = unloader
        self.units = units
        self.unit_active = unit_active
        self.settings = settings
        self.node = node
        self.gate = gate
        self.console = console
        self.mps = mps  # the agent's own MPS control daemons: quit for the unload, started again after
        self.ledger = Ledger(root)
        self.kernel = KernelModules(root)
        self.force = False  # `gpu-agent driver reload --force`
        self.requested = False  # `gpu-agent driver reload`: whatever driver.reload says
        self.abort_by: Optional[str] = None  # `gpu-agent driver reload --abort`: who asked
        self.wait_seconds = settings.reload_wait_seconds
        self._paused = False
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
                self.gate.close(f"driver {progress.what()} in progress")
            else:
                self.gate.open()
        return progress

    def _save(self, progress: Progress) -> None:
        self.ledger.save_driver_reload(asdict(progress))

    def _enter(self, progress: Progress, step: str, patch_unschedulable: Optional[bool] = None,
               shown: Optional[str] = None) -> None:
        """Record `step` before taking it; publish it (or `shown`) as the node's label, in one patch with the
        cordon or uncordon."""
        progress.step = step
        self._save(progress)
        log.info("driver reload: %s", step)
        if self.node is None or (step in QUIET and patch_unschedulable is None):
            return
        try:
            self.node.patch_node(patch_unschedulable, {STATE_LABEL: shown or step})
        except AgentError as exc:
            if patch_unschedulable is not None:
                raise
            log.warning("driver reload: could not label the node %s: %s", step, exc)

    # --- what the node shows ---------------------------------------------------------------------

    def request(self) -> Request:
        return Request(self.requested, self.force, self.abort_by)

    def rules(self) -> Rules:
        return Rules(self.settings.reload, self.wait_seconds, tuple(self.settings.reload_units))

    def installed(self) -> Optional[str]:
        return driver_version.installed(self.root).version

    def observe(self, progress: Optional[Progress], outcomes: Optional[dict[str, Any]] = None) -> Facts:
        """The facts decide() needs for this record: the costly ones (the kubelet, the units) only where the
        record's step reads them."""
        modules = self.kernel.loaded()
        loaded = self.kernel.version("nvidia") if "nvidia" in modules else None
        installed = self.installed()
        under_way = progress is not None and progress.step not in FINAL
        step = progress.step if progress is not None and under_way else None
        looks_at_users = step == WAIT_FOR_JOBS or (
            step == POD_RESTART and progress is not None and not progress.unloaded and not progress.reloaded)
        use = display.drm_use(self.root, modules.get("nvidia_drm")) if under_way else display.DrmUse(None, ())
        mismatch = loaded is not None and installed is not None and loaded != installed
        return Facts(
            loaded=loaded, installed=installed, boot_id=self.boot_id(),
            modules=frozenset(module for module in UNLOAD_ORDER if module in modules),
            busy=tuple(self.consumers()) if looks_at_users else (),
            active_units=self._active_units(progress) if under_way else frozenset(),
            mps=tuple(self.mps.running()) if under_way and self.mps is not None else (),
            display=use.display, consoles=use.consoles,
            drift=tuple(d.text for d in module_options.drift(self.root, self.kernel, self.settings.parameters,
                                                                    modules)),
            skip=self.skipped() if not under_way and mismatch and self.settings.reload == "when-idle" else None,
            now=time.time(), validation=_validation(outcomes))

    def boot_id(self) -> Optional[str]:
        return procfs.boot_id(self.root)

    def _active_units(self, progress: Optional[Progress]) -> frozenset[str]:
        units = [*self.settings.reload_units, *(progress.stopped_units if progress else ())]
        return frozenset(unit for unit in units if self.unit_active(unit))

    def next_move(self, outcomes: Optional[dict[str, Any]] = None) -> tuple[Optional[Progress], Facts, Move]:
        progress = self.progress()
        facts = self.observe(progress, outcomes)
        return progress, facts, decide(progress, facts, self.request(), self.rules())

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

    def consumers(self) -> list[str]:
        """What uses a GPU now: pods with NVIDIA devices or resource claims of them (the kubelet's
        pod-resources), processes with an NVIDIA device file open, but the agent's own MPS control daemons
        and their servers (quit before the unload)."""
        found = processes.device_users(self.root)
        own = self.mps.own(found) if self.mps is not None else set()
        users = [f"process {p.describe()}" for p in found if p.pid not in own]
        return users + [f"pod {pod}" for pod in self._gpu_pods()]

    def _gpu_pods(self) -> list[str]:
        return pods_holding(self.root, lambda device: device.resource_name.startswith("nvidia.com/"),
                            lambda claimed: claimed.driver_name == DRA_DRIVER)

    # --- taking the moves ------------------------------------------------------------------------

    def run(self, outcomes: Optional[dict[str, Any]] = None) -> None:
        """Take moves until the reload waits, fails, ends, or (without `outcomes`: the driver stage) is the
        driver-upgrade stage's to go on with; with `outcomes`, until it ended."""
        try:
            for _ in range(_MOVES_PER_PASS):
                progress, facts, move = self.next_move(outcomes)
                if move.kind in (IDLE, LATER) or (outcomes is not None and (progress is None
                                                                             or progress.step not in FINISHING)):
                    return  # with outcomes: the driver-upgrade stage's part is over
                log.debug("driver reload: %s %s", move.kind, move.arg)
                self._take(progress, facts, move)
            raise StageError(f"driver reload: still moving after {_MOVES_PER_PASS} steps in one pass (a gpu-agent "
                             "bug: see the log)")
        finally:
            self._nvml_back()

    def _take(self, progress: Optional[Progress], facts: Facts, move: Move) -> None:
        if move.kind == START:
            self._start(facts, move.arg)
            return
        assert progress is not None
        getattr(self, "_" + move.kind.replace("-", "_"))(progress, facts, move.arg)

    def _start(self, facts: Facts, reason: str) -> None:
        loaded = facts.loaded or ""
        target = (facts.installed or loaded) if reason == VERSION else loaded
        progress = Progress(UPGRADE_REQUIRED, target, loaded, modules=[m for m in UNLOAD_ORDER[::-1]
                                                                        if m in facts.modules],
                            forced=self.force, reason=reason, boot_id=facts.boot_id)
        if reason == OPTIONS:
            progress.notes.append(f"to apply {'; '.join(facts.drift)}")
        self._enter(progress, CORDON_REQUIRED)

    def _release(self, progress: Progress, facts: Facts, arg: str) -> None:
        """The uncordon an end could not make: made now."""
        self._uncordon(progress, facts, progress.step)

    def _retry(self, progress: Progress, facts: Facts, step: str) -> None:
        log.info("driver reload: trying %s again after: %s", step, progress.failure)
        progress.failure = None
        progress.forced = self.force  # each attempt is forced or not by its own request
        if step == WAIT_FOR_JOBS:
            progress.waiting_since = None
        if progress.reason == VERSION and facts.loaded != (facts.installed or progress.target):
            progress.reloaded = False  # a module it loaded that is not the target: unloaded and loaded again
        self._enter(progress, step)  # VALIDATION, UNCORDON: the driver-upgrade stage's to retry

    def _new_boot(self, progress: Progress, facts: Facts, boot_id: str) -> None:
        """A reboot put back what the agent took away in the boot before (its unloads, its console unbinds; the
        units it stopped that the boot did not start are started): what the reload still needs is seen anew."""
        step = progress.failed_step if progress.step == FAILED else progress.step
        progress.notes.append(f"a reboot (boot id {boot_id}) during {step}")
        failures = self._start_units(progress, facts)
        progress.boot_id = boot_id
        progress.unloaded, progress.consoles, progress.plugin_stopped = [], [], False
        progress.waiting_since, progress.failure, progress.failed_step = None, None, None
        if progress.reason == VERSION:
            progress.reloaded = False
            step = WAIT_FOR_JOBS if step in (POD_DELETION, DRAIN, POD_RESTART) else step
        else:  # the boot loaded the modules afresh, with the options on disk: what was asked is done
            progress.reloaded, step = True, POD_RESTART
        progress.notes += failures
        self._enter(progress, step if step in (*RELOADING, *FINISHING) else CORDON_REQUIRED)

    def _retarget(self, progress: Progress, facts: Facts, installed: str) -> None:
        """Another driver installed while the reload was under way (or the package rolled back): the same
        reload goes on toward it, with what it has cordoned and stopped so far."""
        step = progress.failed_step if progress.step == FAILED else progress.step
        progress.notes.append(f"the installed driver became {installed} (was {progress.target}) at {step}")
        progress.target, progress.reason, progress.reloaded = installed, VERSION, False
        if step in FINISHING:
            step = WAIT_FOR_JOBS  # the new target is to be loaded: the GPUs are waited for again
        if progress.step == FAILED:
            progress.failed_step = step
            self._enter(progress, FAILED)
        else:
            self._enter(progress, step or CORDON_REQUIRED)

    def _finish(self, progress: Progress, facts: Facts, why: str) -> None:
        """The target is loaded, not by this sequence: on to its load phase (what else is to load, the units
        back, verified), never through an unload."""
        progress.notes.append(why)
        progress.reloaded, progress.failure, progress.failed_step = True, None, None
        self._enter(progress, POD_RESTART)

    def _moot(self, progress: Progress, facts: Facts, why: str) -> None:
        self._abandon(progress, facts, AGENT, f"nothing to reload: {why}")

    def _abort(self, progress: Progress, facts: Facts, who: str) -> None:
        step = progress.failed_step if progress.step == FAILED else progress.step
        if progress.reason == VERSION and facts.installed is not None and facts.installed != progress.target:
            # Ended as the reload it had become: to the driver installed now, which when-idle then leaves alone.
            progress.notes.append(f"the installed driver became {facts.installed} (was {progress.target})")
            progress.target = facts.installed
        self._abandon(progress, facts, who, f"aborted at {step}")

    def _cordon(self, progress: Progress, facts: Facts, arg: str) -> None:
        if self.node is None:
            progress.notes.append("not cordoned: the Kubernetes API is off")
            self._enter(progress, WAIT_FOR_JOBS)
            return
        try:
            _, _, unschedulable = self.node.node_metadata()
        except AgentError as exc:
            raise self._fail(progress, CORDON_REQUIRED, f"cannot read the node: {exc}") from None
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
            raise self._fail(progress, CORDON_REQUIRED, f"cannot cordon the node: {exc}") from None

    def _wait(self, progress: Progress, facts: Facts, arg: str) -> None:
        if progress.waiting_since is None:
            progress.waiting_since = facts.now
            self._save(progress)
        left = self.wait_seconds - (facts.now - progress.waiting_since)
        raise StageError(f"{_required(progress, facts)}; {WAIT_FOR_JOBS}: waiting for {', '.join(facts.busy)} to "
                         f"end (node cordoned: {'yes' if progress.cordoned else 'no'}; gives up {left:.0f} s from now)")

    def _give_up(self, progress: Progress, facts: Facts, arg: str) -> None:
        raise self._fail(progress, WAIT_FOR_JOBS,
                         f"still in use after {self.wait_seconds:g} s: {', '.join(facts.busy)}")

    def _advance(self, progress: Progress, facts: Facts, step: str) -> None:
        self._enter(progress, step)

    def _refuse(self, progress: Progress, facts: Facts, why: str) -> None:
        if why == REFUSE_DISPLAY:
            raise self._fail(progress, POD_RESTART, f"{facts.display}: the agent never unloads nvidia_drm from "
                                                    "under a display")
        raise self._fail(progress, POD_RESTART, f"a GPU is in use again: {', '.join(facts.busy)}")

    def _hold_plugin(self, progress: Progress, facts: Facts, arg: str) -> None:
        progress.plugin_stopped = True  # recorded first: a restarted agent keeps the plugin off
        self._save(progress)
        if self.gate is not None:
            self.gate.close(f"driver {progress.what()} in progress")

    def _stop_unit(self, progress: Progress, facts: Facts, unit: str) -> None:
        if self.units is None:
            raise self._fail(progress, POD_RESTART, f"{unit} runs and there is no way to stop units here")
        progress.stopped_units.append(unit)  # recorded first: started again at every end
        self._save(progress)
        try:
            self.units("stop", unit)
        except AgentError as exc:
            raise self._fail(progress, POD_RESTART, str(exc)) from None

    def _quit_mps(self, progress: Progress, facts: Facts, resource: str) -> None:
        assert self.mps is not None  # facts.mps names none without it
        if resource not in progress.stopped_mps:
            progress.stopped_mps.append(resource)  # recorded first: held off, and started again at every end
            self._save(progress)
        log.info("driver reload: quitting the MPS control daemon for %s (its server holds the GPUs)", resource)
        problem = self.mps.quit(resource)
        if problem is not None:
            raise self._fail(progress, POD_RESTART, problem)

    def _start_mps(self, progress: Progress, facts: Facts, resource: str) -> None:
        """Validated: the daemon started again, its GPUs EXCLUSIVE_PROCESS first. One that does not start is
        said and left to the MPS watch, which tries again with its backoff; the reload is done all the same."""
        problem = self._started_again(resource)
        if problem is not None:
            progress.notes.append(problem)
            log.warning("driver reload: %s", problem)
        progress.stopped_mps.remove(resource)
        self._save(progress)

    def _started_again(self, resource: str) -> Optional[str]:
        if self.mps is None:
            return f"the MPS control daemon for {resource} is not started here: the MPS watch starts it"
        return self.mps.start(resource)

    def _unbind_console(self, progress: Progress, facts: Facts, vtcon: str) -> None:
        if self.console is None:
            raise self._fail(progress, POD_RESTART, f"the framebuffer console ({vtcon}) holds nvidia_drm and there "
                                                    "is no way to unbind it here")
        progress.consoles.append(vtcon)  # recorded first: bound again at every end
        self._save(progress)
        try:
            self.console.bind(vtcon, False)
        except AgentError as exc:
            progress.consoles.remove(vtcon)
            raise self._fail(progress, POD_RESTART, f"cannot unbind the framebuffer console {vtcon}: {exc}") from None

    def _unload(self, progress: Progress, facts: Facts, module: str) -> None:
        if self.unloader is None:
            raise self._fail(progress, POD_RESTART, "no way to unload modules here")
        self._let_nvml_go(progress)
        progress.unloaded.append(module)  # recorded first: loaded again at every end
        self._save(progress)
        try:
            self.unloader.unload(module)
        except ModuleUnloadError as exc:
            progress.unloaded.remove(module)
            raise self._fail(progress, POD_RESTART, f"could not unload {module}: {exc.output}") from None
        except AgentError as exc:
            progress.unloaded.remove(module)
            raise self._fail(progress, POD_RESTART, f"could not unload {module}: {exc}") from None

    def _misloaded(self, progress: Progress, facts: Facts, version: str) -> None:
        raise self._fail(progress, POD_RESTART, f"the loaded nvidia module is {version}, not "
                                                f"{facts.installed or progress.target}")

    def _load(self, progress: Progress, facts: Facts, module: str) -> None:
        from gpu_agent.stages.driver import load_module

        self._let_nvml_go(progress)
        try:
            load_module(self.loader, module)
        except AgentError as exc:
            raise self._fail(progress, POD_RESTART, f"could not load {module}: {exc}") from None
        if module in progress.unloaded:
            progress.unloaded.remove(module)
        if module == "nvidia":
            progress.reloaded = True
        self._save(progress)

    def _bind_console(self, progress: Progress, facts: Facts, vtcon: str) -> None:
        failure = self._bind(progress, vtcon)
        if failure:
            progress.notes.append(failure)
        self._save(progress)

    def _verify(self, progress: Progress, facts: Facts, arg: str) -> None:
        self._nvml_back()
        try:
            view = self.nvml.inventory.driver_view(persistence=False)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            raise self._fail(progress, POD_RESTART, f"NVML fails with the new driver: {exc}") from None
        if view.version != facts.loaded:
            raise self._fail(progress, POD_RESTART, f"NVML reports driver {view.version}, not {facts.loaded}")
        failures = self._start_units(progress, facts)
        if failures:
            raise self._fail(progress, POD_RESTART, "; ".join(failures))
        self._enter(progress, VALIDATION)

    def _invalid(self, progress: Progress, facts: Facts, failing: str) -> None:
        raise self._fail(progress, VALIDATION, failing)

    def _uncordon(self, progress: Progress, facts: Facts, arg: str) -> None:
        """Validated (or, for an end, put back): the plugin serves again, the node is uncordoned if the agent
        cordoned it, and the reload is done."""
        end = arg if arg in FINAL else DONE
        if end == DONE and progress.step != UNCORDON:
            progress.plugin_stopped = False
            self._enter(progress, UNCORDON)
        if self.gate is not None:
            self.gate.open()
        shown = label(replace(progress, step=end), facts.mismatch, facts.installed)
        if progress.cordoned and self.node is not None:
            try:  # uncordoned before the end is recorded: an agent killed between them uncordons again
                self.node.patch_node(False, {STATE_LABEL: shown or end})
            except AgentError as exc:
                if end == DONE and isinstance(exc, TransientError):  # the API server's or the agent's own
                    # request limits (the node access says so): the sequence stays at uncordon-required, and the
                    # next pass, when the API's schedule says, goes on
                    raise TransientError(f"driver {progress.what()} validated; uncordoning waits for the API "
                                         f"server: {exc}", exc.retry_at) from None
                if end == DONE:
                    raise self._fail(progress, UNCORDON, f"cannot uncordon the node: {exc}") from None
                raise StageError(f"driver {progress.what()} {end}, but the node stays cordoned: cannot uncordon "
                                 f"it: {exc} (tried again at the next pass)") from None
        progress.cordoned = False
        if end == DONE:
            progress.ended_at = facts.now
        self._enter(progress, end, shown=shown)

    # --- what every end and failure puts back -----------------------------------------------------

    def _fail(self, progress: Progress, step: str, reason: str) -> StageError:
        """The step failed: recorded, what can be put back put back while it is tried again (the units, the
        console, the modules that can load beside the loaded nvidia; the plugin once nothing is missing)."""
        progress.failed_step = step
        put_back = self._put_back(progress, whole=False)
        progress.failure = "; ".join([reason, *put_back])
        self._enter(progress, FAILED)
        cordon = "the node stays cordoned; " if progress.cordoned else ""
        return StageError(f"driver {progress.what()} failed at {step}: {progress.failure} ({cordon}"
                          "tried again with backoff)")

    def _abandon(self, progress: Progress, facts: Facts, who: str, why: str) -> None:
        """An end without the reload: everything put back that can be, the node uncordoned if the agent
        cordoned it, `upgrade-abandoned` recorded with who and when."""
        notes = self._put_back(progress, whole=True)
        stuck = self.kernel.stuck()
        if stuck:
            notes.append(f"{', '.join(stuck)} never finished loading or unloading (left as it is: a reboot clears it)")
        progress.notes += notes
        progress.ended_by, progress.ended_at, progress.ended_why = who, facts.now, why
        progress.plugin_stopped, progress.failed_step, progress.failure = False, None, None
        log.warning("driver %s abandoned by %s: %s", progress.what(), who, why)
        self._uncordon(progress, self.observe(None), ABANDONED)

    def _put_back(self, progress: Progress, whole: bool) -> list[str]:
        """Load the modules the agent unloaded that can load, bind the consoles it unbound, start the units it
        stopped (not while no nvidia module is loaded: they hold it); `whole` (an end): also load nvidia,
        which can only be the installed one, and give the plugin back whatever is missing. What could not be
        put back, said."""
        self._nvml_back()
        said = []
        modules = self.kernel.loaded()
        loaded = self.kernel.version("nvidia") if "nvidia" in modules else None
        installed = self.installed()
        stuck = self.kernel.stuck()
        missing = [m for m in progress.load_order() if m not in modules and m not in stuck]
        if "nvidia" in stuck:
            missing = []  # what depends on it waits for its init as well (the abort names it)
        elif loaded is None and not whole:
            missing = []  # the retry loads the new driver
        elif loaded is not None and installed is not None and loaded != installed:
            if any(m != "nvidia" for m in missing):
                said.append(f"{', '.join(m for m in missing if m != 'nvidia')} stay unloaded: their modules on "
                            f"disk are {installed}'s and the loaded nvidia is {loaded}")
            missing = []
        if missing:
            self._let_nvml_go(progress)
        from gpu_agent.stages.driver import load_module

        for module in missing:
            try:
                load_module(self.loader, module)
            except AgentError as exc:
                said.append(f"{module} could not be loaded again: {exc}")
                if module == "nvidia":
                    break
                continue
            if module in progress.unloaded:
                progress.unloaded.remove(module)
        self._nvml_back()
        now = self.kernel.loaded()
        progress.unloaded = [m for m in progress.unloaded if m not in now]
        for vtcon in list(progress.consoles):
            if whole or "nvidia_drm" in now:
                failure = self._bind(progress, vtcon)
                said += [failure] if failure else []
        if "nvidia" in now or whole:
            facts = Facts(loaded=None, installed=None, active_units=self._active_units(progress))
            said += self._start_units(progress, facts)
        complete = all(m in now for m in progress.load_order())
        if whole or complete:
            progress.plugin_stopped = False
            if self.gate is not None:
                self.gate.open()
        said += self._mps_back(progress, whole, complete and self.kernel.version("nvidia") == (installed or loaded))
        self._save(progress)
        return said

    def _mps_back(self, progress: Progress, whole: bool, serving: bool) -> list[str]:
        """The MPS control daemons the agent quit, started again where the driver serves (NVML answers: the
        installed driver's modules all loaded); at an end those that cannot start are left to the MPS watch,
        which starts them once NVML answers. What could not be, said."""
        said = []
        for resource in list(progress.stopped_mps):
            if not serving:
                if whole:
                    said.append(f"the MPS control daemon for {resource} stays stopped until the driver serves (the "
                                "MPS watch starts it then)")
                    progress.stopped_mps.remove(resource)
                continue
            problem = self._started_again(resource)
            if problem is not None:
                said.append(problem)
                if not whole:
                    continue
            progress.stopped_mps.remove(resource)
        return said

    def _bind(self, progress: Progress, vtcon: str) -> Optional[str]:
        progress.consoles.remove(vtcon)
        if self.console is None:
            return f"the framebuffer console {vtcon} stays unbound: no way to bind it here"
        try:
            self.console.bind(vtcon, True)
        except AgentError as exc:
            return f"the framebuffer console {vtcon} stays unbound: {exc}"
        return None

    def _start_units(self, progress: Progress, facts: Facts) -> list[str]:
        """Start the units the agent stopped (in reverse), each even when one fails: the failures, said."""
        failures = []
        for unit in reversed(progress.stopped_units):
            if unit in facts.active_units:
                continue
            try:
                if self.units is not None:
                    self.units("start", unit)
            except AgentError as exc:
                failures.append(str(exc))
        progress.stopped_units = []
        return failures

    def _let_nvml_go(self, progress: Progress) -> None:
        if not self._paused:
            self.nvml.session.pause(f"the driver is being reloaded ({progress.what()})")
            self._paused = True

    def _nvml_back(self) -> None:
        if self._paused:
            self.nvml.session.resume()
            self._paused = False

    # --- what it would do ------------------------------------------------------------------------

    def planned(self, progress: Optional[Progress], facts: Facts, move: Move) -> list[DriverReloadStep]:
        """What the sequence would do from here, for the plan (`gpu-agent check`, `driver reload --dry-run`)."""
        first = _FIRST.get(move.kind)
        at = progress.step if progress is not None and move.kind != START else CORDON_REQUIRED
        if at == FAILED and progress is not None:
            at = progress.failed_step or CORDON_REQUIRED
        head = [DriverReloadStep(at, first(progress, facts, move))] if first is not None else []
        if move.kind in (ABORT, MOOT, RELEASE):
            return head
        units = ", ".join(self.settings.reload_units) or "none configured"
        target = facts.installed if progress is None or progress.reason == VERSION else facts.loaded
        cordon = [DriverReloadStep(CORDON_REQUIRED, "cordon the node (spec.unschedulable) with its own credentials")]
        wait = [DriverReloadStep(WAIT_FOR_JOBS, f"wait up to {self.wait_seconds:g} s until no pod holds a GPU "
                                                "(kubelet pod-resources) and no process has one open (/proc)")]
        unload = [
            DriverReloadStep(POD_RESTART, f"stop the running units of driver.reload_units ({units}) and the device "
                                          "plugin; quit the agent's MPS control daemons (their servers hold the "
                                          "GPUs); let NVML go; unbind the framebuffer console from nvidia-drm's "
                                          "framebuffer if it is bound"),
            DriverReloadStep(POD_RESTART, f"unload the {facts.loaded or 'loaded'} modules in dependency order (rmmod)")]
        load = [DriverReloadStep(POD_RESTART, f"load the installed {target or ''} modules (modprobe) and verify the "
                                              "version, NVML and the GPUs".replace("  ", " ")),
                DriverReloadStep(POD_RESTART, "start the stopped units again")]
        finish = [DriverReloadStep(VALIDATION, "MIG geometry re-applied, GPUs discovered, CDI spec regenerated; "
                                               "the MPS control daemons it quit started again, their GPUs in "
                                               "EXCLUSIVE_PROCESS; device plugin serving again"),
                  DriverReloadStep(UNCORDON, "uncordon the node if the agent cordoned it")]
        if at in FINISHING:
            return head + finish
        if at == POD_RESTART:
            swapped = move.kind == FINISH or (progress is not None and progress.reloaded)
            return head + ([] if swapped else unload) + load + finish
        return head + (cordon if at in (CORDON_REQUIRED, UPGRADE_REQUIRED) else []) + wait + unload + load + finish


def pods_holding(root: Root, holds: Callable[[Any], bool], claimed: Callable[[Any], bool]) -> list[str]:
    """namespace/name of the pods the kubelet's pod-resources API says hold a device: one a device plugin
    gave that `holds` accepts (a ContainerDevices: resource_name, device_ids), or one a resource claim gave
    that `claimed` accepts (a ClaimResource: driver_name, pool_name, device_name); none where the kubelet
    has no such socket."""
    socket = root(POD_RESOURCES)
    if not socket.exists():
        return []
    from gpu_agent.metrics.pods import list_pod_resources

    try:
        response = asyncio.run(list_pod_resources(socket, 5.0))
    except Exception as exc:  # grpclib's and the socket's errors: the kubelet did not answer
        raise StageError(f"cannot ask the kubelet which pods hold GPUs ({POD_RESOURCES}): "
                         f"{type(exc).__name__}: {exc}") from None
    return sorted(f"{pod.namespace}/{pod.name}" for pod in response.pod_resources
                  if any(holds(device) for container in pod.containers for device in container.devices)
                  or any(claimed(resource) for container in pod.containers for claim in container.dynamic_resources
                         for resource in claim.claim_resources))


def _validation(outcomes: Optional[dict[str, Any]]) -> Optional[tuple[str, ...]]:
    if outcomes is None:
        return None
    return tuple(f"{name}: {outcome.message}" for name in VALIDATED
                 if (outcome := outcomes.get(name)) is not None and outcome.state != "ok")


def _required(progress: Progress, facts: Facts) -> str:
    """`reload required: loaded 550.90.07, installed 570.124.06`, or what else the reload is for."""
    if facts.mismatch:
        return f"reload required: loaded {facts.loaded}, installed {facts.installed}"
    return f"driver {progress.what()}"


_FIRST: dict[str, Callable[[Optional[Progress], Facts, Move], str]] = {
    ABORT: lambda p, f, m: "end the reload: load back what was unloaded, start the stopped units and MPS control "
                           "daemons, bind the console, let the plugin serve, uncordon if the agent cordoned, record "
                           "upgrade-abandoned",
    MOOT: lambda p, f, m: f"nothing to reload ({m.arg}): put back what was taken, uncordon if the agent cordoned",
    RELEASE: lambda p, f, m: "uncordon the node the agent cordoned (the end could not)",
    NEW_BOOT: lambda p, f, m: f"a reboot happened (boot id {m.arg}): start the stopped units the boot did not, "
                              "then see what the reload still needs",
    RETARGET: lambda p, f, m: f"the installed driver is now {m.arg}: reload to it, keeping the cordon and the "
                              "stopped units",
    FINISH: lambda p, f, m: f"{f.loaded} is loaded already (a reboot?): no unload",
    RETRY: lambda p, f, m: f"try {m.arg} again",
    LATER: lambda p, f, m: "validate and uncordon",
}


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
        if progress is None or progress.step not in FINISHING:
            return []
        outcomes = dict(self.inputs.get(OUTCOMES, {}))
        return [Action.of(DriverReloadStep(VALIDATION, "validate and uncordon"), lambda: self.reload.run(outcomes))]

    def outputs(self, progress: Optional[Progress]) -> dict[str, Any]:
        mismatch = bool(self.inputs.get("driver_mismatch"))
        installed = self.reload.installed() if mismatch and progress is not None else None
        return {"driver_upgrade": label(progress, mismatch, installed)}

    def facts(self, progress: Optional[Progress]) -> dict[str, Any]:
        return {"reload": asdict(progress) if progress is not None else None}

    def verify(self, progress: Optional[Progress]) -> str:
        if progress is None:
            return "no driver reload recorded"
        if progress.step == FAILED:
            raise StageError(f"driver {progress.what()} failed at {progress.failed_step}: {progress.failure}"
                             + ("; the node stays cordoned" if progress.cordoned else ""))
        if progress.step == ABANDONED:
            if progress.cordoned:
                raise StageError(f"driver {progress.what()} abandoned, but the node stays cordoned (its uncordon "
                                 "failed: tried again)")
            return abandoned(progress)
        if progress.step == DONE:
            notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
            return f"driver reloaded {progress.loaded} -> {progress.target}{notes}"
        raise StageError(f"driver {progress.what()} at {progress.step}"
                         + ("; the node is cordoned" if progress.cordoned else ""))


def abandoned(progress: Progress) -> str:
    """`driver reload of A to B abandoned by W at T: why`."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(progress.ended_at)) if progress.ended_at else "?"
    notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
    return f"driver {progress.what()} abandoned by {progress.ended_by} at {when}: {progress.ended_why}{notes}"
