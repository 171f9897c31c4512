"""The simulated nvidia-cuda-mps-control: control daemons kept in the simulated machine, so that a CLI
call (`gpu-agent sim fail mps`) and a running agent see the same ones, and tests read back what the
agent set. It cannot mount: the machine's `mounts` table stands for the host's, and each daemon records
the /dev/shm that mps.launch would give it. It answers on its control pipe as a real one did on an H200
with driver 580.159.04 (tests/data/mps/h200-580-vm/control-pipe.json, replayed by tests/test_mps_real.py).

A client (`sim add-process --mps RESOURCE`) makes its daemon start an MPS server (nvidia-cuda-mps-server, a
child of the daemon), which holds the daemon's GPUs open (/dev/nvidia*, and so the nvidia module) and stays
after its last client ends, as NVIDIA documents it; the daemon's `quit` ends the server with it once no client
is left (it waits for them), and so do its death and a reboot. The kernel renders each server in /proc.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Optional

from gpu_agent.errors import AgentError
from gpu_agent.mps.control import DaemonSpec, pinned_mib, shown_limit
from gpu_agent.mps.layout import CLIENT_SHM, SHM_DIR
from gpu_agent.numbers import decimal

COMMANDS = ("get_server_list", "get_default_active_thread_percentage", "set_default_active_thread_percentage",
            "get_default_device_pinned_mem_limit", "set_default_device_pinned_mem_limit",
            "get_active_thread_percentage", "quit")
FAULTS = ("die", "hang")
SERVER = "nvidia-cuda-mps-server"
_PIDS = itertools.count(40000)


class SimMpsControl:
    def __init__(self, machine: Any, timeout: float) -> None:
        self.machine = machine
        self.timeout = timeout

    def start(self, spec: DaemonSpec) -> None:
        with self.machine.edit() as state:
            daemons = state.setdefault("mps", {})
            shm = state.get("mounts", {}).get(SHM_DIR)
            if shm is None or shm["fstype"] != "tmpfs":  # as mps.launch refuses it
                raise AgentError(f"nvidia-cuda-mps-control -d for {spec.resource} failed (exit 1): cannot give "
                                 f"/usr/bin/nvidia-cuda-mps-control {SHM_DIR} as its {CLIENT_SHM}: {SHM_DIR} is not a "
                                 "mounted tmpfs")
            if daemons.get(spec.resource, {}).get("alive"):
                raise AgentError(f"nvidia-cuda-mps-control -d for {spec.resource} failed (exit 1): An instance of "
                                 "this daemon is already running")
            daemons[spec.resource] = {"pid": next(_PIDS) + len(daemons), "alive": True, "started": time.time(),
                                      "visible_devices": ",".join(spec.gpus), "thread_percentage": 100.0,
                                      "pinned_mem_limits": {}, "servers": [],
                                      "shm": {"source": SHM_DIR, "target": CLIENT_SHM, "options": shm["options"]}}

    def send(self, spec: DaemonSpec, command: str) -> str:
        words = command.split()
        with self.machine.edit() as state:
            daemon = state.get("mps", {}).get(spec.resource)
            hung = any(fault.get("call") == "mps" and fault.get("error") == "hang" for fault in state["faults"])
            if daemon is None or not daemon["alive"]:
                raise AgentError(f"nvidia-cuda-mps-control <<< {command!r} for {spec.resource} failed (exit 1): "
                                 "Cannot find MPS control daemon process")
            if not hung:
                answer = self._apply(daemon, words)
                if words[:1] == ["quit"]:
                    quit_daemon(state, spec.resource)
        if hung:
            time.sleep(self.timeout)
            raise AgentError(f"nvidia-cuda-mps-control <<< {command!r} for {spec.resource}: no answer within "
                             f"{self.timeout:g} s")
        return answer

    def pid(self, spec: DaemonSpec) -> Optional[int]:
        daemon = self.machine.read().get("mps", {}).get(spec.resource)
        return daemon["pid"] if daemon and daemon["alive"] else None

    def terminate(self, spec: DaemonSpec) -> None:
        kill(self.machine, spec.resource)

    def uses_shm(self, spec: DaemonSpec) -> bool:
        daemon = self.machine.read().get("mps", {}).get(spec.resource)
        return daemon is None or daemon.get("shm") is not None

    def shm_fstype(self) -> Optional[str]:
        mounted = self.machine.read().get("mounts", {}).get(SHM_DIR)
        return None if mounted is None else str(mounted["fstype"])

    def mount_shm(self, options: str) -> None:
        if not self.machine.root(SHM_DIR).is_dir():
            raise AgentError(f"cannot mount a tmpfs at {SHM_DIR} for the MPS daemons' shared memory: No such file or "
                             "directory")
        with self.machine.edit() as state:
            state.setdefault("mounts", {})[SHM_DIR] = {"fstype": "tmpfs", "source": "shm", "options": options}

    def unmount_shm(self) -> None:
        with self.machine.edit() as state:
            if state.get("mounts", {}).pop(SHM_DIR, None) is None:
                raise AgentError(f"cannot unmount {SHM_DIR}: Invalid argument")

    @staticmethod
    def _apply(daemon: dict[str, Any], words: list[str]) -> str:
        """The answer a real control daemon prints (always exit 0): nothing for a set of a limit or for an
        empty list, the thread percentage after a set (unchanged by a value it refuses), a limit as the
        daemon shows it."""
        name, args = (words[0], words[1:]) if words else ("", [])
        if name not in COMMANDS:
            return f'Unknown command "{name}"\n'
        if name == "set_default_active_thread_percentage" and args:
            daemon["thread_percentage"] = thread_percentage(args[0], daemon["thread_percentage"])
        elif name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            mib = pinned_mib(args[1])
            if mib == 0:  # 0M takes the limit away
                daemon["pinned_mem_limits"].pop(args[0], None)
            elif mib > 0:  # one it cannot read is ignored: the transcript cannot tell (no limit was set then)
                daemon["pinned_mem_limits"][args[0]] = args[1]
        elif name == "quit":  # quit_daemon: once its clients are gone
            return ""
        if name == "get_server_list":
            return "".join(f"{pid}\n" for pid in daemon["servers"])
        if name == "get_default_device_pinned_mem_limit":
            limit = daemon["pinned_mem_limits"].get(args[0]) if args else None
            return "" if limit is None else shown_limit(limit) + "\n"
        if name == "set_default_device_pinned_mem_limit":
            return ""
        if name == "get_active_thread_percentage" and (not args or decimal(args[0]) not in daemon["servers"]):
            return ""
        return f"{daemon['thread_percentage']:.1f}\n"


def thread_percentage(value: str, current: float) -> float:
    """What set_default_active_thread_percentage leaves: the value when it is a number in (0, 100], else the
    percentage it had (150 and abc were ignored, the old value printed)."""
    try:
        number = float(value)
    except ValueError:
        return current
    return number if 0 < number <= 100 else current


def kill(machine: Any, resource: Optional[str] = None) -> list[str]:
    """The daemons (of `resource`, or all) die as a killed process does: their pid gone, their pipes left, their
    servers ended with them (the unit's control group, or the clients' connection, is gone)."""
    killed = []
    with machine.edit() as state:
        for name, daemon in state.get("mps", {}).items():
            if daemon["alive"] and resource in (None, name):
                _end(daemon)
                killed.append(name)
    return killed


def _end(daemon: dict[str, Any]) -> None:
    daemon["alive"], daemon["servers"] = False, []
    daemon.pop("quitting", None)


def quit_daemon(state: dict[str, Any], resource: str) -> None:
    """`quit`: the daemon and its server end once the daemon has no client left; until then it waits for them
    (and, as NVIDIA's, takes no new one)."""
    daemon = state["mps"][resource]
    if clients(state, resource):
        daemon["quitting"] = True
    else:
        _end(daemon)


def clients(state: dict[str, Any], resource: str) -> list[int]:
    """The pids of the processes that are `resource`'s daemon's clients."""
    return [p["pid"] for gpu in state["gpus"] for p in gpu["processes"] if p.get("mps") == resource]


def clients_ended(state: dict[str, Any]) -> list[str]:
    """After processes ended: the daemons that were waiting for their clients to quit end now. Their resources."""
    ended = []
    for name, daemon in state.get("mps", {}).items():
        if daemon["alive"] and daemon.get("quitting") and not clients(state, name):
            _end(daemon)
            ended.append(name)
    return ended


def connect(state: dict[str, Any], resource: str, gpu: int) -> int:
    """A client on GPU `gpu` connects to `resource`'s control daemon: its server starts if none runs (one: the
    clients here are one user's). Returns the server's pid; AgentError, as the client's CUDA call fails, when
    no daemon takes it."""
    daemon = state.get("mps", {}).get(resource)
    if daemon is None or not daemon["alive"] or daemon.get("quitting"):
        raise AgentError(f"no MPS control daemon for {resource} takes clients: the client's first CUDA call fails")
    if state["gpus"][gpu]["uuid"] not in daemon["visible_devices"].split(","):
        raise AgentError(f"GPU {gpu} is not one of the MPS control daemon's for {resource}")
    if not daemon["servers"]:
        daemon["servers"] = [_new_pid(state)]
    return int(daemon["servers"][0])


def servers(state: dict[str, Any]) -> list[tuple[int, int, list[int]]]:
    """Each MPS server that runs: its pid, its parent's (the control daemon) and the minors of the GPUs it holds."""
    minors = {gpu["uuid"]: gpu["minor"] for gpu in state["gpus"]}
    return [(pid, daemon["pid"], [minors[uuid] for uuid in daemon["visible_devices"].split(",") if uuid in minors])
            for daemon in state.get("mps", {}).values() if daemon["alive"] for pid in daemon["servers"]]


def reboot(state: dict[str, Any]) -> None:
    """A reboot: no daemon nor server runs, and the tmpfs they shared is no longer mounted."""
    for daemon in state.get("mps", {}).values():
        _end(daemon)
    state.get("mounts", {}).pop(SHM_DIR, None)


def _new_pid(state: dict[str, Any]) -> int:
    taken = [p["pid"] for gpu in state["gpus"] for p in gpu["processes"]]
    for daemon in state.get("mps", {}).values():
        taken += [daemon["pid"], *daemon["servers"]]
    return max([*taken, 40000]) + 1
