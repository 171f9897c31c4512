"""The MPS control daemons, one per resource shared by `plugin.sharing.mps`, run and watched by the agent.

For each such resource it makes /run/nvidia/mps/<resource>/{pipe,log} (recorded in the ledger first),
mounts the daemons' shared tmpfs at /run/nvidia/mps/shm before the first one starts (mps.shm), starts
`nvidia-cuda-mps-control -d` for exactly that resource's GPUs, sets the default active thread
percentage (100 / replicas) and each GPU's pinned memory limit (its memory / replicas) as NVIDIA's
mps-control-daemon does, and checks that it answers (get_server_list). It looks at each daemon every
half second (Timing): one that died (or stops answering) is down, its devices Unhealthy in the plugin,
and it is started again after a backoff (1 s, doubling to 30 s), the restarts counted. A resource the
config no longer shares gets `quit` and its directories removed; the tmpfs is unmounted once no daemon
runs. A daemon left running by a previous agent process is adopted (its pid file in the pipe
directory), so an agent restart does not cut off the clients.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from gpu_agent.config.plugin import mig_strategy, plugin_wanted
from gpu_agent.errors import AgentError
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps import shm
from gpu_agent.mps.control import ComputeModes, DaemonSpec, MpsControl, shown_limit
from gpu_agent.mps.layout import MPS_ROOT, SHM_DIR, log_dir, pipe_dir, resource_dir
from gpu_agent.plugin.devices import advertised
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)



EXCLUSIVE = "EXCLUSIVE_PROCESS"
QUIT_WAIT_S = 5.0  # how long a daemon may take to exit after quit, and again after SIGTERM


@dataclass(frozen=True)
class Timing:
    poll_s: float = 0.5  # how often a daemon's pid is looked at: a dead one is seen within a second
    probe_s: float = 10.0  # how often a running daemon must answer get_server_list
    backoff_s: tuple[float, float] = (1.0, 30.0)  # the first wait before a restart, and the longest


@dataclass
class Running:
    spec: DaemonSpec
    pid: Optional[int] = None
    started_at: Optional[float] = None
    restarts: int = 0
    failures: int = 0  # in a row: the backoff's exponent
    error: Optional[str] = None  # why it is down
    next_try: float = 0.0
    probed_at: float = 0.0
    modes_before: dict[str, str] = field(default_factory=dict)  # by GPU UUID: the compute mode put back at its stop

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        return {"resource": spec.resource, "gpus": list(spec.indices), "uuids": list(spec.gpus),
                "replicas": spec.replicas, "pid": self.pid, "up": self.error is None and self.pid is not None,
                "started_at": self.started_at, "active_thread_percentage": spec.thread_percentage,
                "pinned_memory_limits": {str(spec.indices[n]): limit for n, limit in spec.pinned_limits()},
                "pipe_directory": pipe_dir(spec.resource), "restarts": self.restarts, "error": self.error,
                "compute_mode": EXCLUSIVE if self.modes_before else None,
                "compute_modes_before": {str(index): self.modes_before[uuid]
                                         for uuid, index in zip(spec.gpus, spec.indices) if uuid in self.modes_before}}


def wanted_daemons(root: Root, state: AgentState) -> tuple[dict[str, DaemonSpec], dict[str, str]]:
    """By resource, the daemons the config and the GPUs ask for; and the MPS resources withheld, with why."""
    settings = state.config.config.plugin
    if settings.sharing.strategy != "mps" or not plugin_wanted(root, settings):
        return {}, {}
    inventory = state.inventory or state.last_inventory
    if inventory is not None:  # a daemon starts on the GPUs NVML reads: it could not set a lost one's compute mode
        inventory = replace(inventory, gpus=inventory.readable)
    found = advertised(inventory, {}, mig_strategy(state.config.config), settings)
    specs: dict[str, DaemonSpec] = {}
    gpus = {gpu.uuid: gpu for gpu in inventory.gpus} if inventory else {}
    for name, resource in found.resources.items():
        if resource.strategy != "mps":
            continue
        order = sorted({device.gpu_uuid: device.gpu_index for device in resource.devices}.items(), key=lambda i: i[1])
        specs[name] = DaemonSpec(name, tuple(uuid for uuid, _ in order), tuple(index for _, index in order),
                                 tuple(gpus[uuid].memory_mib for uuid, _ in order), resource.replicas)
    return specs, dict(found.withheld)


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
        self.daemons: dict[str, Running] = {}
        self._wake: Optional[asyncio.Event] = None

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = wake = asyncio.Event()
        while True:
            wake.clear()
            try:
                await self.sync()
            except Exception:  # a bug: log it, keep watching
                log.exception("MPS control daemon watch failed; this is a gpu-agent bug")
            if self.daemons:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.timing.poll_s)
            else:
                await wake.wait()

    async def sync(self) -> None:
        wanted, withheld = await asyncio.to_thread(wanted_daemons, self.root, self.state)
        unreadable = self._unreadable()
        for name in [name for name, running in self.daemons.items()
                     if not _serves(running, wanted.get(name), unreadable)]:
            await asyncio.to_thread(self._stop, self.daemons.pop(name))
        for name, spec in wanted.items():
            running = self.daemons.setdefault(name, Running(spec))
            if running.pid is None and running.spec != spec:  # down: it starts again on the GPUs NVML reads
                running.spec = spec
            await asyncio.to_thread(self._keep, running)
        if not wanted:
            await asyncio.to_thread(self._remove_left_over)
        self._publish(withheld)

    def _unreadable(self) -> frozenset[str]:
        """The UUIDs of the GPUs discovery found but NVML cannot read now."""
        inventory = self.state.inventory or self.state.last_inventory
        return frozenset(gpu.uuid for gpu in inventory.gpus if gpu.unreadable) if inventory else frozenset()

    def _keep(self, running: Running) -> None:
        """Start it if it is not running and its backoff has passed; see whether a running one still runs."""
        now = time.monotonic()
        spec = running.spec
        first, longest = self.timing.backoff_s
        if running.pid is None and running.error is None:  # first look: a daemon from before may run
            running.pid = self.control.pid(spec)
            if running.pid is not None:
                log.info("MPS control daemon for %s (pid %d) already runs; adopted", spec.resource, running.pid)
                try:  # the tmpfs its clients are given
                    shm.ensure(self.root, self.ledger, self.control)
                except AgentError as exc:
                    log.warning("MPS control daemon for %s: %s", spec.resource, exc)
                    running.error, running.pid, running.next_try, running.failures = str(exc), None, now + first, 1
                    return
                if not self.control.uses_shm(spec):  # started by a gpu-agent before the tmpfs: not its clients'
                    log.warning("MPS control daemon for %s does not have %s as its /dev/shm, as its clients do; "
                                "starting it again", spec.resource, SHM_DIR)
                    problem = stop_daemon(self.control, spec)
                    running.pid = None
                    if problem is not None:
                        running.error, running.next_try, running.failures = problem, now + first, 1
                    return
                running.started_at = time.time()
                recorded = self.ledger.compute_modes()
                running.modes_before = {uuid: recorded[uuid][0] for uuid in spec.gpus if uuid in recorded}
                return
        if running.error is None and running.pid is not None:
            pid = self.control.pid(spec)
            problem = None if pid is not None else "its control daemon exited"
            if problem is None and now - running.probed_at >= self.timing.probe_s:
                problem = self._probe(spec)
                running.probed_at = now
            if problem is None:
                running.pid = pid
                return
            log.warning("MPS control daemon for %s is down: %s; starting it again", spec.resource, problem)
            running.error, running.pid, running.next_try = problem, None, now + first
            running.failures = 1
            return
        if now < running.next_try:
            return
        restarting = running.error is not None
        try:
            running.pid = self._start(running)
        except AgentError as exc:
            running.error = str(exc)
            running.failures += 1
            running.next_try = now + min(longest, first * 2 ** (running.failures - 1))
            log.warning("MPS control daemon for %s: %s; trying again in %.0f s", spec.resource, exc,
                        running.next_try - now)
            return
        if restarting:
            running.restarts += 1
        running.error, running.failures, running.started_at, running.probed_at = None, 0, time.time(), now
        log.info("MPS control daemon for %s started (pid %s): GPUs %s, %d%% of threads and %s per client",
                 spec.resource, running.pid, ",".join(map(str, spec.indices)), spec.thread_percentage,
                 "/".join(limit for _, limit in spec.pinned_limits()) or "no memory limit")

    def _start(self, running: Running) -> Optional[int]:
        spec = running.spec
        self.root(MPS_ROOT).parent.mkdir(parents=True, exist_ok=True)
        for directory in (*_ancestors(resource_dir(spec.resource)), pipe_dir(spec.resource), log_dir(spec.resource)):
            path = self.root(directory)
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                raise AgentError(f"{directory}: not a directory (the MPS pipe and log directories go there); "
                                 "remove it")
            if not path.exists():
                self.ledger.own_mps_directory(directory, spec.resource)
                path.mkdir(mode=0o755)
        shm.ensure(self.root, self.ledger, self.control)
        running.modes_before = exclusive(self.ledger, self.modes, spec)
        if self.control.pid(spec) is None:
            self.control.start(spec)
        for ordinal, limit in spec.pinned_limits():
            self.control.send(spec, f"set_default_device_pinned_mem_limit {ordinal} {limit}")
            shown = self.control.send(spec, f"get_default_device_pinned_mem_limit {ordinal}").strip()
            if shown != shown_limit(limit):
                raise AgentError(f"the MPS control daemon for {spec.resource} shows the pinned memory limit of its "
                                 f"device {ordinal} as {shown or 'none'} after it was set to {limit} (expected "
                                 f"{shown_limit(limit)}): its clients would not be limited")
        expected = f"{spec.thread_percentage:.1f}"
        answer = self.control.send(spec, f"set_default_active_thread_percentage {spec.thread_percentage}").strip()
        if answer != expected:
            raise AgentError(f"the MPS control daemon for {spec.resource} answered {answer or 'nothing'} to "
                             f"set_default_active_thread_percentage {spec.thread_percentage} (expected {expected}): "
                             "its clients would not be limited")
        problem = self._probe(spec)
        if problem is not None:
            raise AgentError(problem)
        return self.control.pid(spec)

    def _probe(self, spec: DaemonSpec) -> Optional[str]:
        try:
            self.control.send(spec, "get_server_list")
        except AgentError as exc:
            return str(exc)
        return None

    def _stop(self, running: Running) -> None:
        spec = running.spec
        problem = stop_daemon(self.control, spec)
        if problem is not None:
            log.warning("%s; its directories and its GPUs' compute mode are left", problem)
            return
        log.info("MPS control daemon for %s stopped: the config no longer shares it by MPS", spec.resource)
        for problem in restore_compute_modes(self.ledger, self.modes, spec.resource):
            log.warning("%s", problem)
        self._remove_directories(spec.resource)

    def _remove_left_over(self) -> None:
        """The daemons and directories of resources no longer shared (by a previous agent process, too)."""
        for problem in stop_left_over(self.root, self.ledger, self.control, self.modes):
            log.warning("%s", problem)

    def _remove_directories(self, resource: str) -> None:
        remove_mps_directories(self.root, self.ledger, resource)

    def stop_all(self) -> None:
        for name in list(self.daemons):
            self._stop(self.daemons.pop(name))

    def _publish(self, withheld: dict[str, str]) -> None:
        daemons = [running.to_json() for _, running in sorted(self.daemons.items())]
        down = {name: f"its MPS control daemon is down: {running.error}" for name, running in self.daemons.items()
                if running.error is not None or running.pid is None}
        section = {"daemons": daemons, "withheld": withheld} if daemons or withheld else None
        if self.state.publish_mps(section, down):
            self.changed()


def _serves(running: Running, wanted: Optional[DaemonSpec], unreadable: frozenset[str]) -> bool:
    """Whether a daemon may go on: as wanted, or wanted but for GPUs NVML cannot read now (one off the bus is
    that GPU's fact: the daemon's clients on the others keep their server; one down starts without it)."""
    spec = running.spec
    if wanted is None or spec == wanted:
        return wanted is not None
    keep = [n for n, uuid in enumerate(spec.gpus) if uuid not in unreadable]
    return len(keep) < len(spec.gpus) and wanted == replace(
        spec, gpus=tuple(spec.gpus[n] for n in keep), indices=tuple(spec.indices[n] for n in keep),
        memory_mib=tuple(spec.memory_mib[n] for n in keep))


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


def restore_compute_modes(ledger: Ledger, modes: ComputeModes, resource: str) -> list[str]:
    """The compute mode each GPU had before `resource`'s daemon, put back and forgotten; what failed stays
    recorded and is returned."""
    problems = []
    for uuid, (mode, owner) in sorted(ledger.compute_modes().items()):
        if owner != resource:
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
