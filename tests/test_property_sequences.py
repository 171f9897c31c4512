"""Issue 33, point 7: a property test over sequences. Random sequences of what happens to a GPU node (a driver
installed, a rollback, a reboot, the agent killed -9 between passes or at one of the first 16 points of one
(each reload record, modprobe, unit stop or start, MPS start) and started again, a SIGHUP with a
changed config, a GPU lost and back (XID 79, 48, 94), NVML failing, GPU processes starting and ending, rmmod
refused, the kubelet restarting, `gpu-agent driver reload --abort`, an administrator's cordon), the agent in this
process answering each as its daemon does (tests/sequences.py); after each step the invariants of the issue's
point 2 hold on what the node, the API server and the agent show. At the end the world calms down (faults
cleared, processes ended) and the agent must have ended what it began.

hypothesis's stateful testing draws the sequences and shrinks a failing one to a short one, which it prints as
the calls that reproduce it. The seed is printed on failure; GPU_AGENT_PROPERTY_SEED=N runs the same sequences
again (the example database is off: a seed alone reproduces a run). `make test` runs a few short sequences from
a random seed (GPU_AGENT_PROPERTY_EXAMPLES overrides how many); `make test-slow` runs 2,000 in four shards of 500,
seeds LONG_SEED to LONG_SEED + 3 unless GPU_AGENT_PROPERTY_SEED says otherwise (`random`: new ones each run).
GPU_AGENT_PROPERTY_SHRINK=0 prints a failing sequence as found."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import node_labels
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.mps.daemons import wanted_daemons
from gpu_agent.mps.layout import MPS_ROOT, SHM_DIR, pipe_dir
from gpu_agent.mps.lifecycle import Want
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.sim.kernel import loaded_version
from gpu_agent.sim.services import SimServices
from gpu_agent.stages.reload_transitions import ABANDONED, DONE, FAILED, FINAL
from kube_emulator import KubeEmulator
from sequences import (
    NEW,
    NEWER,
    NODE,
    OLD,
    RESOURCE,
    WATCH,
    Settings,
    World,
    install_watch,
    settings_variant,
    use_the_clock,
)

SEED_ENV = "GPU_AGENT_PROPERTY_SEED"
EXAMPLES_ENV = "GPU_AGENT_PROPERTY_EXAMPLES"
SHRINK_ENV = "GPU_AGENT_PROPERTY_SHRINK"  # 0: a failing sequence is printed as found, not shrunk (quicker)
GPUS = 2
EXCLUSIVE_PROCESS = 3  # NVML's compute mode, as the simulator keeps it
_SAMPLE = re.compile(r'^(?P<name>\w+)\{(?P<labels>.*)\} (?P<value>\S+)$')


class Context:
    """What every sequence of one test shares: the API server, the pytest patch, a folder per sequence."""

    api: KubeEmulator
    base: Path
    patch: pytest.MonkeyPatch
    count = 0

    def world(self) -> World:
        self.count += 1
        folder = self.base / f"s{self.count}"
        self.api.delete_node(NODE)  # a node of its own: nothing of the last sequence's cordon or labels
        self.api.add_node(NODE)
        self.api.clear_requests()
        world = World(folder, self.api, Settings())
        WATCH.world, WATCH.broken, WATCH.stopped_units, WATCH.unloaded = world, [], set(), set()
        use_the_clock(self.patch, world)
        return world


CONTEXT = Context()


# --- the invariants ---------------------------------------------------------------------------------------------

def broken(world: World) -> list[str]:
    """Each invariant of issue 33's point 2 that what the node, the API server and the agent show breaks now."""
    found, WATCH.broken[:] = list(WATCH.broken), []
    agent = world.agent
    assert agent is not None
    machine, record = world.state(), world.record()
    step = record["step"] if record else None
    ended = step is None or step in FINAL
    found += _cordon(world, step, ended)
    if ended or step == FAILED:
        found += _put_back(world, machine, step)
    found += _mps_quits(world, step)
    if _sound(world, machine, ended):
        found += _per_gpu(world)
    found += _mps_shows_what_runs(world, machine)
    found += _pipes_kept(world)
    found += _ledger_holds(world, machine)
    return found


def _cordon(world: World, step: Optional[str], ended: bool) -> list[str]:
    if world.admin_cordoned and not world.cordoned():
        return ["uncordoned the node an administrator cordoned"]
    if ended and not world.admin_cordoned and world.cordoned():
        return [f"the node stays cordoned with the reload ended ({step or 'no record'})"]
    return []


def _put_back(world: World, machine: dict[str, Any], step: Optional[str]) -> list[str]:
    """Every exit (done, failed, abandoned, aborted): the units the agent stopped run, the modules it unloaded
    that can load beside the loaded nvidia are loaded."""
    found = []
    faults = machine["faults"]
    loaded = {m["name"]: m for m in machine["kernel"]["loaded"]}
    nvidia = loaded.get("nvidia")
    for unit in sorted(WATCH.stopped_units) if nvidia is not None or step != FAILED else ():
        # a failure after nvidia's unload leaves the units stopped until it loads: they hold it
        refused = any(f["call"] == "start" and f.get("unit") in (None, unit) for f in faults)
        if not refused and SimServices(world.machine, 5).state(unit).active != "active":
            found.append(f"{unit}, which the agent stopped, is not running at {step or 'no record'}")
    for module in sorted(WATCH.unloaded):
        if module in loaded or nvidia is None or module == "nvidia":
            continue  # nvidia itself: the driver stage loads the installed one (a fault may refuse it)
        refused = any(f["call"] == "modprobe" and f.get("module") in (None, module) for f in faults)
        if not refused and machine["kernel"]["installed"].get(module) == nvidia["version"]:
            found.append(f"{module}, which the agent unloaded, is not loaded at {step or 'no record'} though it "
                         f"loads beside nvidia {nvidia['version']}")
    return found


def _mps_quits(world: World, step: Optional[str]) -> list[str]:
    """A daemon the config asks for is quit only to be started again (a restart in place) or by a reload under
    way."""
    quit_, started = WATCH.quits, WATCH.starts
    WATCH.quits, WATCH.starts = set(), set()
    if step is not None and step not in FINAL:
        return []
    asked = {RESOURCE} if world.settings.replicas else set()
    return [f"quit the MPS control daemon of {resource}, which the config asks for, and did not start it again"
            for resource in sorted((quit_ & asked) - started)]


def _sound(world: World, machine: dict[str, Any], ended: bool) -> bool:
    """The driver loaded is the installed one and NVML answers but for single GPUs: what a lost or failing GPU
    must not spoil."""
    loaded = loaded_version(machine, "nvidia")
    return ended and not world.nvml_down and loaded is not None and loaded == machine.get("driver_version")


def _per_gpu(world: World) -> list[str]:
    """A lost GPU, or one NVML cannot read, is a fact about that GPU: the others are served everywhere."""
    agent = world.agent
    assert agent is not None
    state = agent.state
    discovery = agent.runs.get("discovery")
    if discovery is None or discovery.state != "ok":
        return [f"discovery is {discovery.state if discovery else 'not run'} with the driver loaded and NVML "
                f"answering: {discovery.message if discovery else ''}"]
    found = []
    status = state.to_json()
    gpus = status["gpus"]
    if [gpu["index"] for gpu in gpus] != list(range(GPUS)):
        return [f"/status lists GPUs {[gpu['index'] for gpu in gpus]}, not all {GPUS}"]
    sick = world.lost | world.failing
    for index in sorted(sick):
        if gpus[index]["health"] == "healthy":
            found.append(f"GPU {index} is lost or unreadable and /status says it is healthy")
    spared = [index for index in range(GPUS) if index not in world.touched]
    metrics = render(make_registry(AgentCollector(state, lambda: 0, "node-1"))).decode()
    power = _series(metrics, "DCGM_FI_DEV_POWER_USAGE")
    xids = _series(metrics, "DCGM_FI_DEV_XID_ERRORS")
    for index in spared:
        if gpus[index]["health"] != "healthy":
            found.append(f"GPU {index}, which nothing happened to, is {gpus[index]['health']}")
        if str(index) not in power:
            found.append(f"GPU {index}'s metrics left /metrics")
    if set(xids) != {str(index) for index in range(GPUS)}:
        found.append(f"DCGM_FI_DEV_XID_ERRORS has samples for GPUs {sorted(xids)}, not for all {GPUS}")
    for index, xid in world.seen_xids.items():
        if xids.get(str(index)) not in (None, float(xid)):
            found.append(f"GPU {index}'s XID series says {xids.get(str(index))}, its last XID was {xid}")
    cdi = agent.runs.get("cdi")
    if cdi is not None and cdi.state != "ok":
        found.append(f"the CDI stage is {cdi.state}: {cdi.message}")
    labels = node_labels(state.config.config, state.inventory, state.ready, state.machine)
    if labels.get("nvidia.com/gpu.count") != str(GPUS):
        found.append(f"the labels count {labels.get('nvidia.com/gpu.count')} GPUs, not {GPUS}")
    found += _plugin_serves(world, spared)
    health = next(check for check in state.checks() if check.name == "gpu-health")
    healthy = [gpu for gpu in gpus if gpu["health"] == "healthy"]
    wanted = bool(healthy) if world.settings.unready_when == "all" else len(healthy) == len(gpus)
    if health.ok != wanted:
        found.append(f"gpu-health is {'ok' if health.ok else 'failing'} with {len(healthy)} of {len(gpus)} GPUs "
                     f"healthy and unready_when {world.settings.unready_when}: {health.reason}")
    return found


def _plugin_serves(world: World, spared: list[int]) -> list[str]:
    agent = world.agent
    assert agent is not None
    found = []
    served = DevicePluginManager(agent.runtime.root, agent.state).compute()
    for name, resource in served.resources.items():
        if name in agent.state.mps_down:
            continue  # its daemon is not running: every replica is unhealthy until it is
        for index in spared:
            devices = [device for device in resource.devices if device.gpu_index == index]
            if not devices or not all(device.healthy for device in devices):
                found.append(f"the device plugin does not serve GPU {index} healthy as {name}")
    return found


def _series(metrics: str, name: str) -> dict[str, float]:
    found = {}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            found[labels.get("gpu", "")] = float(match["value"])
    return found


def _mps_shows_what_runs(world: World, machine: dict[str, Any]) -> list[str]:
    """/status says a daemon runs only when it does, with the settings it runs with."""
    agent = world.agent
    assert agent is not None
    found = []
    wanted = wanted_daemons(agent.runtime.root, agent.state)
    for shown in (agent.state.mps or {}).get("daemons", []):
        if shown["state"] != "running" or wanted.want(shown["resource"]) is Want.UNDECIDED:
            continue  # without an inventory of its GPUs the agent neither reads it back nor restarts it
        real = machine.get("mps", {}).get(shown["resource"])
        if real is None or not real["alive"] or real["pid"] != shown["pid"]:
            found.append(f"/status shows the MPS control daemon of {shown['resource']} running as pid {shown['pid']}; "
                         f"the node runs {real and real['alive'] and real['pid']}")
            continue
        if float(shown["active_thread_percentage"]) != float(real["thread_percentage"]):
            found.append(f"/status shows {shown['active_thread_percentage']}% of threads for "
                         f"{shown['resource']}; its daemon runs with {real['thread_percentage']}%")
        limits = {str(ordinal): shown["pinned_memory_limits"].get(str(index))
                  for ordinal, index in enumerate(shown["gpus"])}
        runs = {str(ordinal): real["pinned_mem_limits"].get(str(ordinal)) for ordinal in range(len(shown["gpus"]))}
        if limits != runs:
            found.append(f"/status shows pinned memory limits {limits} for {shown['resource']}; its daemon runs "
                         f"with {runs}")
    return found


def _pipes_kept(world: World) -> list[str]:
    """While the config asks for a resource, its pipe directory is never made again (pods have it mounted)."""
    found = []
    directory = world.root / pipe_dir(RESOURCE).lstrip("/")
    if not world.settings.replicas:
        world.pipes.pop(RESOURCE, None)
        return []
    if directory.is_dir():
        inode = directory.stat().st_ino
        if world.pipes.get(RESOURCE, inode) != inode:
            found.append(f"{pipe_dir(RESOURCE)} was removed and made again while the config asked for {RESOURCE}")
        world.pipes[RESOURCE] = inode
    elif RESOURCE in world.pipes:
        found.append(f"{pipe_dir(RESOURCE)} was removed while the config asked for {RESOURCE}")
        world.pipes.pop(RESOURCE)
    return found


def _ledger_holds(world: World, machine: dict[str, Any]) -> list[str]:
    """What the agent made is in its ledger: the MPS directories, the tmpfs, the compute modes it changed."""
    ledger = Ledger(Root(world.root))
    found = []
    base = world.root / MPS_ROOT.lstrip("/")
    made = [f"/{path.relative_to(world.root)}" for path in [base, *base.rglob("*")] if path.is_dir()] \
        if base.is_dir() else []
    owned = ledger.mps_directories()
    for directory in made:
        if directory not in owned and directory != SHM_DIR:
            found.append(f"{directory} exists and the ledger does not hold it")
    if SHM_DIR in machine.get("mounts", {}) and SHM_DIR not in ledger.mounts():
        found.append(f"the tmpfs at {SHM_DIR} is mounted and the ledger does not hold it")
    modes = ledger.compute_modes()
    for index, gpu in enumerate(machine["gpus"]):
        if gpu.get("compute_mode") == EXCLUSIVE_PROCESS and gpu["uuid"] not in modes:
            found.append(f"GPU {index} is EXCLUSIVE_PROCESS and the ledger holds no compute mode to put back")
    return found


def agreement(world: World) -> list[str]:
    """The driver stage and `gpu-agent driver reload --dry-run` say the same of a reload: whether one is
    required, and why."""
    agent = world.agent
    assert agent is not None
    runs = asyncio.run(agent.runtime.engine.reconcile(force=True, dry_run=True))
    stage = next(run for run in runs if run.stage == "driver").message
    plan = world.plan()
    said = json.loads(plan.stdout)
    required = said["reload_required"]
    if ("reload required" in stage) != (required is not None):
        return [f"the driver stage says {stage!r}; `gpu-agent driver reload --dry-run` says reload_required "
                f"{required!r}"]
    if required is not None and required not in stage:
        return [f"the driver stage says {stage!r}; the command says the reload is required for {required!r}"]
    return []


# --- the sequences ----------------------------------------------------------------------------------------------

EVENTS: dict[str, Callable[[World], Any]] = {
    "rollback": World.rollback,  # the package goes back to the driver that is loaded
    "reboot": World.reboot,
    "modprobe refused": World.modprobe_refused,  # once: Secure Boot rejects the key
    "abort": World.abort,  # `gpu-agent driver reload --abort`
    "processes end": World.processes_end,
    "NVML answers again": World.nvml_answers,
    "the MPS control daemon dies": lambda world: world.sim("fail", "mps", "--error", "die"),
    "time passes": lambda world: None,
}


class Sequence(RuleBasedStateMachine):
    """One node's life: each rule is an event and the agent's answer to it."""

    def __init__(self) -> None:
        super().__init__()
        self.world = CONTEXT.world()
        self.pid = 5000
        self.world.answer()

    def answer(self, kill_at: Optional[int] = None) -> None:
        if not self.world.answer(kill_at):
            self.world.answer()  # started again: its first pass

    @rule(version=st.sampled_from([NEW, NEWER, OLD]))
    def install_driver(self, version: str) -> None:
        self.world.sim("install-driver", version)
        self.answer()

    @rule(times=st.sampled_from([1, None]))
    def rmmod_refused(self, times: Optional[int]) -> None:
        self.world.sim("fail", "rmmod", "--module", "nvidia", *(["--times", str(times)] if times else []))
        self.answer()

    @rule(event=st.sampled_from(sorted(EVENTS)))
    def event(self, event: str) -> None:
        EVENTS[event](self.world)
        self.answer()

    @rule()
    def plan(self) -> None:
        """`gpu-agent driver reload --dry-run` beside the agent's own dry run."""
        problems = agreement(self.world)
        assert not problems, "\n".join(problems)

    @rule(point=st.one_of(st.none(), st.integers(min_value=1, max_value=16)))
    def kill_and_restart(self, point: Optional[int]) -> None:
        """kill -9 between two passes (None) or at a point of the next one, then a start."""
        if point is None:
            assert self.world.agent is not None
            self.world.agent.drop()
            self.world.agent = None
        self.answer(kill_at=point)

    @rule(change=st.sampled_from(["replicas", "reload", "unready_when", "firmware"]))
    def sighup(self, change: str) -> None:
        self.world.write_config(settings_variant(self.world.settings, change))
        assert self.world.agent is not None
        self.world.agent.reload_config()
        self.answer()

    @rule(gpu=st.integers(min_value=0, max_value=GPUS - 1), xid=st.sampled_from([79, 48, 94]))
    def xid(self, gpu: int, xid: int) -> None:
        self.world.xid(gpu, xid)
        self.answer()

    @rule(gpu=st.integers(min_value=0, max_value=GPUS - 1))
    def gpu_back(self, gpu: int) -> None:
        """A GPU off the bus comes back (reset) at the same bus id."""
        self.world.gpu_back(gpu)
        self.answer()

    @rule(gpu=st.one_of(st.none(), st.integers(min_value=0, max_value=GPUS - 1)),
          call=st.sampled_from(["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo"]))
    def nvml_fails(self, gpu: Optional[int], call: str) -> None:
        self.world.nvml_fails(call, gpu)
        self.answer()

    @rule(gpu=st.integers(min_value=0, max_value=GPUS - 1))
    def process_starts(self, gpu: int) -> None:
        self.pid += 1
        self.world.sim("add-process", "--gpu", str(gpu), "--pid", str(self.pid), "--name", "train.py")
        self.answer()

    @rule(command=st.sampled_from(["set_default_active_thread_percentage 30",
                                   "set_default_device_pinned_mem_limit 1 1000M"]))
    def someone_sets_the_mps_daemon(self, command: str) -> None:
        """Someone else changes the running MPS control daemon's settings on its control pipe."""
        self.world.poke_mps(command)
        self.answer()

    @rule()
    def kubelet_restarts(self) -> None:
        self.world.restart_kubelet()
        self.answer()
        self.world.kubelet_up()
        self.answer()

    @rule(cordons=st.booleans())
    def administrator(self, cordons: bool) -> None:
        """An administrator cordons the node (when it is not cordoned), or uncordons their own cordon."""
        self.world.administrator(cordons)
        self.answer()

    @invariant()
    def holds(self) -> None:
        problems = broken(self.world)
        assert not problems, "\n".join(problems)

    def teardown(self) -> None:
        """The driver stage and the command agree once more; then the world calms down: every fault cleared,
        processes ended, GPUs back, the kubelet up. The agent ends what it began: no reload under way, nothing
        it took away missing, the MPS daemon it is asked for running."""
        try:
            world = self.world
            if world.agent is None:
                return  # the sequence failed before the agent ran: nothing to settle
            problems = agreement(world)
            world.calm()
            for _ in range(3):
                world.answer()
            problems += broken(world)
            record = world.record()
            if record is not None and record["step"] not in FINAL:
                problems.append(f"the reload is still at {record['step']} with nothing in its way: "
                                f"{record.get('failure')}")
            problems += settled(world)
            assert not problems, "\n".join(problems)
        finally:
            self.world.close()
            shutil.rmtree(self.world.base, ignore_errors=True)


def settled(world: World) -> list[str]:
    machine = world.state()
    found = []
    loaded = {m["name"]: m["version"] for m in machine["kernel"]["loaded"] if m.get("state", "Live") == "Live"}
    record = world.record()
    if record is None or record["step"] == DONE:
        if loaded.get("nvidia") != machine["driver_version"] and world.settings.reload == "when-idle":
            found.append(f"nvidia {loaded.get('nvidia')} loaded, {machine['driver_version']} installed, after "
                         f"{record['step'] if record else 'no reload'}")
    if record is not None and record["step"] != ABANDONED and not {"nvidia", "nvidia_uvm"} <= set(loaded):
        found.append(f"the core modules are not loaded: {sorted(loaded)}")
    agent = world.agent
    assert agent is not None
    if world.settings.replicas and agent.state.inventory is not None and loaded.get("nvidia") == \
            machine["driver_version"]:
        daemons = {d["resource"]: d for d in (agent.state.mps or {}).get("daemons", [])}
        if not daemons.get(RESOURCE, {}).get("up"):
            found.append(f"the MPS control daemon of {RESOURCE} is not running: {daemons.get(RESOURCE)}")
    return found


# --- the runs ---------------------------------------------------------------------------------------------------

@pytest.fixture
def context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Context]:
    CONTEXT.api = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    CONTEXT.base, CONTEXT.patch, CONTEXT.count = tmp_path, monkeypatch, 0
    install_watch(monkeypatch)
    set_hypothesis_home_dir(tmp_path / "hypothesis")  # its caches in the test's folder, not the clone's .hypothesis
    try:
        yield CONTEXT
    finally:
        set_hypothesis_home_dir(None)
        CONTEXT.api.close()
        WATCH.world = None


def run_sequences(examples: int, steps: int, shard: int = 0, seed: Optional[int] = None) -> None:
    """`examples` sequences of at most `steps` events, from the seed GPU_AGENT_PROPERTY_SEED says (plus the
    shard), else `seed` (plus the shard), else a random one; the seed is printed on failure."""
    chosen = os.environ.get(SEED_ENV, None if seed is None else str(seed))
    chosen = None if chosen == "random" else chosen
    seed = int(chosen) + shard if chosen else random.SystemRandom().randrange(2 ** 32)
    examples = int(os.environ.get(EXAMPLES_ENV, examples))
    machine: Any = Sequence
    machine._hypothesis_internal_use_seed = seed
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None, derandomize=False,
            suppress_health_check=list(HealthCheck), print_blob=False,
            phases=[Phase.generate] if os.environ.get(SHRINK_ENV) == "0" else list(Phase)))
    except BaseException as exc:
        print(f"property test over sequences failed with seed {seed}: run it again with "
              f"{SEED_ENV}={int(chosen) if chosen else seed - shard}{f' (shard {shard})' if shard else ''}")
        if isinstance(exc, AssertionError):
            raise AssertionError(f"seed {seed}: {exc}") from exc
        raise


def test_sequences_keep_the_invariants(context: Context) -> None:
    run_sequences(examples=3, steps=8)


# Sequences the long runs found breaking an invariant, kept as they were found (seed, then the steps hypothesis
# printed), each a test of its own.
FOUND: dict[str, list[Callable[[Sequence], Any]]] = {
    # The reload quit the daemon for its unload while NVML failed (a driver mismatch): its quit, recorded first, was
    # taken for the MPS watch's, which must not quit without an inventory.
    "seed 6003: the reload quits the daemon without an inventory": [
        lambda s: s.administrator(cordons=False), Sequence.kubelet_restarts, lambda s: s.process_starts(gpu=0),
        Sequence.kubelet_restarts, lambda s: s.install_driver(version=NEW), lambda s: s.kill_and_restart(point=None),
        lambda s: s.process_starts(gpu=0), lambda s: s.kill_and_restart(point=None),
        lambda s: s.someone_sets_the_mps_daemon(command="set_default_device_pinned_mem_limit 1 1000M"),
        lambda s: s.process_starts(gpu=0)],
    # GPU 0 off the bus: the reload's end did not start the daemon again (its GPU 0 could not be set
    # EXCLUSIVE_PROCESS), and the MPS watch, every GPU failing a query, could not either: it starts on GPU 1.
    "seed 6002: a GPU lost before the reload": [
        Sequence.kubelet_restarts, lambda s: s.nvml_fails(call="nvmlDeviceGetMemoryInfo", gpu=None),
        Sequence.kubelet_restarts, Sequence.kubelet_restarts, lambda s: s.xid(gpu=0, xid=79),
        lambda s: s.install_driver(version=NEW)],
}


@pytest.mark.parametrize("name", list(FOUND))
def test_the_sequences_once_found_keep_the_invariants(context: Context, name: str) -> None:
    sequence = Sequence()
    sequence.holds()
    for step in FOUND[name]:
        step(sequence)
        sequence.holds()
    sequence.teardown()


# The long run's sequences are the same in every CI run, so that its verdict is the code's and not the draw's:
# these four seeds' 2,000 sequences found the two of FOUND, and pass since. GPU_AGENT_PROPERTY_SEED=random draws new
# ones (what a developer runs before changing the agent's lifecycles).
LONG_SEED = 6000


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(4))
def test_2000_sequences_keep_the_invariants(context: Context, shard: int) -> None:
    run_sequences(examples=500, steps=10, shard=shard, seed=LONG_SEED)
