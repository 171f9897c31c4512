"""The MPS control daemons, one per resource shared by `plugin.sharing.mps`, run and watched by the agent.

Each daemon has a record whose phase (mps.lifecycle: unknown, adopted, starting, running, down,
stopping) moves only by `decide`, from what the node shows now: whether the config asks for the resource
and the inventory says its GPUs (Want), whether the daemon runs and answers, whether what runs is what
is asked (read back from the daemon and from the record of what it was started with, mps.instance), and
whether its backoff (1 s, doubling to 30 s) has passed. The manager gathers those facts every half
second (Timing), takes the step decide names, and publishes each daemon as it is: /status shows what
runs, and a resource's replicas are healthy only while its daemon is running.

A start makes /run/nvidia/mps/<resource>/{pipe,log} (recorded in the ledger first), writes the record,
mounts the daemons' shared tmpfs at /run/nvidia/mps/shm (mps.shm), sets the GPUs to EXCLUSIVE_PROCESS,
starts `nvidia-cuda-mps-control -d` for exactly the resource's GPUs and sets the default active thread
percentage (100 / replicas) and each GPU's pinned memory limit (its memory / replicas), as NVIDIA's
mps-control-daemon does. A daemon whose settings must change is sent `quit` and started again in place:
its directories stay, so the pods that mounted its pipe directory keep the mount. Only a resource the
config no longer asks for loses its daemon for good, its GPUs' compute modes and its directories; the
tmpfs is unmounted once no daemon is left. Without an inventory nothing is started, stopped or removed, nor for
a resource whose GPUs NVML cannot read now.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from collections.abc import Collection
from typing import Any, Callable, Optional

from gpu_agent.config.plugin import mig_strategy, plugin_wanted
from gpu_agent.errors import AgentError
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps import instance, shm
from gpu_agent.mps.control import ComputeModes, DaemonSpec, MpsControl, shown_limit
from gpu_agent.mps.layout import MPS_ROOT, SHM_DIR, log_dir, pipe_dir, record_path, resource_dir
from gpu_agent.mps.lifecycle import Action, Facts, Phase, Seen, Settings, Step, Want, decide
from gpu_agent.plugin.devices import advertised, shared_name
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

EXCLUSIVE = "EXCLUSIVE_PROCESS"
QUIT_WAIT_S = 5.0  # how long a daemon may take to exit after quit, and again after SIGTERM
MAX_STEPS = 6  # steps one pass may take for one daemon: a restart in place is quit, start, read back


@dataclass(frozen=True)
class Timing:
    poll_s: float = 0.5  # how often a daemon's pid is looked at: a dead one is seen within a second
    probe_s: float = 10.0  # how often a running daemon's settings are read back (it must answer)
    backoff_s: tuple[float, float] = (1.0, 30.0)  # the first wait before a restart, and the longest


@dataclass
class Daemon:
    """The record of one resource's control daemon."""

    resource: str
    phase: Phase = Phase.UNKNOWN
    spec: Optional[DaemonSpec] = None  # what runs: as this process started it, or as its record says
    pid: Optional[int] = None
    started_at: Optional[float] = None
    restarts: int = 0
    failures: int = 0  # in a row: the backoff's exponent
    error: Optional[str] = None  # why it does not run as asked
    next_try: float = 0.0
    probed_at: float = 0.0
    modes_before: dict[str, str] = field(default_factory=dict)  # by GPU UUID: the compute mode put back at its stop
    modes: dict[str, str] = field(default_factory=dict)  # by GPU UUID: its compute mode as last set or read back
    logged: Optional[str] = None  # the last problem logged: the same one is not logged again

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        indices = dict(zip(spec.gpus, spec.indices)) if spec else {}
        limits = {str(spec.indices[n]): limit for n, limit in spec.pinned_limits()} if spec else {}
        return {"resource": self.resource, "state": self.phase.value, "pid": self.pid,
                "up": self.phase is Phase.RUNNING, "gpus": list(spec.indices) if spec else None,
                "uuids": list(spec.gpus) if spec else None, "replicas": spec.replicas if spec else None,
                "started_at": self.started_at, "active_thread_percentage": spec.thread_percentage if spec else None,
                "pinned_memory_limits": limits, "pipe_directory": pipe_dir(self.resource), "restarts": self.restarts,
                "error": self.error, "compute_mode": shown_mode(self.modes, indices),
                "compute_modes_before": {str(indices.get(uuid, uuid)): mode
                                         for uuid, mode in sorted(self.modes_before.items())}}

    def why_not_running(self) -> str:
        if self.phase is Phase.UNKNOWN:
            return f"its MPS control daemon is unknown: {self.error or 'not looked at yet'}"
        return f"its MPS control daemon is {self.phase.value}{': ' + self.error if self.error else ''}"


def shown_mode(modes: dict[str, str], indices: dict[str, int]) -> Optional[str]:
    """The compute mode /status shows for a daemon: its GPUs' as last set or read back (the one they share, else
    each GPU's that is not EXCLUSIVE_PROCESS: `GPU 3: DEFAULT`); None before any was."""
    if not modes:
        return None
    if len(set(modes.values())) == 1:
        return next(iter(modes.values()))
    return ", ".join(f"GPU {indices.get(uuid, uuid)}: {mode}" for uuid, mode in sorted(modes.items())
                     if mode != EXCLUSIVE)


@dataclass(frozen=True)
class Wanted:
    """What the config and the inventory ask for: by resource, a daemon's spec; the resources the config
    names, decided or not; whether there is an inventory to decide with; the MPS resources withheld; and
    the GPUs NVML cannot read now."""

    specs: dict[str, DaemonSpec]
    named: frozenset[str]
    decidable: bool
    withheld: dict[str, str]
    unreadable: frozenset[str] = frozenset()  # the UUIDs of the GPUs NVML cannot read now
    undecided: frozenset[str] = frozenset()  # named, without a spec while GPUs are unreadable: maybe theirs

    def want(self, resource: str) -> Want:
        if resource in self.specs:
            return Want.YES
        undecided = resource in self.undecided or (resource in self.named and not self.decidable)
        return Want.UNDECIDED if undecided else Want.NO


def wanted_daemons(root: Root, state: AgentState) -> Wanted:
    """The daemons the config, the prepared DRA claims and the GPUs ask for."""
    shared = shared_daemons(root, state)
    if not state.claim_mps:
        return shared
    claimed = claim_daemons(state)
    named = shared.named | frozenset(state.claim_mps)
    return replace(shared, specs={**shared.specs, **claimed}, named=named,
                   undecided=shared.undecided | (frozenset(state.claim_mps) - set(claimed)))


def claim_daemons(state: AgentState) -> dict[str, DaemonSpec]:
    """The daemons of the prepared DRA claims that share their GPUs by MPS (state.claim_mps), on the GPUs
    NVML reads: a claim whose GPU it cannot read now is undecided, its daemon left as it is."""
    inventory = state.inventory or state.last_inventory
    if inventory is None:
        return {}
    gpus = {gpu.uuid: gpu for gpu in inventory.readable}
    specs = {}
    for resource, claim in state.claim_mps.items():
        if not all(uuid in gpus for uuid in claim.gpus):
            continue
        order = sorted(claim.gpus, key=lambda uuid: gpus[uuid].index)
        pinned = None if claim.pinned_mib is None else tuple(
            claim.pinned_mib[claim.gpus.index(uuid)] for uuid in order)
        specs[resource] = DaemonSpec(resource, tuple(order), tuple(gpus[uuid].index for uuid in order),
                                     tuple(gpus[uuid].memory_mib for uuid in order), 1, claim.threads, pinned)
    return specs


def shared_daemons(root: Root, state: AgentState) -> Wanted:
    """The daemons the config and the GPUs ask for (the inventory, or the last one while discovery fails, as
    the device plugin serves them)."""
    settings = state.config.config.plugin
    if settings.sharing.strategy != "mps" or not plugin_wanted(root, settings) or settings.sharing.mps is None:
        return Wanted({}, frozenset(), True, {})
    named = frozenset(shared_name(entry, settings) for entry in settings.sharing.mps.resources)
    inventory = state.inventory or state.last_inventory
    if inventory is None:
        return Wanted({}, named, False, {})
    unreadable = frozenset(gpu.uuid for gpu in inventory.gpus if gpu.unreadable)
    leaving = passed_through(root, state)
    # A daemon starts on the GPUs NVML reads, but those leaving for VMs (or gone to them).
    inventory = replace(inventory, gpus=tuple(gpu for gpu in inventory.readable if gpu.uuid not in leaving))
    found = advertised(inventory, {}, mig_strategy(state.config.config), settings)
    specs: dict[str, DaemonSpec] = {}
    gpus = {gpu.uuid: gpu for gpu in inventory.gpus}
    for name, resource in found.resources.items():
        if resource.strategy != "mps":
            continue
        order = sorted({device.gpu_uuid: device.gpu_index for device in resource.devices}.items(), key=lambda i: i[1])
        specs[name] = DaemonSpec(name, tuple(uuid for uuid, _ in order), tuple(index for _, index in order),
                                 tuple(gpus[uuid].memory_mib for uuid, _ in order), resource.replicas)
    # A resource the config names and no GPU NVML reads gives a device may be for the GPUs it cannot read: not
    # known, so its daemon is left as it is (NVML failing on every GPU is no config that stopped asking).
    undecided = named - set(specs) if unreadable else frozenset()
    return Wanted(specs, named, True, dict(found.withheld), unreadable, undecided)


class MpsManager:
    def __init__(self, root: Root, state: AgentState, control: MpsControl, modes: ComputeModes,
                 changed: Callable[[], None], timing: Timing = Timing()) -> None:
        self.root = root
        self.timing = timing
        self.state = state
        self.control = control
        self.modes = modes
        self.changed = changed  # the daemon publishes: the plugin sees a daemon go down or come back
        self.ledger = Ledger(root)
        self.daemons: dict[str, Daemon] = {}
        self._wake: Optional[asyncio.Event] = None
        self._bug: Optional[str] = None  # the last unexpected failure logged
        self._shm_problem: Optional[str] = None

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = wake = asyncio.Event()
        while True:
            wake.clear()
            try:
                await self.sync()
            except Exception as exc:  # a bug: logged (once while it repeats), the watch goes on
                if repr(exc) != self._bug:
                    log.exception("MPS control daemon watch failed; this is a gpu-agent bug")
                self._bug = repr(exc)
            if self.daemons:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.timing.poll_s)
            else:
                await wake.wait()

    async def sync(self) -> None:
        await asyncio.to_thread(self._sync)

    def _sync(self) -> None:
        wanted = wanted_daemons(self.root, self.state)
        for resource in sorted(set(wanted.specs) | wanted.named | set(left_over(self.ledger))):
            self.daemons.setdefault(resource, Daemon(resource))
        for resource, daemon in sorted(self.daemons.items()):
            if not self._advance(daemon, wanted):
                del self.daemons[resource]
        if not self.daemons:
            self._release_shm()
        self._publish(wanted.withheld)

    def _advance(self, daemon: Daemon, wanted: Wanted) -> bool:
        """Steps until the daemon's phase holds (a few at most): look, decide, act. False once its record is
        dropped (removed for good)."""
        for _ in range(MAX_STEPS):
            facts, seen = self._observe(daemon, wanted)
            step = decide(daemon.phase, facts)
            failed = self._act(daemon, step, wanted.specs.get(daemon.resource))
            if step.phase is None:
                if failed is None:
                    return False
                daemon.error = failed  # kept, and removed again on the next pass
                self._log_once(daemon, f"MPS control daemon for {daemon.resource}: cannot remove what is left of it")
                return True
            before = daemon.phase
            self._enter(daemon, step, failed, seen)
            if step.action is Action.NONE and step.phase is before:
                return True
        return True

    # --- what the node shows ------------------------------------------------------------------------------

    def _observe(self, daemon: Daemon, wanted: Wanted) -> tuple[Facts, Optional[str]]:
        """The facts `decide` takes, and what is wrong with the daemon if anything is."""
        want = wanted.want(daemon.resource)
        if want is not Want.NO and daemon.resource in held_by_reload(self.ledger):  # read at each step: it is quit
            want = Want.HELD                                                         # and started by another thread
        now = time.monotonic()
        due = now >= daemon.next_try
        daemon.pid = self.control.pid(DaemonSpec.left(daemon.resource))
        seen = Seen.ABSENT if daemon.pid is None else Seen.ANSWERS
        if daemon.pid is not None and daemon.spec is None:  # /status shows what runs, as far as its record tells
            daemon.spec = instance.read(self.root, daemon.resource)
        if want is Want.HELD:
            return Facts(want, seen, Settings.UNREAD, due), ("quit by the driver reload for the unload; started again "
                                                             "once the reload is validated")
        if want is Want.UNDECIDED:
            return Facts(want, seen, Settings.UNREAD, due), ("no GPU inventory (NVML does not answer): nothing is "
                                                             "started, stopped or checked until there is one")
        spec = wanted.specs.get(daemon.resource)
        if seen is Seen.ABSENT or spec is None:
            return Facts(want, seen, Settings.UNREAD, due), "its control daemon exited" if spec else None
        if daemon.spec is not None and serves_but_for_unreadable(daemon.spec, spec, wanted.unreadable):
            spec = daemon.spec  # its clients on the GPUs NVML reads keep their server
        if daemon.phase is Phase.RUNNING:
            if not spec.runs_as(daemon.spec):
                return Facts(want, seen, Settings.DIFFERENT, due), f"the config asks for {describe(spec)}"
            daemon.spec = spec  # the GPUs' indices as NVML has them now
            if now - daemon.probed_at < self.timing.probe_s:
                return Facts(want, seen, Settings.SAME, due), None
            daemon.probed_at = now  # every probe_s: it answers, and still with the settings it was given
        if daemon.phase is Phase.DOWN and not due:  # nothing is done before the backoff has passed: not read
            return Facts(want, seen, Settings.UNREAD, due), None
        if daemon.phase in (Phase.RUNNING, Phase.ADOPTED, Phase.STARTING, Phase.DOWN):
            seen, settings, problem = read_back(self.root, self.control, spec)
            if settings is Settings.SAME:  # then its GPUs' compute modes: a driver reload resets them
                settings, problem = self._read_modes(daemon, spec)
            return Facts(want, seen, settings, due), problem
        return Facts(want, Seen.ANSWERS, Settings.UNREAD, due), None

    def _read_modes(self, daemon: Daemon, spec: DaemonSpec) -> tuple[Settings, Optional[str]]:
        """Settings.MODES, naming them, when a GPU of the daemon's is not in EXCLUSIVE_PROCESS; a GPU whose mode
        NVML cannot read is that GPU's fact, and left out."""
        seen = {}
        for uuid in spec.gpus:
            try:
                seen[uuid] = self.modes.compute_mode(uuid)
            except AgentError:
                continue
        daemon.modes = seen
        off = [f"GPU {index} is in {seen[uuid]}" for uuid, index in zip(spec.gpus, spec.indices)
               if seen.get(uuid, EXCLUSIVE) != EXCLUSIVE]
        if not off:
            return Settings.SAME, None
        return Settings.MODES, (f"{', '.join(off)} compute mode, not {EXCLUSIVE} (reset by a driver reload, a reboot "
                                "or by hand)")

    # --- the steps ----------------------------------------------------------------------------------------

    def _act(self, daemon: Daemon, step: Step, spec: Optional[DaemonSpec]) -> Optional[str]:
        """Take the step's action; why it failed, else None."""
        try:
            if step.action is Action.ADOPT:
                self._adopt(daemon)
            elif step.action is Action.START and spec is not None:
                self._start(daemon, spec)
            elif step.action is Action.QUIT:
                return stop_daemon(self.control, DaemonSpec.left(daemon.resource))
            elif step.action is Action.EXCLUSIVE:
                self._exclusive(daemon, daemon.spec or spec)
            elif step.action is Action.REMOVE:
                self._remove(daemon)
        except AgentError as exc:
            return str(exc)
        except OSError as exc:  # what the agent itself could not do on the host: named, never a traceback
            return f"{exc.filename or daemon.resource}: {exc.strerror or exc}"
        return None

    def _exclusive(self, daemon: Daemon, spec: Optional[DaemonSpec]) -> None:
        """Its GPUs in EXCLUSIVE_PROCESS again, the daemon left running: its clients keep their server."""
        if spec is None:
            raise AgentError(f"no record of the GPUs of the MPS control daemon for {daemon.resource}")
        daemon.modes_before = exclusive(self.ledger, self.modes, spec)
        daemon.modes = {uuid: EXCLUSIVE for uuid in spec.gpus}

    def _adopt(self, daemon: Daemon) -> None:
        """A daemon from before this process: what it was started with, the compute modes recorded for its
        GPUs, and the tmpfs its clients are given (mounted again if it went)."""
        daemon.spec = instance.read(self.root, daemon.resource)
        daemon.started_at = time.time()
        recorded = self.ledger.compute_modes()
        daemon.modes_before = {uuid: mode for uuid, (mode, owner) in recorded.items() if owner == daemon.resource}
        log.info("MPS control daemon for %s (pid %s) already runs; adopted, its settings read back", daemon.resource,
                 daemon.pid)
        shm.ensure(self.root, self.ledger, self.control)

    def _start(self, daemon: Daemon, spec: DaemonSpec) -> None:
        """The daemon started (none runs now) in its directories, kept if they are there, and its limits set."""
        for problem in restore_compute_modes(self.ledger, self.modes, spec.resource, keep=spec.gpus):
            log.warning("%s", problem)  # GPUs the daemon had before and no longer has
        daemon.modes_before = start_daemon(self.root, self.ledger, self.control, self.modes, spec)
        daemon.spec, daemon.started_at, daemon.probed_at = spec, time.time(), time.monotonic()
        daemon.modes = {uuid: EXCLUSIVE for uuid in spec.gpus}

    def _remove(self, daemon: Daemon) -> None:
        """Gone, and the config no longer asks for it: its GPUs' compute modes back, its directories removed."""
        if daemon.phase is not Phase.UNKNOWN or daemon.spec is not None:
            log.info("MPS control daemon for %s stopped: the config no longer shares it by MPS", daemon.resource)
        for problem in restore_compute_modes(self.ledger, self.modes, daemon.resource):
            log.warning("%s", problem)
        for directory in remove_mps_directories(self.root, self.ledger, daemon.resource):
            log.info("%s: removed (gpu-agent no longer manages it)", directory)

    def _release_shm(self) -> None:
        """No daemon is left: the tmpfs unmounted, then the directories it was in (/run/nvidia/mps)."""
        problem = shm.release(self.root, self.ledger, self.control)
        if problem is not None and problem != self._shm_problem:
            log.warning("%s", problem)
        self._shm_problem = problem
        if problem is None:
            for directory in remove_mps_directories(self.root, self.ledger):
                log.info("%s: removed (gpu-agent no longer manages it)", directory)

    def _enter(self, daemon: Daemon, step: Step, failed: Optional[str], seen: Optional[str]) -> None:
        """The record after the step: its phase, its problem, the backoff and the restarts counted. `failed`:
        why the step's action failed; `seen`: what the look before it found wrong."""
        if step.action is Action.EXCLUSIVE:
            if failed is not None:  # the compute modes could not be set: down, tried again after the backoff
                step = Step(Action.NONE, Phase.DOWN)
            else:
                log.info("MPS control daemon for %s: %s; set to %s again, the daemon left running", daemon.resource,
                         seen, EXCLUSIVE)
        before, daemon.phase = daemon.phase, step.phase or daemon.phase
        if step.action is Action.START and before in (Phase.DOWN, Phase.STOPPING):
            daemon.restarts += 1
        if step.phase is Phase.RUNNING:
            if before is not Phase.RUNNING:
                self._log_running(daemon)
            daemon.error, daemon.failures, daemon.logged = None, 0, None
        elif step.phase in (Phase.UNKNOWN, Phase.ADOPTED):
            daemon.error = failed or seen
        elif step.phase is Phase.STARTING:
            daemon.error = failed  # kept for the look that follows: the start's failure is why it is down
        elif step.action is Action.QUIT:
            if failed is not None:
                self._failed(daemon, failed)
            else:
                log.info("MPS control daemon for %s: %s; sent quit", daemon.resource,
                         seen or "the config no longer shares it by MPS")
                daemon.error = seen
        elif step.phase is Phase.DOWN and before is not Phase.DOWN:
            started = daemon.error if before is Phase.STARTING else None
            self._failed(daemon, failed or started or seen or "it does not run as asked")

    def _failed(self, daemon: Daemon, problem: str) -> None:
        """Down, or not stopped: tried again after the backoff; the same problem is logged once."""
        first, longest = self.timing.backoff_s
        daemon.error = problem
        daemon.failures += 1
        daemon.next_try = time.monotonic() + min(longest, first * 2 ** (daemon.failures - 1))
        self._log_once(daemon, f"MPS control daemon for {daemon.resource} is {daemon.phase.value}")

    def _log_once(self, daemon: Daemon, what: str) -> None:
        """`what` and the daemon's problem, unless that problem was the last one logged for it."""
        if daemon.error != daemon.logged:
            log.warning("%s: %s; trying again with a backoff of up to %g s", what, daemon.error,
                        self.timing.backoff_s[1])
            daemon.logged = daemon.error

    def _log_running(self, daemon: Daemon) -> None:
        spec = daemon.spec
        if spec is None:
            return
        log.info("MPS control daemon for %s runs (pid %s): GPUs %s, %d%% of threads and %s per client",
                 daemon.resource, daemon.pid, ",".join(map(str, spec.indices)), spec.thread_percentage,
                 "/".join(limit for _, limit in spec.pinned_limits()) or "no memory limit")

    def _publish(self, withheld: dict[str, str]) -> None:
        daemons = [daemon.to_json() for _, daemon in sorted(self.daemons.items())]
        down = {name: daemon.why_not_running() for name, daemon in self.daemons.items()
                if daemon.phase is not Phase.RUNNING}
        running = [name for name, daemon in self.daemons.items() if daemon.phase is Phase.RUNNING]
        section = {"daemons": daemons, "withheld": withheld} if daemons or withheld else None
        if self.state.publish_mps(section, down, running):
            self.changed()


def start_daemon(root: Root, ledger: Ledger, control: MpsControl, modes: ComputeModes,
                 spec: DaemonSpec) -> dict[str, str]:
    """Start the daemon `spec` asks for (none runs now) in its directories, kept if they are there: its record
    written, the tmpfs mounted, its GPUs in EXCLUSIVE_PROCESS, its limits set. Returns the compute modes its
    GPUs had before the agent, by UUID; an AgentError says what failed."""
    make_directories(root, ledger, spec.resource)
    try:
        instance.write(root, spec)
    except OSError as exc:
        raise AgentError(f"cannot write {record_path(spec.resource)} (what its MPS control daemon is started "
                         f"with): {exc.strerror or exc}") from None
    shm.ensure(root, ledger, control)
    before = exclusive(ledger, modes, spec)
    control.start(spec)
    for ordinal, limit in spec.pinned_limits():
        control.send(spec, f"set_default_device_pinned_mem_limit {ordinal} {limit}")
    control.send(spec, f"set_default_active_thread_percentage {spec.thread_percentage}")
    return before


def make_directories(root: Root, ledger: Ledger, resource: str) -> None:
    """/run/nvidia, then MPS_ROOT down to the resource's pipe and log directories: each one made recorded in
    the ledger first (but /run/nvidia, which is not under MPS_ROOT), what is there kept."""
    pipe, logs = pipe_dir(resource), log_dir(resource)
    purposes = {pipe: "the MPS control daemon's pipes, which its clients mount",
                logs: "the MPS control daemon's logs"}
    for directory in (MPS_ROOT.rsplit("/", 1)[0], *_ancestors(resource_dir(resource)), pipe, logs):
        purpose = purposes.get(directory, "the MPS pipe and log directories go there")
        path = root(directory)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise AgentError(f"{directory}: not a directory ({purpose}); remove it")
        if path.exists():
            continue
        outside = not directory.startswith(MPS_ROOT)  # /run/nvidia, and what it is in, are the node's
        if not outside:
            ledger.own_mps_directory(directory, resource)
        try:
            path.mkdir(mode=0o755, parents=outside)
        except OSError as exc:
            raise AgentError(f"cannot make {directory} ({purpose}): {exc.strerror or exc}") from None


def serves_but_for_unreadable(started: DaemonSpec, spec: DaemonSpec, unreadable: frozenset[str]) -> bool:
    """Whether a daemon started as `started` is the one `spec` asks for but for GPUs NVML cannot read now: a
    GPU off the bus is that GPU's fact, so the daemon goes on; one that stops starts again without it."""
    kept = without(started, unreadable)
    return len(kept.gpus) < len(started.gpus) and spec.runs_as(kept)


def without(spec: DaemonSpec, gpus: Collection[str]) -> DaemonSpec:
    """`spec` on its GPUs but those of `gpus` (UUIDs)."""
    keep = [n for n, uuid in enumerate(spec.gpus) if uuid not in gpus]
    pinned = None if spec.pinned_mib is None else tuple(spec.pinned_mib[n] for n in keep)
    return replace(spec, gpus=tuple(spec.gpus[n] for n in keep), indices=tuple(spec.indices[n] for n in keep),
                   memory_mib=tuple(spec.memory_mib[n] for n in keep), pinned_mib=pinned)


def describe(spec: DaemonSpec) -> str:
    gpus = f"GPUs {','.join(map(str, spec.indices))}"
    if spec.threads is None and spec.pinned_mib is None:
        return f"{gpus} with {spec.replicas} replicas"
    limits = "/".join(limit for _, limit in spec.pinned_limits()) or "no memory limit"
    return f"{gpus} with {spec.thread_percentage} % of their threads and pinned memory {limits}"


def read_back(root: Root, control: MpsControl, spec: DaemonSpec) -> tuple[Seen, Settings, Optional[str]]:
    """Whether the running daemon is what `spec` asks for: its /dev/shm the tmpfs, its record (what it was
    started with: its GPUs, which the control pipe does not show) `spec`'s, and the thread percentage and
    each GPU's pinned memory limit it shows those `spec` sets (shown in whole GiB: the record tells the
    rest). Seen.SILENT when it does not answer."""
    resource = spec.resource
    if not control.uses_shm(spec):
        return Seen.ANSWERS, Settings.DIFFERENT, (f"the MPS control daemon for {resource} does not have {SHM_DIR} as "
                                                  "its /dev/shm, as its clients do")
    started = instance.read(root, resource)
    if started is None:  # started by a gpu-agent from before the record: its GPUs cannot be told
        return Seen.ANSWERS, Settings.DIFFERENT, (f"no record of what the MPS control daemon for {resource} was "
                                                  f"started with ({record_path(resource)})")
    if not spec.runs_as(started):
        return Seen.ANSWERS, Settings.DIFFERENT, (f"the MPS control daemon for {resource} runs {describe(started)}; "
                                                  f"the config asks for {describe(spec)}")
    try:
        threads = control.send(spec, "get_default_active_thread_percentage").strip()
        shown = {ordinal: control.send(spec, f"get_default_device_pinned_mem_limit {ordinal}").strip()
                 for ordinal, _ in spec.pinned_limits()}
    except AgentError as exc:
        return Seen.SILENT, Settings.UNREAD, str(exc)
    if threads != f"{spec.thread_percentage:.1f}":
        return Seen.ANSWERS, Settings.DIFFERENT, (
            f"the MPS control daemon for {resource} shows a default active thread percentage of {threads or 'none'}, "
            f"not {spec.thread_percentage:.1f}: its clients would not be limited as asked")
    for ordinal, limit in spec.pinned_limits():
        if shown[ordinal] != shown_limit(limit):
            return Seen.ANSWERS, Settings.DIFFERENT, (
                f"the MPS control daemon for {resource} shows the pinned memory limit of its device {ordinal} as "
                f"{shown[ordinal] or 'none'}, not {shown_limit(limit)} ({limit}): its clients would not be limited "
                "as asked")
    return Seen.ANSWERS, Settings.SAME, None


def stop_daemon(control: MpsControl, spec: DaemonSpec, wait_s: float = QUIT_WAIT_S) -> Optional[str]:
    """`quit` to the daemon, as NVIDIA's does to stop it, then SIGTERM if it has not exited within `wait_s`
    (it waits for its clients, or does not answer), then as long again; None once it runs no more, else why
    it still runs."""
    pid = control.pid(spec)
    if pid is None:
        return None
    try:
        control.send(spec, "quit")
    except AgentError as exc:
        log.warning("MPS control daemon for %s: %s", spec.resource, exc)
    if _exited(control, spec, wait_s):
        return None
    log.warning("MPS control daemon for %s (pid %d) still runs %g s after quit; sending it SIGTERM", spec.resource,
                pid, wait_s)
    control.terminate(spec)
    if _exited(control, spec, wait_s):
        return None
    return f"the MPS control daemon for {spec.resource} (pid {pid}) still runs after quit and SIGTERM"


def _exited(control: MpsControl, spec: DaemonSpec, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while control.pid(spec) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _ancestors(directory: str) -> list[str]:
    """MPS_ROOT, then each directory down to `directory`: /run/nvidia/mps, .../nvidia.com, .../nvidia.com/gpu."""
    parts = directory[len(MPS_ROOT):].strip("/").split("/")
    return [MPS_ROOT] + [f"{MPS_ROOT}/{'/'.join(parts[:n])}" for n in range(1, len(parts) + 1)]


def passed_through(root: Root, state: AgentState) -> frozenset[str]:
    """The UUIDs of the GPUs whose mode is vm-passthrough, or that the vfio stage's ledger records name (on
    their way to vfio-pci, or there): no daemon serves them."""
    workload = state.workload
    found = {gpu.uuid for gpu in workload.vm_gpus() if gpu.uuid} if workload is not None else set()
    try:
        records = Ledger(root).vfio()
    except AgentError:  # the ledger's own problem, which the stages report
        records = {}
    return frozenset(found | {entry["uuid"] for entry in records.values() if isinstance(entry.get("uuid"), str)})


def held_by_reload(ledger: Ledger) -> frozenset[str]:
    """The resources whose daemons an unfinished driver reload quit for its unload and starts again itself (its
    ledger record's stopped_mps, which every end of a reload empties): none of them is started meanwhile."""
    entry = ledger.driver_reload()
    names = entry.get("stopped_mps") if entry is not None else None
    return frozenset(name for name in names if isinstance(name, str)) if isinstance(names, list) else frozenset()


def left_over(ledger: Ledger) -> list[str]:
    """The resources whose daemons' directories or GPUs' compute modes the ledger holds."""
    return sorted(set(ledger.mps_directories().values()) | {owner for _, owner in ledger.compute_modes().values()})


def exclusive(ledger: Ledger, modes: ComputeModes, spec: DaemonSpec) -> dict[str, str]:
    """Each of the daemon's GPUs in EXCLUSIVE_PROCESS compute mode, as NVIDIA's mps-control-daemon sets them
    before it starts (its daemon.go setComputeMode), the mode each had before recorded first (kept from an
    earlier start). Returns those, by UUID."""
    before = {}
    for uuid, index in zip(spec.gpus, spec.indices):
        try:
            now = modes.compute_mode(uuid)
            before[uuid] = ledger.save_compute_mode(uuid, now, spec.resource)
            if now != EXCLUSIVE:
                modes.set_compute_mode(uuid, EXCLUSIVE)
        except AgentError as exc:
            raise AgentError(f"cannot set GPU {index} to {EXCLUSIVE} compute mode, which MPS needs: {exc}") from None
    return before


def restore_compute_modes(ledger: Ledger, modes: ComputeModes, resource: str, keep: tuple[str, ...] = ()) -> list[str]:
    """The compute mode each GPU had before `resource`'s daemon, put back and forgotten (but those of the GPUs
    in `keep`, which its next start keeps); what failed stays recorded and is returned."""
    problems = []
    for uuid, (mode, owner) in sorted(ledger.compute_modes().items()):
        if owner != resource or uuid in keep:
            continue
        try:
            modes.set_compute_mode(uuid, mode)
        except AgentError as exc:
            problems.append(f"cannot put GPU {uuid}'s compute mode back to {mode} (set to {EXCLUSIVE} for the MPS "
                            f"control daemon of {resource}): {exc}")
            continue
        ledger.clear_compute_mode(uuid)
        log.info("GPU %s: compute mode %s again", uuid, mode)
    return problems


def stop_left_over(root: Root, ledger: Ledger, control: MpsControl, modes: ComputeModes,
                   wait_s: float = QUIT_WAIT_S) -> list[str]:
    """Stop the daemon of each resource the ledger holds directories or compute modes of, then put its
    GPUs' compute modes back and remove its directories; a daemon that does not stop keeps them. Returns
    what could not be done."""
    problems, stopped = [], []
    for resource in left_over(ledger):
        problem = stop_daemon(control, DaemonSpec.left(resource), wait_s)
        if problem is None:
            stopped.append(resource)
        else:
            problems.append(f"{problem}; its directories under {resource_dir(resource)} and its GPUs' compute "
                            "mode are left")
    if not problems:  # no daemon runs: their shared memory goes before the directory it is in
        problem = shm.release(root, ledger, control)
        problems += [problem] if problem else []
    for resource in stopped:
        problems += restore_compute_modes(ledger, modes, resource)
        for directory in remove_mps_directories(root, ledger, resource):
            log.info("%s: removed (gpu-agent no longer manages it)", directory)
    return problems


def remove_mps_directories(root: Root, ledger: Ledger, resource: Optional[str] = None) -> list[str]:
    """Remove the MPS directories the ledger holds (of `resource`, or all), deepest first: a resource's
    own directory with what the daemon left in it, a shared parent (/run/nvidia/mps) once it is empty.
    Returns those removed."""
    removed = []
    for directory, owner in sorted(ledger.mps_directories().items(), key=lambda item: -len(item[0])):
        if resource is not None and owner != resource and not resource_dir(resource).startswith(directory + "/"):
            continue
        path = root(directory)
        if directory == resource_dir(owner) or directory.startswith(resource_dir(owner) + "/"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
        elif path.is_dir() and not path.is_symlink():
            try:
                path.rmdir()
            except OSError:
                continue  # another resource's directories are still in it
        ledger.disown_mps_directory(directory)
        removed.append(directory)
    return removed
