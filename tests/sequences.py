"""One simulated node and the agent on it, in this process, for the property test over sequences
(test_property_sequences.py): the world's events (a driver installed, a reboot, a GPU lost, NVML failing, a
process, a refused rmmod, the kubelet restarting, an administrator's cordon, `gpu-agent driver reload --abort`)
and the agent's answer to each, as its daemon gives it: the XID events taken, the GPUs sampled, a reconcile pass,
the MPS control daemons synced. The agent's clock is a FakeClock that moves a minute between two events (the API
budget, the stages' backoff and the reload's wait all see it); nothing sleeps.

What the agent does to the node is watched as it does it (Watch: every rmmod, unit stop and start, MPS quit), so
that an invariant about a path (never unloads the installed driver, never quits a daemon without an inventory)
is checked at the moment, not guessed afterwards. "kill -9" drops the agent's objects without any cleanup, at a
point of the pass or between two, and a new agent is built over the same root."""
from __future__ import annotations

import asyncio
import shutil
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from gpu_agent.config import load_config
from gpu_agent.config.loader import reload_config
from gpu_agent.daemon.app import Daemon, Runtime
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps.daemons import MpsManager, Timing, held_by_reload, wanted_daemons
from gpu_agent.sim import mps as sim_mps
from gpu_agent.sim.kernel import SimModprobe, loaded_version
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mps import SimMpsControl
from gpu_agent.sim.services import SimUnits
from gpu_agent.stages import driver_reload
from harness import FakeClock, SimNode, run_cli

MACHINE = str(Path(__file__).parent / "data/machines/property-2x-h100.yaml")
NODE = "gpu-node-1"
OLD, NEW, NEWER = "550.90.07", "570.124.06", "575.51.03"
PERSISTENCED = "nvidia-persistenced.service"
RESOURCE = "nvidia.com/gpu"
KUBECONFIG = "/etc/kubernetes/kubelet.conf"
POD_RESOURCES = "var/lib/kubelet/pod-resources/kubelet.sock"
DEVICE_PLUGINS = "var/lib/kubelet/device-plugins"
AT_ONCE = Timing(poll_s=0.05, probe_s=0.0, backoff_s=(0.0, 0.0))  # each sync reads the daemons back, no backoff
STEP_S = 61.0  # the agent's time between two events: past the API budget's minute and the stages' backoff


class Killed(BaseException):
    """kill -9: nothing after this point of the pass runs, no handler sees it."""


@dataclass(frozen=True)
class Settings:
    """The config the operator gives the agent; a SIGHUP switches to another one."""

    replicas: int = 2  # plugin.sharing.mps for nvidia.com/gpu; 0: no MPS
    reload: str = "when-idle"
    unready_when: str = "all"
    firmware: int = 0  # driver.parameters nvidia NVreg_EnableGpuFirmware: a module option that needs a reload

    def document(self) -> dict[str, Any]:
        plugin: dict[str, Any] = {"enabled": True}
        if self.replicas:
            plugin["sharing"] = {"mps": {"resources": [{"name": RESOURCE, "replicas": self.replicas}]}}
        return {"version": "v1", "toolkit": {"enabled": True}, "mig": {}, "plugin": plugin,
                "driver": {"reload": self.reload, "reload_wait_seconds": 600,
                           "parameters": {"nvidia": {"NVreg_EnableGpuFirmware": self.firmware}}},
                "health": {"unready_when": self.unready_when},
                "kubernetes": {"enabled": True, "node_name": NODE, "kubeconfig": KUBECONFIG}}


@dataclass
class Watch:
    """What the agent did to the node, as it did it, and the rules it broke then (each a sentence)."""

    world: Optional[World] = None
    acting: bool = False  # the agent (or a command of it) runs: what happens now is its doing
    stopped_units: set[str] = field(default_factory=set)  # stopped by the agent and not started since
    unloaded: set[str] = field(default_factory=set)  # unloaded by the agent and not loaded since
    broken: list[str] = field(default_factory=list)
    quits: set[str] = field(default_factory=set)  # MPS resources whose daemon the agent quit, since looked at
    starts: set[str] = field(default_factory=set)  # and started
    kill_in: Optional[int] = None  # kill -9 at this many points of the agent's from now

    def point(self) -> None:
        """A point of the pass where the agent may be killed: after each step it records or takes."""
        if self.acting and self.kill_in is not None:
            self.kill_in -= 1
            if self.kill_in <= 0:
                self.kill_in = None
                raise Killed

    def unloading(self, module: str) -> None:
        world = self.world
        if world is None or not self.acting:
            return
        state = world.machine.read()
        loaded, installed = loaded_version(state, "nvidia"), state.get("driver_version")
        if loaded is not None and loaded == installed:
            self.broken.append(f"unloaded {module} while the loaded driver {loaded} is the installed one, unasked")


WATCH = Watch()


def install_watch(patch: Any) -> Watch:
    """Wrap the simulator's modprobe, units and MPS control so that WATCH sees what the agent does (`patch`: a
    pytest MonkeyPatch, undone after the test)."""
    load, unload, units, start, send, terminate = (SimModprobe.load, SimModprobe.unload, SimUnits.__call__,
                                                   SimMpsControl.start, SimMpsControl.send, SimMpsControl.terminate)
    save = Ledger.save_driver_reload

    def loading(self: SimModprobe, module: str) -> None:
        load(self, module)
        if WATCH.acting:
            WATCH.unloaded.discard(module)
        WATCH.point()

    def unloading(self: SimModprobe, module: str) -> None:
        WATCH.unloading(module)
        unload(self, module)
        if WATCH.acting:
            WATCH.unloaded.add(module)
        WATCH.point()

    def unit(self: SimUnits, verb: str, name: str) -> None:
        units(self, verb, name)
        if WATCH.acting:
            (WATCH.stopped_units.add if verb == "stop" else WATCH.stopped_units.discard)(name)
        WATCH.point()

    def starting(self: SimMpsControl, spec: Any) -> None:
        start(self, spec)
        if WATCH.acting:
            WATCH.starts.add(spec.resource)
        WATCH.point()

    def sending(self: SimMpsControl, spec: Any, command: str) -> str:
        if command.split()[:1] == ["quit"]:
            stopping(spec.resource)
        return send(self, spec, command)

    def terminating(self: SimMpsControl, spec: Any) -> None:
        stopping(spec.resource)
        terminate(self, spec)

    def stopping(resource: str) -> None:
        agent = WATCH.world.agent if WATCH.world is not None else None
        if not WATCH.acting or agent is None:
            return
        WATCH.quits.add(resource)
        wanted = wanted_daemons(agent.runtime.root, agent.runtime.state)
        # The reload quits the daemons for its unload whatever NVML answers (recorded first, started at its end).
        reloads = held_by_reload(Ledger(agent.runtime.root))
        if resource in wanted.named and not wanted.decidable and resource not in reloads:
            WATCH.broken.append(f"quit the MPS control daemon of {resource} without an inventory, while the config "
                                "asks for it")

    def saving(ledger: Ledger, entry: Any) -> None:
        save(ledger, entry)
        WATCH.point()

    patch.setattr(SimModprobe, "load", loading)
    patch.setattr(SimModprobe, "unload", unloading)
    patch.setattr(SimUnits, "__call__", unit)
    patch.setattr(SimMpsControl, "start", starting)
    patch.setattr(SimMpsControl, "send", sending)
    patch.setattr(SimMpsControl, "terminate", terminating)
    patch.setattr(Ledger, "save_driver_reload", saving)
    return WATCH


class Agent:
    """The daemon's parts over one Runtime, minus its event loop (daemon/app.py's Daemon gives them): each
    answer() is what the daemon does after an event."""

    def __init__(self, world: World) -> None:
        self.world = world
        loaded = load_config(world.config_path, required=True)
        self.runtime = Runtime.build(Root(world.root), loaded, MACHINE, clock=world.clock)
        self.state = self.runtime.state
        self.daemon = Daemon(self.runtime, world.config_path, config_required=True)
        self.daemon.xids.clock = world.clock
        self.mps: Optional[MpsManager] = None
        self._mps_looked = False
        self.runs: dict[str, Any] = {}
        self.started = False

    def answer(self) -> None:
        """The XID events NVML delivered taken, the GPUs sampled (what the simulator's watch does on a change), a
        pass (forced: the machine changed), the GPUs sampled again (the periodic sample), the MPS control daemons
        synced."""
        self._take_xids()
        self.daemon.xids.recover()
        self.daemon.sampler.sample()
        runs = asyncio.run(self.runtime.engine.reconcile(force=True))
        self.runs = {run.stage: run for run in runs}
        self.state.first_reconcile_done = True
        self.started = True
        self.daemon.sampler.sample()  # the periodic sample, after the pass (the first one's too)
        self._register_xids()
        self._sync_mps()

    def reload_config(self) -> None:
        """SIGHUP: the file read again and, when it changed, the daemon's own switch to it (its stages kept
        where their settings did not change)."""
        loaded = reload_config(self.world.config_path, True, self.state.config)
        if loaded is not None:
            self.daemon._apply_config(loaded, self.daemon._stages_for(loaded.config))

    def _register_xids(self) -> None:
        try:
            self.daemon.xids._register()
        except Exception as exc:  # NVML's errors: the watcher says so and tries again, as the daemon's does
            self.daemon.xids._unavailable(exc)

    def _take_xids(self) -> None:
        wait = self.daemon.xids._wait
        while wait is not None:
            try:
                event = wait(0)
            except Exception:  # NVML gone (a reload, a mismatch): registered again later
                return
            if event is None:
                return
            self.daemon.xids.record(event)
            gpus = [gpu["uuid"] for gpu in self.world.state()["gpus"]]
            if event.gpu_uuid in gpus:
                self.world.seen_xids[gpus.index(event.gpu_uuid)] = event.xid  # what its XID series must say

    def _sync_mps(self) -> None:
        """The daemon's _ensure_mps, then a sync of its watch (a restart in place, quit then start, is one)."""
        if self.mps is None:
            if self.state.config.config.plugin.sharing.mps is None:
                if self._mps_looked:
                    return
                self._mps_looked = True
                ledger = Ledger(self.runtime.root)
                if not ledger.mps_directories() and not ledger.compute_modes():
                    return
            runtime = self.runtime
            self.mps = MpsManager(runtime.root, self.state, runtime.mps_control(), runtime.nvml.inventory, lambda: None,
                                  AT_ONCE)
        asyncio.run(self.mps.sync())

    def drop(self) -> None:
        """kill -9: nothing is cleaned up; only this process's handle on the simulated NVML goes."""
        self.daemon.xids.stop()
        self.runtime.nvml.close()


class World:
    """The node, the API server and the agent, with what the world did that the invariants need to know: the
    config in force, the administrator's cordon, the GPUs the world made sick."""

    def __init__(self, base: Path, api: Any, settings: Settings) -> None:
        self.base = base
        self.root = base / "root"
        self.api = api
        self.settings = settings
        self.clock = FakeClock()
        self.node = SimNode(self.root, MACHINE)
        self.machine = MachineState(Root(self.root))
        self.config_path = base / "config.yaml"
        self.admin_cordoned = False
        self.lost: set[int] = set()  # GPUs off the bus (XID 79)
        self.failing: set[int] = set()  # GPUs whose NVML queries fail
        self.touched: set[int] = set()  # GPUs any fault or XID reached: their health is theirs to judge
        self.nvml_down = False  # NVML fails for every GPU
        self.seen_xids: dict[int, int] = {}  # by GPU: the last XID the agent running now took
        self.pipes: dict[str, int] = {}  # the MPS pipe directories' inodes, while their resource is asked for
        self.agent: Optional[Agent] = None
        api.write_kubeconfig(self.root / KUBECONFIG.lstrip("/"), mode="cert-data")
        for binary in ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-cdi-hook"):
            (self.root / "usr/bin").mkdir(parents=True, exist_ok=True)
            (self.root / "usr/bin" / binary).write_text("#!/bin/sh\n")
        self.sim("install-runtime", "podman", "5.4.2")  # reads the CDI spec: the agent writes one
        (self.root / DEVICE_PLUGINS).mkdir(parents=True, exist_ok=True)
        self.write_config(settings)

    # --- the world's events -------------------------------------------------------------------------------

    def sim(self, *argv: str) -> None:
        self.node.sim(*argv)

    def write_config(self, settings: Settings) -> None:
        self.settings = settings
        self.config_path.write_text(yaml.safe_dump(settings.document()))

    def reboot(self) -> None:
        """`sim reboot`, and what a reboot does that the simulator leaves to the test: every process ends (the
        MPS control daemons and the agent), /run is a new tmpfs (the pipe directories, the agent's lock and
        requests), the daemons' shared memory is no longer mounted."""
        if self.agent is not None:
            self.agent.drop()
            self.agent = None
        self.sim("reboot")
        sim_mps.kill(self.machine)
        with self.machine.edit() as state:
            state.get("mounts", {}).pop("/run/nvidia/mps/shm", None)
        shutil.rmtree(self.root / "run", ignore_errors=True)
        self.lost.clear()
        self.pipes.clear()
        self.seen_xids.clear()
        WATCH.stopped_units.clear()  # the boot started every unit and loaded the installed driver
        WATCH.unloaded.clear()

    def rollback(self) -> None:
        loaded = loaded_version(self.state(), "nvidia")
        self.sim("install-driver", loaded or OLD)

    def modprobe_refused(self) -> None:
        self.sim("fail", "modprobe", "--module", "nvidia", "--error", "key-rejected", "--times", "1")

    def administrator(self, cordons: bool) -> None:
        if cordons and not self.cordoned():
            self.api.modify_node(NODE, lambda node: node["spec"].update(unschedulable=True))
            self.admin_cordoned = True
        elif not cordons and self.admin_cordoned:
            self.api.modify_node(NODE, lambda node: node["spec"].update(unschedulable=False))
            self.admin_cordoned = False

    def xid(self, gpu: int, xid: int) -> None:
        self.sim("inject-xid", "--gpu", str(gpu), "--xid", str(xid))
        self.touched.add(gpu)
        if xid == 79:
            self.lost.add(gpu)
        self.seen_xids.pop(gpu, None)  # until the agent takes it (NVML may not deliver it): an earlier one, or none

    def gpu_back(self, gpu: int) -> None:
        """A GPU off the bus back at its bus id, as after a reset."""
        with self.machine.edit() as state:
            state["lost_gpus"] = [index for index in state.get("lost_gpus", []) if index != gpu]
        self.lost.discard(gpu)

    def nvml_fails(self, call: str, gpu: Optional[int]) -> None:
        self.sim("fail", call, *(["--gpu", str(gpu)] if gpu is not None else []), "--error", "Unknown")
        if gpu is None:
            self.nvml_down = True
        else:
            self.failing.add(gpu)
            self.touched.add(gpu)

    def nvml_answers(self) -> None:
        with self.machine.edit() as state:
            state["faults"] = [fault for fault in state["faults"] if not fault["call"].startswith("nvml")]
        self.failing.clear()
        self.nvml_down = False

    def processes_end(self) -> None:
        with self.machine.edit() as state:
            for gpu in state["gpus"]:
                gpu["processes"] = []

    def poke_mps(self, command: str) -> None:
        """Someone sends the MPS control daemon a command of their own."""
        from gpu_agent.errors import AgentError
        from gpu_agent.mps.control import DaemonSpec

        try:
            SimMpsControl(self.machine, 0.2).send(DaemonSpec.left(RESOURCE), command)
        except AgentError:
            pass  # no daemon runs

    def calm(self) -> None:
        """Every fault cleared, processes ended, GPUs back on the bus, the kubelet up."""
        self.sim("clear")
        self.kubelet_up()
        self.lost.clear()
        self.failing.clear()
        self.nvml_down = False

    def restart_kubelet(self) -> None:
        """The kubelet restarts: its device-plugin sockets are removed and its pod-resources socket is there but
        refuses connections until it is up (kubelet_up: gone, as in the simulator, where no kubelet serves it)."""
        plugins = self.root / DEVICE_PLUGINS
        for path in plugins.iterdir():
            path.unlink()
        stale = self.root / POD_RESOURCES
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("")  # a connection to it is refused, as to a socket nobody listens on

    def kubelet_up(self) -> None:
        (self.root / POD_RESOURCES).unlink(missing_ok=True)

    def abort(self) -> Any:
        """`gpu-agent driver reload --abort` with no daemon holding the lock: the command does it in-process."""
        WATCH.acting = True
        try:
            return run_cli("--simulate", MACHINE, "driver", "reload", "--abort", "--json", root=self.root,
                           config=self.config_path)
        finally:
            WATCH.acting = False

    def plan(self) -> Any:
        return run_cli("--simulate", MACHINE, "driver", "reload", "--dry-run", "--json", root=self.root,
                       config=self.config_path)

    # --- the agent ----------------------------------------------------------------------------------------

    def start_agent(self) -> None:
        self.seen_xids.clear()
        WATCH.acting = True
        try:
            self.agent = Agent(self)
        finally:
            WATCH.acting = False

    def answer(self, kill_at: Optional[int] = None) -> bool:
        """The agent answers the last event, a minute later (started first if it is not running). With `kill_at`
        it is killed at that point of its answer (False then) and started again, and answers anew."""
        self.clock.wait_until(self.clock() + STEP_S)
        if self.agent is None:
            self.start_agent()
        assert self.agent is not None
        WATCH.kill_in = kill_at
        WATCH.acting = True
        try:
            self.agent.answer()
        except Killed:
            self.agent.drop()
            self.agent = None
            return False
        finally:
            WATCH.acting = False
            WATCH.kill_in = None
        return True

    def close(self) -> None:
        if self.agent is not None:
            self.agent.drop()
            self.agent = None

    # --- what the node and the API show -------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return self.machine.read()

    def record(self) -> Optional[dict[str, Any]]:
        return Ledger(Root(self.root)).driver_reload()

    def cordoned(self) -> bool:
        return bool(self.api.get_node(NODE)["spec"].get("unschedulable"))


def the_clock(clock: FakeClock) -> Any:
    """driver_reload's `time` with the agent's clock as its time(): how long the reload has waited."""
    return types.SimpleNamespace(time=clock, strftime=__import__("time").strftime, gmtime=__import__("time").gmtime,
                                 monotonic=__import__("time").monotonic)


def use_the_clock(patch: Any, world: World) -> None:
    patch.setattr(driver_reload, "time", the_clock(world.clock))


def settings_variant(settings: Settings, change: str) -> Settings:
    """`settings` with one thing changed, as an operator edits the file before a SIGHUP."""
    changes: dict[str, Callable[[Settings], Settings]] = {
        "replicas": lambda s: replace(s, replicas={0: 2, 2: 4, 4: 0}[s.replicas]),
        "reload": lambda s: replace(s, reload="never" if s.reload == "when-idle" else "when-idle"),
        "unready_when": lambda s: replace(s, unready_when="any" if s.unready_when == "all" else "all"),
        "firmware": lambda s: replace(s, firmware=1 - s.firmware),
    }
    return changes[change](settings)
