"""The agent's own MPS control daemons as the driver reload (stages/driver_reload.py) deals with them.

An MPS server keeps /dev/nvidia* open after its last client has gone, so with MPS on the GPUs never look idle
and nvidia does not unload. The reload therefore counts neither a daemon of the agent's (a resource the ledger
holds directories or compute modes of) nor the servers it forked (its children: a real daemon logs the fork as
itself, "Control 710] Starting new server 710 for user 0", tests/data/mps/h200-580-vm/control-pipe.json) as a GPU
user, quits the daemons before the unload, its record naming them first (stopped_mps), and starts them again
once the reload is validated, or at any end: their GPUs set to EXCLUSIVE_PROCESS again first (a module reload
resets the compute mode to DEFAULT), in their directories, which pods keep mounted. While the record names a
resource, the MPS watch (mps.daemons.held_by_reload) starts no daemon for it.
"""
from __future__ import annotations

from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import processes
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps import instance
from gpu_agent.mps.control import ComputeModes, DaemonSpec, MpsControl
from gpu_agent.mps.daemons import left_over, restore_compute_modes, start_daemon, stop_daemon, without
from gpu_agent.mps.layout import record_path


class ReloadMps:
    """`root`: the agent's (its ledger, the MPS directories); `procs`: the /proc the GPU users are read from."""

    def __init__(self, root: Root, control: MpsControl, modes: ComputeModes, procs: Optional[Root] = None) -> None:
        self.root = root
        self.control = control
        self.modes = modes
        self.procs = procs or root
        self.ledger = Ledger(root)

    def running(self) -> list[str]:
        """The resources whose daemons (the agent's own) run now."""
        return [resource for resource in left_over(self.ledger) if self._pid(resource) is not None]

    def own(self, users: list[processes.NamedProcess]) -> set[int]:
        """Of `users` (processes with a GPU open), the pids that are the agent's daemons or the MPS servers they
        forked: never GPU users to wait for."""
        daemons = {pid for resource in left_over(self.ledger) if (pid := self._pid(resource)) is not None}
        if not daemons:
            return set()
        return {user.pid for user in users
                if user.pid in daemons or processes.parent(self.procs, user.pid) in daemons}

    def serving(self, uuid: str) -> list[tuple[str, int]]:
        """(resource, pid) of the running daemons started with the GPU `uuid` among theirs (their records)."""
        found = []
        for resource in left_over(self.ledger):
            pid, spec = self._pid(resource), instance.read(self.root, resource)
            if pid is not None and spec is not None and uuid in spec.gpus:
                found.append((resource, pid))
        return found

    def recorded_mode(self, uuid: str) -> Optional[str]:
        """The compute mode the GPU `uuid` had before a daemon of the agent's set EXCLUSIVE_PROCESS, if recorded."""
        recorded = self.ledger.compute_modes().get(uuid)
        return recorded[0] if recorded is not None else None

    def release(self, uuid: str) -> Optional[str]:
        """The GPU `uuid`'s compute mode from before a daemon of the agent's put back and forgotten (it leaves
        the daemon's GPUs); None once done, else why not."""
        recorded = self.ledger.compute_modes()
        if uuid not in recorded:
            return None
        owner = recorded[uuid][1]
        others = tuple(gpu for gpu, (_, resource) in recorded.items() if resource == owner and gpu != uuid)
        problems = restore_compute_modes(self.ledger, self.modes, owner, keep=others)
        return "; ".join(problems) or None

    def quit(self, resource: str) -> Optional[str]:
        """Its daemon quit (SIGTERM after), its server with it; None once it runs no more, else why not."""
        return stop_daemon(self.control, DaemonSpec.left(resource))

    def start(self, resource: str) -> Optional[str]:
        """Its daemon started again as it was last started (its record), its GPUs in EXCLUSIVE_PROCESS first;
        nothing when it runs. None once it runs, else why it does not (the MPS watch tries again)."""
        if self._pid(resource) is not None:
            return None
        spec = instance.read(self.root, resource)
        if spec is None:
            return (f"the MPS control daemon for {resource} is not started again: no record of what it ran with "
                    f"({record_path(resource)}); the MPS watch starts it if the config still asks for it")
        silent = [uuid for uuid in spec.gpus if not self._answers(uuid)]  # lost, or NVML fails for it: its fact
        if len(silent) == len(spec.gpus):
            return (f"the MPS control daemon for {resource} is not started again: none of its GPUs answers NVML; "
                    "the MPS watch starts it once they do")
        spec = without(spec, silent)
        try:
            start_daemon(self.root, self.ledger, self.control, self.modes, spec)
        except AgentError as exc:
            return f"the MPS control daemon for {resource} could not be started again: {exc}"
        except OSError as exc:
            return (f"the MPS control daemon for {resource} could not be started again: "
                    f"{exc.filename or resource}: {exc.strerror or exc}")
        return None

    def _answers(self, uuid: str) -> bool:
        try:
            self.modes.compute_mode(uuid)
        except AgentError:
            return False
        return True

    def _pid(self, resource: str) -> Optional[int]:
        return self.control.pid(DaemonSpec.left(resource))
