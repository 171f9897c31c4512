"""Composition root: builds the NVML client, state, stages and outputs, and runs the daemon loop."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Optional

from gpu_agent import __version__
from gpu_agent.config import AgentConfig, LoadedConfig
from gpu_agent.config.loader import reload_config
from gpu_agent.config.plugin import configured_api, plugin_wanted, serves_dra
from gpu_agent.daemon import liveness
from gpu_agent.daemon.engine import Engine
from gpu_agent.host.watch import FileChanges
from gpu_agent.daemon.workers import DaemonThreadPool
from gpu_agent.errors import AgentError
from gpu_agent.health.reset import ResetHealsGpu
from gpu_agent.host import sandbox
from gpu_agent.host.display import ConsoleControl, SysfsConsole
from gpu_agent.host.files import Stamp, stamp_of, written_by_us
from gpu_agent.host.memory import give_back, limit_arenas
from gpu_agent.host.modules import Modprobe, ModuleLoader, ModuleUnloader
from gpu_agent.host.paths import Root, resolve
from gpu_agent.host.vfio import PciControl, SysfsPci
from gpu_agent.kube import budget
from gpu_agent.kube.api_state import ApiState
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.mig.hooks import Systemctl, UnitControl
from gpu_agent.mig.reset import GpuReset, NvidiaSmiReset
from gpu_agent.dra.timeslice import NvidiaSmiTimeSlices, TimeSlices
from gpu_agent.nvml.client import Nvml
from gpu_agent.plugin.gate import PluginGate
from gpu_agent.stages.base import Stage
from gpu_agent.stages.cdi import Cdi
from gpu_agent.stages.devicepath import DevicePathStage
from gpu_agent.stages.discovery import Discovery
from gpu_agent.stages.driver import Driver
from gpu_agent.stages.driver_features import DriverFeatures
from gpu_agent.stages.driver_reload import DriverUpgrade, Reload
from gpu_agent.daemon.reload_request import ReloadQueue, ReloadRequest
from gpu_agent.stages.owned_files import OwnedFiles
from gpu_agent.stages.toolkit import Toolkit
from gpu_agent.toolkit import distributions
from gpu_agent.toolkit.packages import PackageInstaller, SystemPackages
from gpu_agent.toolkit.services import ServiceControl, Systemd
from gpu_agent.toolkit.versions import Versions
from gpu_agent.state import AgentState

if TYPE_CHECKING:
    from gpu_agent.mps.control import MpsControl

log = logging.getLogger(__name__)

LOCK_PATH = "/run/gpu-agent/agent.lock"
MPS_CONTROL_ENV = "GPU_AGENT_MPS_CONTROL"
UNITS_ENV = "GPU_AGENT_UNITS"  # `host`: with --simulate, the units other than the runtimes are this system's
_SIM_POLL_S = 0.25
_DRIFT_POLL_S = 1.0
_LATE_POLL_S = 5.0  # where inotify cannot be had
_LIVENESS_POLL_S = 5.0  # how often liveness is looked at without systemd's watchdog
_STOP_BUDGET_S = 2.0  # SIGTERM to exit, whatever is blocked
RELOAD_GAP_S = 1.0  # SIGHUPs within this of the last reload are one reload, and one pass, after it
_WORKERS = 8


@dataclass
class Runtime:
    """What one-shot commands and the daemon share: the host, NVML, the state model and the engine."""

    root: Root
    nvml: Nvml
    loader: ModuleLoader
    services: ServiceControl
    packages: PackageInstaller
    state: AgentState
    engine: Engine
    machine: Optional[Any] = None  # the simulated machine, when there is one
    real_root_simulated: bool = False  # simulated GPUs over the real / : its runtimes and CUDA are real
    kube_budget: RequestBudget = field(default_factory=RequestBudget)  # the node's, whichever client spends it
    kube_api: Optional[ApiState] = None  # how the node's API requests go, whichever client sends them
    gpu_reset: Optional[GpuReset] = None  # resets one GPU for a pending MIG mode
    units: Optional[UnitControl] = None  # stops and starts the units MIG changes wait for
    plugin_gate: PluginGate = field(default_factory=PluginGate)  # holds the device plugin off (driver reload)
    versions: Optional[Versions] = None  # the runtimes' and the kubelet's versions, their --version runs cached
    console: Optional[ConsoleControl] = None  # binds the framebuffer console (a driver reload unbinds it)
    pci: Optional[PciControl] = None  # moves PCI functions between drivers (VFIO passthrough)
    timeslices: Optional[TimeSlices] = None  # sets a GPU's compute time-slice (DRA claims shared by TimeSlicing)

    @classmethod
    def build(cls, root: Root, loaded: LoadedConfig, simulate: Optional[str],
              clock: Optional[Callable[[], float]] = None) -> Runtime:
        """The real host (pynvml, modprobe), or a simulated machine kept under `root`. `clock`: the unix
        time of the engine's retries and the API's schedule (a test's own, to skip the waits); by default
        each one's time.time."""
        config = loaded.config
        loader: ModuleLoader
        services: ServiceControl
        packages: PackageInstaller
        machine = None
        real_root = root.is_running_system
        if simulate:
            from gpu_agent.sim.crash import arm_from_environment
            from gpu_agent.sim.kernel import SimConsole, SimModprobe
            from gpu_agent.sim.machine import MachineState
            from gpu_agent.sim.mig import SimGpuReset
            from gpu_agent.sim.packages import SimPackages
            from gpu_agent.sim.services import SimServices, SimUnits

            arm_from_environment()  # kill -9 trials
            machine = MachineState(root)
            machine.ensure(simulate)
            root = root.with_kernel(machine.kernel_dir)
            nvml = Nvml(_simulated_nvml(machine), config.nvml.call_timeout_seconds, root)
            loader = SimModprobe(machine, root, config.driver.modprobe_timeout_seconds)
            services = SimServices(machine, config.toolkit.restart_timeout_seconds)
            packages = SimPackages(machine, root)
            gpu_reset: GpuReset = SimGpuReset(machine)
            units: UnitControl = SimUnits(machine)
            if os.environ.get(UNITS_ENV) == "host":
                from gpu_agent.sim.services import HostUnits

                this_system = Root("/")  # the root given is this system bound again (docs/configuration.md)
                services = HostUnits(services, Systemd(this_system, config.toolkit.restart_timeout_seconds))
                units = Systemctl(this_system, config.toolkit.restart_timeout_seconds)
            console: ConsoleControl = SimConsole(machine)
            from gpu_agent.sim.pci import SimPciControl

            pci: PciControl = SimPciControl(machine)
            from gpu_agent.sim.timeslice import SimTimeSlices

            timeslices: TimeSlices = SimTimeSlices(machine)
        else:
            import pynvml

            nvml = Nvml(pynvml, config.nvml.call_timeout_seconds, root)
            loader = Modprobe(root, config.driver.modprobe_timeout_seconds)
            services = Systemd(root, config.toolkit.restart_timeout_seconds)
            packages = SystemPackages(root)
            gpu_reset = NvidiaSmiReset(root, config.mig.reset_timeout_seconds)
            units = Systemctl(root, config.toolkit.restart_timeout_seconds)
            console = SysfsConsole(root)
            pci = SysfsPci(root)
            timeslices = NvidiaSmiTimeSlices(root)
        from gpu_agent.kube.labels import machine_name

        state = AgentState(loaded, hardware=f"simulated {simulate}" if simulate else "real", machine=machine_name(root))
        gpu_reset = ResetHealsGpu(gpu_reset, state)
        engine = Engine([], state, config.reconcile, begin_pass=nvml.inventory.begin_pass, clock=clock)
        requests = RequestBudget(path=root(budget.PATH), clock=clock or time.time)
        runtime = cls(root, nvml, loader, services, packages, state, engine, machine,
                      real_root_simulated=bool(simulate) and real_root, gpu_reset=gpu_reset, units=units,
                      kube_budget=requests, kube_api=ApiState(requests, state.publish_kube_api, clock or time.time),
                      versions=Versions(root), console=console, pci=pci, timeslices=timeslices)
        if runtime.real_root_simulated:
            log.warning("simulated GPUs on the real root /: the toolkit stage and CUDA validation are off, "
                        "so the real container runtimes and CUDA library are left alone")
        runtime.engine.set_stages(runtime.stages(config))
        return runtime

    reload: Optional[Reload] = None  # the driver reload of the stages last built (`gpu-agent driver reload`)

    def request_reload(self, force: bool, timeout: Optional[float], abort_by: Optional[str] = None) -> Reload:
        """`gpu-agent driver reload`: the running stages' reload goes ahead whatever driver.reload says (or, with
        `abort_by`, the reload under way ends), with the driver-upgrade stage that finishes it. undo_request()
        when it is over."""
        stages = list(self.engine.stages)
        driver = next((stage for stage in stages if isinstance(stage, Driver)), None)
        if driver is None or driver.reload is None:
            raise AgentError("the driver stage is off (driver.enabled: false): the agent reloads no driver")
        reload = driver.reload
        reload.requested, reload.force, reload.abort_by = abort_by is None, force, abort_by
        if timeout is not None:
            reload.wait_seconds = timeout
        if not any(isinstance(stage, DriverUpgrade) for stage in stages):
            after = [i for i, stage in enumerate(stages) if stage.name not in ("labels", "owned-files")]
            stages.insert(max(after) + 1, DriverUpgrade(reload))
            self.engine.set_stages(stages)
        return reload

    @staticmethod
    def undo_request(reload: Reload) -> None:
        reload.requested = reload.force = False
        reload.abort_by = None
        reload.wait_seconds = reload.settings.reload_wait_seconds

    def _unit_active(self, unit: str) -> bool:
        found = self.services.state(unit)
        return found is not None and found.active in ("active", "activating", "reloading")

    def mps_control(self) -> MpsControl:
        """nvidia-cuda-mps-control: the simulated machine's, or the host's (its packaged units, through
        systemctl, when the agent is a systemd service). Simulated GPUs over the real / with
        GPU_AGENT_MPS_CONTROL=host get the host's too (docs/device-plugin.md)."""
        from gpu_agent.mps.control import CONTROL_TIMEOUT_S, HostMpsControl, under_systemd

        if self.machine is not None and not (self.real_root_simulated
                                             and os.environ.get(MPS_CONTROL_ENV) == "host"):
            from gpu_agent.sim.mps import SimMpsControl
            return SimMpsControl(self.machine, CONTROL_TIMEOUT_S)
        root = Root(self.root.path)  # the running kernel's /proc: a simulated machine's is not where daemons run
        return HostMpsControl(root, CONTROL_TIMEOUT_S, under_systemd(root, os.environ))

    def stages(self, config: AgentConfig) -> list[Stage]:
        """The enabled stages, in the order they run.

        The dependency rule: a stage requires another only when it cannot do its own work without that
        stage's result, never to wait for "the node to be ready". Discovery needs NVML to answer, not
        the driver stage to be ok: on a node whose driver works but whose driver stage fails (a missing
        /dev/char link, a feature module), /status and /metrics still show every GPU NVML sees, and
        /readyz names the failing stage. A stage that waits for a failed one reports `waiting`, never ok.
        """
        stages: list[Stage] = []
        may_change_gpus = self.root.is_running_system or self.machine is not None
        sink = None
        kube = dataclasses.replace(config.kubernetes,
                                   kubeconfig=distributions.kubeconfig(self.root, config.kubernetes.kubeconfig))
        api = kube.enabled is True or (kube.enabled == "auto" and resolve(self.root, kube.kubeconfig) is not None)
        if api or kube.nfd_feature_file:  # the NFD feature file is local: written with the API off too
            from gpu_agent.stages.labels import KubeSink

            state = self.state
            sink = KubeSink(self.root, state.readiness_of, lambda: state.config.config, kube, self.kube_budget, api=api,
                            api_state=self.kube_api)
        upgrade = None
        if config.driver.enabled:
            driver = config.driver
            if self.real_root_simulated:
                driver = dataclasses.replace(driver, validate_cuda=False)
            from gpu_agent.mps.reload import ReloadMps

            reload = self.reload = Reload(
                self.root, self.nvml, self.loader, self.loader if isinstance(self.loader, ModuleUnloader) else None,
                self.units, self._unit_active, driver, node=sink if sink and sink.api else None, gate=self.plugin_gate,
                console=self.console, mps=ReloadMps(self.root, self.mps_control(), self.nvml.inventory))
            stages.append(Driver(self.root, self.nvml, self.loader, driver, may_change_gpus, reload=reload))
            stages.append(DriverFeatures(self.root, self.loader, config.driver.modules))
            if driver.reload != "never" or (sink is not None and sink.api) or _recorded(reload):
                # Something to do: finish a reload (one `driver reload` began too), or tell the Node its upgrade
                # state (the label).
                upgrade = DriverUpgrade(reload)
        mig = config.mig
        if (mig.config or mig.follow_node_label) and may_change_gpus and self.gpu_reset and self.units:
            # Before discovery: the inventory, CDI spec and labels of the same pass see the new MIG devices.
            from gpu_agent.stages.mig import STATE_LABEL, Mig

            stages.append(Mig(self.root, self.nvml, self.gpu_reset, self.units, mig,
                              node_label=sink.node_label if sink and sink.api else None,
                              announce=(lambda state: sink.publish_label(STATE_LABEL, state)) if sink and sink.api
                              else None))
        vfio = self.vfio_stage(config, sink.cached_labels if sink and sink.api else None)
        if vfio is not None:
            stages.append(vfio)
        stages.append(Discovery(self.nvml, config.discovery))
        toolkit = config.toolkit if not self.real_root_simulated else dataclasses.replace(config.toolkit, enabled=False)
        versions = self.versions or Versions(self.root)
        stages.append(DevicePathStage(self.root, config.plugin, toolkit, versions,
                                      node_info=sink.node_info if sink is not None and sink.api else None))
        if config.toolkit.enabled and not self.real_root_simulated:
            stages.append(Toolkit(self.root, self.services, self.packages, config.toolkit, versions))
            if config.toolkit.cdi.enabled:
                stages.append(Cdi(self.root, config.toolkit.cdi, self.services, self.units))
        if upgrade is not None:
            stages.append(upgrade)
        if sink is not None:
            stages.append(sink)
        # Last: what the stages above no longer claim (or a stage turned off owned) is undone. Not for
        # simulated GPUs over the real /: its ledger is a real agent's.
        if not self.real_root_simulated:
            stages.append(OwnedFiles(self.root, self.services, {stage.name for stage in stages}, units=self.units))
        return stages


    def vfio_stage(self, config: AgentConfig, node: Optional[Callable[..., Any]] = None,
                   uninstall: bool = False) -> Optional[Stage]:
        """The vfio stage, where the node can change GPUs and something asks for it: a GPU's mode in config,
        the node's workload label (`node`: the Node's labels as last read, no request of its own), or a GPU
        the ledger says the agent passed through."""
        from gpu_agent.stages.vfio import Vfio

        workload = config.workload
        wanted = workload.mode != "container" or bool(workload.gpus) or (workload.follow_node_label and node)
        if self.pci is None or not (self.root.is_running_system or self.machine is not None):
            return None
        if not (wanted or uninstall or _passed_through(self.root)):
            return None
        from gpu_agent.mps.reload import ReloadMps

        label = (lambda key: node().get(key)) if node is not None else None
        return Vfio(self.root, self.nvml, self.loader, self.pci, workload, node_label=label, uninstall=uninstall,
                    gate=self.plugin_gate, mps=ReloadMps(self.root, self.mps_control(), self.nvml.inventory))


def _passed_through(root: Root) -> bool:
    """Whether the ledger says the agent passed GPUs through; a ledger that cannot be read may say so (the vfio
    stage then fails on it with its reason, as every stage that writes does)."""
    from gpu_agent.host.ledger import Ledger, LedgerError

    try:
        return bool(Ledger(root).vfio())
    except LedgerError:
        return True


SWITCH_RECHECK_S = 10.0  # how often a waiting change of plugin.api asks again which pods hold GPUs
DRA_REQUESTS_PER_MINUTE = 120  # claims read and slices written: a node starting a few dozen pods at once
BOTH_REQUESTS_PER_MINUTE = 6  # plugin.api both: the DeviceClasses, read once a minute


def _simulated_nvml(machine: Any) -> Any:
    """The fake NVML of a built-in profile or machine file; a captured node's replay (whose module, with
    its capture schema, costs a built-in profile 20 ms and 1 MiB) only for a capture."""
    if machine.read().get("capture"):
        from gpu_agent.sim.replay import simulated_nvml

        return simulated_nvml(machine)
    from gpu_agent.sim.fake import FakeNvml

    return FakeNvml(machine)


def take_lock(root: Root) -> IO[str]:
    """One agent per root: the daemon and `apply` hold this lock while they may change the host."""
    path = root(LOCK_PATH)
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read(32).strip() or "unknown"  # a pid; the file is not trusted to hold only that
        handle.close()
        raise AgentError(
            f"another gpu-agent (pid {holder}) is running on root {root.path} and holds {path}; "
            "to make it re-apply now use `systemctl reload gpu-agent`"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class Daemon:
    def __init__(self, runtime: Runtime, config_path: Path, config_required: bool) -> None:
        from gpu_agent.health.checks import HealthChecks
        from gpu_agent.health.xid import XidWatcher
        from gpu_agent.daemon.http import HttpServer, build_app
        from gpu_agent.metrics.exporter import AgentCollector, make_registry
        from gpu_agent.daemon.notify import Notifier
        from gpu_agent.metrics.pods import PodLabels
        from gpu_agent.metrics.sampler import Sampler

        self.runtime = runtime
        self.state = runtime.state
        self.config_path = config_path
        self.config_required = config_required
        self.notifier = Notifier()
        self.sampler = Sampler(runtime.nvml, self.state, runtime.root, lambda: runtime.plugin_gate.leaving)
        self.collector = AgentCollector(self.state, lambda: runtime.nvml.session.timeouts,
                                        self.config.metrics.hostname)
        self.pod_labels = PodLabels(runtime.root, lambda: self.state.inventory,
                                    self.state.publish_pods,
                                    lambda: self.config.metrics.pod_labels,
                                    lambda: self.config.metrics.sample_interval_seconds,
                                    metadata=self._pod_metadata)
        self._metadata: Optional[tuple[tuple[Any, ...], Any]] = None  # (its settings, metrics.pod_metadata.PodMetadata)
        self.registry = make_registry(self.collector)
        self.http = HttpServer(build_app(self.state, self.registry, self.stalled), runtime.root, self._http_error)
        self.xids = XidWatcher(runtime.nvml, self.state, self._after_xid)
        self.health_checks = HealthChecks(runtime.nvml, self.state)
        self._wake = asyncio.Event()
        self._driver_reloads = ReloadQueue(runtime.root, self._begin_driver_reload, runtime.undo_request)
        self._sample_now = asyncio.Event()
        self._force = False
        self._stopping = asyncio.Event()
        self._exit_status = 0
        self._reload_requested = False
        self._last_reload = -RELOAD_GAP_S  # when the last reload began (the loop's clock)
        self._reload_due: Optional[asyncio.TimerHandle] = None  # the reload SIGHUPs within the gap wait for
        self._last_ready: Optional[bool] = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._passed_at = time.monotonic()  # when the last pass completed (the start, before the first)
        self.plugin: Optional[Any] = None  # the device plugin, started once wanted (plugin/service.py)
        self._plugin_task: Optional[asyncio.Task[Any]] = None
        self.dra: Optional[Any] = None  # the DRA kubelet plugin while plugin.api serves through DRA (dra/service.py)
        self._dra_checkpoint: Optional[Any] = None  # its claims, for /status while it does not run
        self._dra_checkpoint_stamp: Optional[Stamp] = None
        self._switch_task: Optional[asyncio.Task[Any]] = None  # asks who holds GPUs before plugin.api changes
        self._both_task: Optional[asyncio.Task[Any]] = None  # plugin.api both: reads the DeviceClasses (dra/extended)
        self._both_key: Optional[tuple[Any, ...]] = None  # the settings it reads them with
        self._both_asked = False  # whether they were looked at once (answered or not) since both was configured
        self._dra_task: Optional[asyncio.Task[Any]] = None
        self._dra_key: Optional[tuple[Any, ...]] = None  # the settings it was built with
        self.mps: Optional[Any] = None  # the MPS control daemons' watch, started once sharing.mps asks (mps/)
        self._mps_looked = False  # whether the ledger was looked at for an earlier process's MPS daemons

    @property
    def config(self) -> AgentConfig:
        return self.state.config.config

    # --- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._loop.set_default_executor(DaemonThreadPool(_WORKERS, "stage"))
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(signum, self._stopping.set)
        self._loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        loop = self._loop
        jail = sandbox.Sandbox(self.runtime.root, sandbox.in_systemd_unit(self.runtime.root, os.environ),
                               lambda: loop.call_soon_threadsafe(self._restart_for_sandbox))
        sandbox.install(jail)
        try:
            return await self._run(jail)
        finally:
            sandbox.install(None)

    async def _run(self, jail: sandbox.Sandbox) -> int:
        await self.http.start(self.config.http)
        self._tasks = [asyncio.create_task(self._sample_loop(), name="sampler"),
                       asyncio.create_task(self.pod_labels.run(), name="pod-labels")]
        self._tasks.append(asyncio.create_task(self._watchdog_loop(self.notifier.watchdog_interval()),
                                               name="watchdog"))
        if self.runtime.machine is not None:
            self._tasks.append(asyncio.create_task(self._watch_simulator(self.runtime.machine), name="simulator"))
        self._tasks.append(asyncio.create_task(self._watch_files(), name="drift"))
        if jail.systemd:
            self._tasks.append(asyncio.create_task(self._watch_late_directories(), name="late directories"))
        self._ensure_plugin()
        reconciler = asyncio.create_task(self._reconcile_loop(), name="reconcile")
        self._tasks.append(reconciler)
        await self._stopping.wait()
        return await self._shutdown()

    async def _shutdown(self) -> int:
        """Within _STOP_BUDGET_S whatever is blocked: in-flight work is cancelled, and a worker thread
        stuck in a hung call is abandoned (workers.py), not waited for."""
        log.info("stopping")
        self.notifier.stopping()
        if self._reload_due is not None:
            self._reload_due.cancel()
        self.xids.stop()
        for task in self._tasks:
            task.cancel()
        step = _STOP_BUDGET_S / 4
        _, pending = await asyncio.wait(self._tasks, timeout=step)
        if pending:
            log.warning("stopping without waiting for %s", ", ".join(t.get_name() for t in pending))
        await self.http.stop()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.runtime.nvml.close), timeout=step)
        except asyncio.TimeoutError:
            log.warning("stopping without waiting for NVML to shut down (a call into the driver is hung)")
        log.info("stopped")
        return self._exit_status

    def _restart_for_sandbox(self) -> None:
        """A directory appeared after start, read-only in the unit's sandbox (host/sandbox.py): exit, so that
        systemd starts the agent again with it writable."""
        self._exit_status = sandbox.EXIT_RESTART
        self._stopping.set()

    def _loop_alive(self) -> bool:
        return any(t.get_name() == "reconcile" and not t.done() for t in self._tasks)

    def _http_error(self, error: Optional[str]) -> None:
        """http.listen cannot be bound (or can again): shown in /status."""
        self.state.http_error = error
        self.state.published += 1  # /status renders again

    def stalled(self) -> Optional[str]:
        """Why the daemon is not live (liveness.py): its reconcile loop ended, or no pass completed within
        the bound; None while passes complete."""
        if not self._loop_alive():
            return "reconcile loop stopped"
        return liveness.stalled(self.config, self._passed_at, self.runtime.engine.running, *self._bound_by())

    def _bound_by(self) -> tuple[int, bool]:
        """What the liveness bound depends on beside the config: the GPUs, and whether a driver reload runs."""
        inventory = self.state.inventory
        return len(inventory.gpus) if inventory else liveness.DEFAULT_GPUS, self._driver_reloads.under_way

    # --- reconcile -------------------------------------------------------------------------------

    def trigger(self, force: bool = False) -> None:
        self._force = self._force or force
        self._wake.set()

    def _request_reload(self) -> None:
        """SIGHUP: a pass, forced only when the file holds a new config (see _reconcile_once). An unchanged
        file never bypasses a stage's backoff: a storm of SIGHUPs restarts no failing runtime. SIGHUPs are
        coalesced: one within RELOAD_GAP_S of the last reload waits for the gap's end, with any others."""
        self._reload_requested = True
        if self._reload_due is not None:
            return  # one reload waits already: it reads the file as it is then
        loop = asyncio.get_running_loop()
        wait = self._last_reload + RELOAD_GAP_S - loop.time()
        if wait <= 0:
            self.trigger()
        else:
            self._reload_due = loop.call_later(wait, self._reload_gap_over)

    def _reload_gap_over(self) -> None:
        self._reload_due = None
        if self._reload_requested:  # not taken by a pass that something else started meanwhile
            self.trigger()

    async def _reconcile_loop(self) -> None:
        first = True
        while True:
            try:
                await self._reconcile_once(first)
                first = False
            except Exception:  # a bug: log it and keep the loop (and so the watchdog) alive
                log.exception("reconcile loop iteration failed; this is a gpu-agent bug")
                await asyncio.sleep(self.config.reconcile.backoff_initial_seconds)
                continue
            await self._sleep_until_next()

    async def _reconcile_once(self, first: bool) -> None:
        reloading = self._reload_requested
        if reloading:
            self._reload_requested = False
            self._last_reload = asyncio.get_running_loop().time()
            if await self._reload():
                self._force = True  # a new config applies now; the engine still holds a failed restart's change
        if self._driver_reloads.take():  # `gpu-agent driver reload` (reload_request.py): begun in this pass, forced
            self._force = True
        force, self._force = self._force, False
        self._wake.clear()
        started = time.monotonic()
        runs = await self.runtime.engine.reconcile(force=force or first)
        self._passed_at = time.monotonic()
        if self._driver_reloads.conclude(runs):  # one that waited for the end of the one under way begins
            self.trigger(force=True)
        if first:
            await asyncio.to_thread(self.sampler.sample)
            await asyncio.to_thread(self.xids.start)
            self._tasks.append(asyncio.create_task(self._check_loop(), name="health-checks"))
            self.state.first_reconcile_done = True
            # What start-up built (modules, config models, stages) lives as long as the process: keep
            # it out of every garbage collection, so that a full one takes a millisecond, not 50.
            gc.freeze()
            give_back()  # what start-up freed (config parsing, the first pass) leaves the resident set
            log.info("first reconcile done in %.2f s: %s", time.monotonic() - started, self.state.summary_line())
        if first or reloading:
            self.notifier.ready(self.state.summary_line())
        if first:  # what the first scrape needs (psutil's process), made beside the loop, after READY
            asyncio.get_running_loop().run_in_executor(None, self.registry.prepare)
        self.publish()

    def _begin_driver_reload(self, request: ReloadRequest) -> Reload:
        return self.runtime.request_reload(request.force, request.timeout, request.abort)

    async def _sleep_until_next(self) -> None:
        now = time.time()
        deadline = now + self.config.reconcile.interval_seconds
        retry = self.runtime.engine.next_retry()
        if retry is not None:
            deadline = min(deadline, retry)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, deadline - now))
        except asyncio.TimeoutError:
            pass

    async def _reload(self) -> bool:
        """Load the config file again and switch to it; any failure keeps the running config and is
        shown as the reload error in /status, never a crash of the loop. True when a new config runs."""
        self.notifier.reloading()
        self._both_key = None  # plugin.api both: a reload looks at the DeviceClasses again, at once
        try:
            loaded = await asyncio.to_thread(reload_config, self.config_path, self.config_required, self.state.config)
            if loaded is None:
                self.state.config_error = None
                log.info("reloading configuration from %s: the file is unchanged; keeping configuration %s",
                         self.config_path, self.state.config.digest[:19])
                return False
            log.info("reloading configuration from %s", self.config_path)
            stages = self._stages_for(loaded.config)
            await self.http.restart(loaded.config.http)
        except AgentError as exc:
            self._reject_reload(str(exc))
        except Exception as exc:  # a gpu-agent bug; the previous config is still whole, so keep it
            log.exception("configuration reload failed; this is a gpu-agent bug")
            self._reject_reload(f"{self.config_path}: reload failed with an internal error "
                                f"({type(exc).__name__}); see the agent's log")
        else:
            self._apply_config(loaded, stages)
            return True
        return False

    def _reject_reload(self, reason: str) -> None:
        self.state.config_error = reason
        log.error("configuration reload rejected, still running the previous one: %s", reason)

    def _stages_for(self, config: AgentConfig) -> list[Stage]:
        """The stages `config` asks for; one whose settings did not change is kept, with what it knows
        (the sink's cached Node)."""
        kept = {stage.name: stage for stage in self.runtime.engine.stages}
        return [kept[new.name] if new.name in kept and _same_stage(kept[new.name], new) else new
                for new in self.runtime.stages(config)]

    def _pod_metadata(self) -> Any:
        """Where the pods holding GPUs are read from the Kubernetes API (their UIDs and labels), while a
        metrics setting needs them: with the node's credentials, on the node's request budget, apart from
        the Node's own requests' retry schedule (a pod list refused does not hold back the Node's labels)."""
        metrics, kube = self.config.metrics, self.config.kubernetes
        if not (metrics.pod_uid or metrics.pod_kubernetes_labels or metrics.virtual_gpus):
            return None
        key = (kube.kubeconfig, kube.node_name, kube.request_timeout_seconds)
        if self._metadata is None or self._metadata[0] != key:
            from gpu_agent.kube.client import KubeClient
            from gpu_agent.metrics.pod_metadata import PodMetadata

            client = KubeClient(self.runtime.root, kube.kubeconfig, kube.request_timeout_seconds,
                                self.runtime.kube_budget)
            node = kube.node_name or socket.gethostname().strip().lower()  # as the labels stage names the Node
            self._metadata = (key, PodMetadata(lambda limit: client.list_pods(node, limit)))
        return self._metadata[1]

    def _apply_config(self, loaded: LoadedConfig, stages: list[Stage]) -> None:
        config = loaded.config
        runtime = self.runtime
        self.state.config, self.state.config_error = loaded, None
        self.state.config_loaded_at = time.time()
        runtime.nvml.session.call_timeout = config.nvml.call_timeout_seconds
        runtime.engine.settings = config.reconcile
        runtime.engine.set_stages(stages)
        self.collector.hostname = config.metrics.hostname or self.collector.hostname
        self.pod_labels.reconfigured()
        logging.getLogger().setLevel(config.log_level.upper())
        log.info("configuration %s loaded from %s", loaded.digest[:19], loaded.source)

    # --- outputs and watchers --------------------------------------------------------------------

    def publish(self) -> None:
        self.state.published += 1
        self._ensure_mps()
        self._ensure_both_check()
        self._ensure_api()
        self._ensure_plugin()
        if self.plugin is not None:
            self.plugin.wake()  # health, MIG and inventory changes reach ListAndWatch now
        self._ensure_dra()
        if not self.state.first_reconcile_done:
            return
        self.notifier.status(self.state.summary_line())
        ready = self.state.ready
        if ready != self._last_ready:
            self._last_ready = ready
            self.trigger()  # the sinks tell Kubernetes within seconds

    def _ensure_mps(self) -> None:
        """The MPS control daemons' watch, beside the plugin: started when sharing.mps or a prepared DRA claim
        first asks for a daemon, or at the first publish when the ledger holds an earlier process's daemons (a
        config that no longer asks for them), then kept (it stops the daemons no longer asked for)."""
        if self.mps is not None:
            self.mps.wake()
            return
        if self.config.plugin.sharing.mps is None and not self.state.claim_mps:
            if self._mps_looked:
                return
            self._mps_looked = True
            from gpu_agent.host.ledger import Ledger

            try:
                ledger = Ledger(self.runtime.root)
                if not ledger.mps_directories() and not ledger.compute_modes():
                    return
            except AgentError as exc:  # the ledger's own problem, which the stages report
                log.warning("cannot tell whether MPS control daemons of an earlier gpu-agent are left: %s", exc)
                return
        from gpu_agent.mps.daemons import MpsManager

        self.mps = MpsManager(self.runtime.root, self.state, self.runtime.mps_control(), self.runtime.nvml.inventory,
                              self.publish)
        self._tasks.append(asyncio.create_task(self.mps.run(), name="mps"))

    def _ensure_plugin(self) -> None:
        """The device plugin runs beside the reconcile loop, never inside it: a failure there is logged
        and the service started again on the next publish, and the daemon goes on."""
        if self._plugin_task is not None and not self._plugin_task.done():
            return
        if self._plugin_task is not None and not self._plugin_task.cancelled() and self._plugin_task.exception():
            log.error("device plugin stopped: %s; starting it again", self._plugin_task.exception())
        if not plugin_wanted(self.runtime.root, self.config.plugin):
            return
        from gpu_agent.plugin.service import DevicePluginManager  # grpclib: only when on

        if self.plugin is None:
            self.plugin = DevicePluginManager(self.runtime.root, self.state, self.runtime.plugin_gate)
            loop = asyncio.get_running_loop()

            def from_any_thread() -> None:
                loop.call_soon_threadsafe(self.publish)

            self.runtime.plugin_gate.listener = from_any_thread
        self._plugin_task = asyncio.create_task(self.plugin.run(), name="device-plugin")
        self._tasks.append(self._plugin_task)

    def _ensure_api(self) -> None:
        """plugin.api as configured, once no pod holds a GPU of the API serving now (dra/switch.py); until then
        the node goes on serving through it and /status api.switch says why."""
        from gpu_agent.dra import switch

        state = self.state
        wanted = state.wanted_api()
        serving = state.serving_api
        if serving is None or serving == wanted or switch.switch_now(serving, wanted):
            state.serving_api, state.api_switch = wanted, None
            return
        if self._switch_task is not None and not self._switch_task.done():
            return

        if state.api_switch is None:
            state.api_switch = f"plugin.api {wanted} waits: asking which pods hold GPUs of {serving}"
        self._switch_task = asyncio.create_task(self._switch_api(serving, wanted), name="api-switch")
        self._tasks.append(self._switch_task)

    async def _switch_api(self, serving: str, wanted: str) -> None:
        """Asks every SWITCH_RECHECK_S who holds GPUs of `serving` until none does (then switches) or the
        configuration asks for something else."""
        from gpu_agent.dra import switch

        state = self.state
        while state.wanted_api() == wanted and state.serving_api == serving:
            try:
                held_by = await switch.holders(self.runtime.root, serving)
            except Exception as exc:  # the kubelet's silence or refusal, an unreadable checkpoint: keep serving
                state.api_switch = switch.waiting(serving, wanted, [], f"{type(exc).__name__}: {exc}"[:300])
            else:
                if not held_by:
                    log.info("plugin.api: switching from %s to %s: no pod holds a GPU", serving, wanted)
                    state.serving_api, state.api_switch = wanted, None
                    break
                state.api_switch = switch.waiting(serving, wanted, held_by)
            self.state.published += 1  # /status shows the wait
            await asyncio.sleep(SWITCH_RECHECK_S)
        self.publish()

    def _ensure_both_check(self) -> None:
        """While plugin.api is both, whether the cluster serves nvidia.com/gpu through DRA, read now and every
        extended.RECHECK_S with the node's credentials (state.both; state.wanted_api decides from it)."""
        kube = self.config.kubernetes
        key = (kube.kubeconfig, kube.request_timeout_seconds)
        wanted = configured_api(self.config.plugin, self.config.dra) == "both"
        running = self._both_task is not None and not self._both_task.done()
        if running and (not wanted or key != self._both_key):
            assert self._both_task is not None
            self._both_task.cancel()
            if self._both_task in self._tasks:
                self._tasks.remove(self._both_task)
            self._both_task, running = None, False
        if not wanted:
            self.state.both, self._both_asked = None, False
        if wanted and not running:
            from gpu_agent.kube.client import KubeClient

            client = KubeClient(self.runtime.root, kube.kubeconfig, kube.request_timeout_seconds,
                                RequestBudget(per_minute=BOTH_REQUESTS_PER_MINUTE))
            self._both_task, self._both_key = asyncio.create_task(self._check_both(client), name="api-both"), key
            self._tasks.append(self._both_task)

    async def _check_both(self, client: Any) -> None:
        from gpu_agent.dra import extended

        while True:
            try:
                verdict = await asyncio.to_thread(extended.check, client)
            except AgentError as exc:  # the kubeconfig unreadable: no answer, as an unreachable apiserver
                log.warning("plugin.api both: the DeviceClasses cannot be read: %s", exc)
                verdict = None
            publish = not self._both_asked  # the DRA plugin waited for this first look
            if verdict is not None and verdict != self.state.both:
                if verdict.device_class is not None:
                    log.info("plugin.api both: DeviceClass %s serves %s through DRA", verdict.device_class,
                             extended.EXTENDED_RESOURCE)
                else:
                    log.warning("plugin.api both refused, serving device-plugin: %s", verdict.refused)
                self.state.both, publish = verdict, True
            if publish:
                self._both_asked = True
                self.publish()
            await asyncio.sleep(extended.RECHECK_S)

    def _ensure_dra(self) -> None:
        """The DRA plugin while plugin.api serves through DRA, beside the device plugin (which then advertises
        nothing), with the node's credentials and a request budget of its own (a pod's claims are not held
        back by the labels' budget, nor the labels by a burst of claims); built again when the kubeconfig or
        node name change."""
        kube = self.config.kubernetes
        key = (kube.kubeconfig, kube.node_name, kube.request_timeout_seconds)
        running = self._dra_task is not None and not self._dra_task.done()
        wanted = serves_dra(self.state.serving())
        if running and (not wanted or key != self._dra_key):
            assert self._dra_task is not None
            self._dra_task.cancel()  # its servers close and its sockets go: the kubelet deregisters it
            self._dra_task, self.dra, running = None, None, False
        if self._dra_task is not None and self._dra_task.done() and not self._dra_task.cancelled() \
                and self._dra_task.exception():
            log.error("DRA plugin stopped: %s; starting it again", self._dra_task.exception())
        if running:
            assert self.dra is not None
            self.dra.wake()
            return
        node = kube.node_name or socket.gethostname().strip().lower()  # as the labels stage names the Node
        if not wanted:
            self._publish_dra_off(node)
            return
        if self.state.serving() == "both" and self.state.both is None and not self._both_asked:
            return  # the first look at the DeviceClasses decides whether both holds: nothing is served before it
        from gpu_agent.dra.service import DraManager  # grpclib: only when on
        from gpu_agent.kube.client import KubeClient

        client = KubeClient(self.runtime.root, kube.kubeconfig, kube.request_timeout_seconds,
                            RequestBudget(per_minute=DRA_REQUESTS_PER_MINUTE))
        loop = asyncio.get_running_loop()
        self.dra, self._dra_key = DraManager(self.runtime.root, self.state, client, node,
                                             mps_wanted=lambda: loop.call_soon_threadsafe(self.publish),
                                             gpus=(self.runtime.nvml.inventory, self.runtime.timeslices)
                                             if self.runtime.timeslices else None), key
        self._dra_task = asyncio.create_task(self.dra.run(), name="dra")
        self._tasks.append(self._dra_task)

    def _publish_dra_off(self, node: str) -> None:
        """/status dra while the DRA plugin does not run (plugin.api device-plugin): the devices its pool would
        publish, and the claims its checkpoint still holds (prepared before the node switched back); nothing
        is served or published. The checkpoint is read again only when its file changed."""
        from gpu_agent.dra.claims import CHECKPOINT, Checkpoint
        from gpu_agent.dra.devices import DRIVER, published

        path = self.runtime.root(CHECKPOINT)
        stamp = stamp_of(path)
        if self._dra_checkpoint is None or stamp != self._dra_checkpoint_stamp:
            self._dra_checkpoint, self._dra_checkpoint_stamp = Checkpoint(path), stamp
            if stamp is not None:
                self._dra_checkpoint.load()
        inventory = self.state.inventory
        self.state.publish_dra({
            "driver": DRIVER, "pool": node, "running": False,
            "reason": f"plugin.api serves the node through {self.state.serving()}: the DRA plugin does not run, "
                      "its pool is not published",
            "devices": [device.to_json() for device in published(inventory, self.state.health_of(inventory))],
            "prepared_claims": self._dra_checkpoint.to_json(),
            "checkpoint_error": self._dra_checkpoint.error,
        })

    def _after_xid(self) -> None:
        """From the XID watcher's thread: publish, and sample now, so a GPU an XID took off the bus is
        seen not answering before it can come back (recovery is seeing it gone, then back)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.publish)
            self._loop.call_soon_threadsafe(self._sample_now.set)

    async def _sample_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._sample_now.wait(), self.config.metrics.sample_interval_seconds)
            self._sample_now.clear()
            await self._sample()

    async def _sample(self) -> None:
        before = self._not_answering()
        try:
            await asyncio.to_thread(self.sampler.sample)
        except Exception:  # a bug: log it, keep sampling
            log.exception("sampling GPU metrics failed; this is a gpu-agent bug")
        now = self._not_answering()
        if now != before:  # discovery reads a GPU that stopped answering, or answers again, now: not in a minute
            self.trigger(force=bool(before - now))  # one back: the stages that failed on it try again at once
        self.publish()

    def _not_answering(self) -> set[str]:
        """The GPUs off the bus (XID 79) or whose NVML queries fail, by UUID."""
        return {uuid for uuid, health in self.state.health.items() if health.lost or health.query_error}

    async def _check_loop(self) -> None:
        """The periodic health checks; a hung NVML call fails them after its timeout, on a worker thread."""
        while True:
            try:
                await asyncio.to_thread(self.health_checks.run)
            except Exception:  # a bug: log it, keep checking
                log.exception("periodic GPU health checks failed; this is a gpu-agent bug")
            self.publish()
            await asyncio.sleep(self.config.health.check_interval_seconds)

    async def _watchdog_loop(self, interval: Optional[float]) -> None:
        """Pings systemd's watchdog (every `interval` s, when it watches) only while the daemon is live:
        passes complete (liveness.py). Says once when they stop, and when they resume. Without the watchdog
        it wakes when the bound would pass, not periodically (then every _LIVENESS_POLL_S until it is live)."""
        said: Optional[str] = None
        while True:
            problem = self.stalled()
            if problem is None:
                if said is not None:
                    log.warning("reconcile passes complete again%s", "; watchdog pings resume" if interval else "")
                said = None
                if interval:
                    self.notifier.watchdog()
            elif said is None:
                said = problem
                log.error("%s%s", problem, "; no more watchdog pings, systemd will restart the agent" if interval
                          else "; /healthz fails")
            if interval:
                await asyncio.sleep(interval)
            else:
                due = self._passed_at + liveness.bound(self.config, *self._bound_by()) - time.monotonic()
                await asyncio.sleep(_LIVENESS_POLL_S if said is not None else max(_LIVENESS_POLL_S, due))

    async def _watch_files(self) -> None:
        """Files the stages manage, rewritten by someone else: reconcile within seconds, not minutes.

        The agent's own writes (a runtime's files restored after a failed restart) are no drift. A
        drift pass respects a failing stage's backoff: a runtime that does not come back is retried
        as the backoff allows, not each time its files change. Only a new config (SIGHUP) forces a pass."""
        def stamps() -> dict[str, Optional[Stamp]]:
            return {path: stamp_of(self.runtime.root(path))
                    for stage in self.runtime.engine.stages for path in stage.watched()}

        changes = FileChanges("drift watch", _DRIFT_POLL_S)
        try:
            changes.watch_for(self.runtime.root(path) for path in stamps())
            last = stamps()
            while True:
                await changes.wait()
                changes.watch_for(self.runtime.root(path) for path in stamps())  # the stages may have changed
                now = stamps()
                changed = sorted(path for path, stamp in now.items()
                                 if stamp != last.get(path, stamp)
                                 and not written_by_us(self.runtime.root(path), stamp))
                if changed:
                    log.info("%s changed on disk; reconciling", ", ".join(changed))
                    self.trigger()
                last = now
        finally:
            changes.close()

    async def _watch_late_directories(self) -> None:
        """Under the unit: a directory it would have made writable (host/sandbox.py) appearing wakes the
        stages and the device plugin now, so that their first write there finds it read-only and the agent
        restarts within seconds, not at the next pass."""
        def missing() -> list[str]:
            return [d for d in sandbox.LATE_WRITABLE if not self.runtime.root(d).is_dir()]

        changes = FileChanges("sandbox watch", _LATE_POLL_S)
        try:
            waiting = missing()
            while waiting:
                changes.watch_for(self.runtime.root(d) for d in waiting)
                await changes.wait()
                now = missing()
                appeared = [d for d in waiting if d not in now]
                if appeared:
                    log.info("%s appeared; reconciling", ", ".join(appeared))
                    self.trigger(force=True)
                    self.publish()
                waiting = now
        finally:
            changes.close()

    async def _watch_simulator(self, machine: Any) -> None:
        """A change to the simulated machine made by someone else (`gpu-agent sim`) is like a
        hardware event: resample and reconcile now. The agent's own writes (a fault used up) are not."""
        changes = FileChanges("simulator watch", _SIM_POLL_S)
        try:
            changes.watch_for([machine.path])
            last = machine.stamp()
            while True:
                await changes.wait()
                stamp = machine.stamp()
                if stamp != last and not written_by_us(machine.path, stamp):
                    await self._sample()
                    self.trigger(force=True)
                last = stamp
        finally:
            changes.close()


def _recorded(reload: Reload) -> bool:
    """Whether the ledger records a reload (one `gpu-agent driver reload` began); a ledger that cannot be read
    is the driver stage's to report."""
    try:
        return reload.progress() is not None
    except AgentError:
        return False


def _same_stage(old: Stage, new: Stage) -> bool:
    same_settings = getattr(old, "settings", None) == getattr(new, "settings", new)
    return same_settings and tuple(old.requires) == tuple(new.requires)


def run_daemon(root: Root, loaded: LoadedConfig, config_path: Path, config_required: bool,
               simulate: Optional[str]) -> int:
    limit_arenas()  # before the worker threads start
    lock = take_lock(root)
    try:
        log.info("gpu-agent %s starting: root=%s config=%s%s", __version__, root.path, loaded.source,
                 f" simulate={simulate}" if simulate else "")
        runtime = Runtime.build(root, loaded, simulate)

        async def main() -> int:
            # Built inside the running loop: asyncio objects must belong to it (Python 3.9).
            return await Daemon(runtime, config_path, config_required).run()

        return asyncio.run(main())
    finally:
        lock.close()
