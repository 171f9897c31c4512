"""Whether the process an MPS control daemon's pid file names is the daemon the agent started.

The daemon writes its pid to nvidia-cuda-mps-control.pid in its pipe directory, which every client pod
mounts: the file gives a number, not whose process it is. A pid reused since the daemon died, or one
written there by someone else, must not be taken for the daemon (adopted, the resource would never start
while that process lives) nor signalled. The name a process gives itself (/proc/PID/comm) proves nothing:
any program can be called "nvidia". What does:

- the program it runs, /proc/PID/exe: the control binary the agent runs, by its path (after a driver
  upgrade replaced the file, the kernel names the same path with " (deleted)"); or, where that binary is
  a script (a stand-in where no GPU is), the interpreter the kernel ran for it with the script's path as
  its first argument (/proc/PID/cmdline);
- its user, the owner of /proc/PID: the agent's own (the agent starts its daemons as itself);
- that it is the one the agent started. Under systemd, its control group is the resource's unit
  (gpu-agent-mps@<resource>.service): only systemd puts processes there, the daemon it started and the
  MPS servers that daemon forks (which run another binary). That is the process systemd knows as the
  unit's MainPID, without a systemctl call at every look. Without systemd, its pid and start time
  (/proc/PID/stat, field 22, clock ticks after boot) as the agent recorded them in daemon.started, in the
  resource's directory (the pods mount only the pipe directory below it): before each start the record
  says `starting`, with the process the pid file named then, if any; the first other process the pid file
  names after it, running the binary, is the daemon that start made, and its pid and start time are
  recorded. A pid with another start time is a pid reused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded, read_head
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.mps.layout import PID_FILE, pipe_dir, resource_dir
from gpu_agent.numbers import decimal

STARTED = "daemon.started"  # in the resource's directory
STARTING = "starting"
_DELETED = " (deleted)"
_STAT_HEAD = 4096  # /proc/PID/stat: 52 fields, a comm of 15 bytes at most
_CMDLINE_HEAD = 8192  # an interpreter, its option and the script's path are at its start
_MAX_CGROUP = 64 << 10  # one line per hierarchy: a few hundred bytes
_START_FIELD = 22  # proc(5): starttime; fields after the comm's ")" begin with field 3


@dataclass(frozen=True)
class Process:
    pid: int
    exe: str  # the program it runs, as /proc/PID/exe names it, " (deleted)" taken off
    uid: int  # the owner of /proc/PID: its effective user
    start: int  # clock ticks after boot
    script: str = ""  # an interpreter's first argument, where it is a path: the script it runs

    def key(self) -> str:
        return f"{self.pid} {self.start}"


def started_path(resource: str) -> str:
    """/run/nvidia/mps/nvidia.com/gpu/daemon.started: the daemon the agent started, `PID START`."""
    return f"{resource_dir(resource)}/{STARTED}"


def pid_file(root: Root, resource: str) -> Optional[int]:
    """The pid the daemon's pid file holds; None when there is none, or it holds no pid."""
    try:
        head = read_head(root(f"{pipe_dir(resource)}/{PID_FILE}"), 32, follow=False)
    except (NotRegular, OSError):
        return None
    return decimal(head.decode("ascii", errors="replace")) if head else None


def process(root: Root, pid: int) -> Optional[Process]:
    """The running process `pid`, as /proc shows it; None when there is none (or it cannot be read)."""
    base = f"/proc/{pid}"
    try:
        try:
            exe = os.readlink(root(f"{base}/exe"))
        except PermissionError:  # ptrace's rule: the agent's unit has fewer capabilities than the daemon's
            exe = ""
        uid = os.stat(root(base)).st_uid
        stat = read_head(root(f"{base}/stat"), _STAT_HEAD)
        cmdline = read_head(root(f"{base}/cmdline"), _CMDLINE_HEAD) or b""
    except (NotRegular, OSError):
        return None
    arguments = cmdline.decode(errors="replace").split("\0")
    script = arguments[1] if len(arguments) > 1 and arguments[1].startswith("/") else ""
    if not exe:  # what it was started as, where the kernel will not say (a bare name: systemd's argv[0])
        exe = arguments[0]
    fields = (stat or b"").rpartition(b")")[2].split()
    index = _START_FIELD - 3
    start = decimal(fields[index].decode("ascii", errors="replace")) if len(fields) > index else None
    if start is None:
        return None
    return Process(pid, exe[:-len(_DELETED)] if exe.endswith(_DELETED) else exe, uid, start, script)


def runs(found: Process, binary: str) -> bool:
    """Whether `found` runs `binary` (its path as the kernel names it, or the script an interpreter runs)
    as this process's user."""
    named = found.exe == os.path.basename(binary)  # a bare name, as systemd passes ExecStart's first word
    return (binary in (found.exe, found.script) or named) and found.uid == os.geteuid()


def in_unit(root: Root, pid: int, unit: str) -> bool:
    """Whether the process is in the control group of the systemd unit `unit` (cgroup v2, or v1's systemd
    hierarchy: the group's last component is the unit)."""
    try:
        text = (read_bounded(root(f"/proc/{pid}/cgroup"), _MAX_CGROUP) or b"").decode(errors="replace")
    except (NotRegular, TooLarge, OSError):
        return False
    return any(line.split(":", 2)[-1].rstrip("/").rsplit("/", 1)[-1] == unit for line in text.splitlines())


def expect_start(root: Root, resource: str, before: Optional[Process]) -> None:
    """Before a start: the record says a start comes, and which process the pid file named before it (not
    the one started). OSError as the write's."""
    atomic_write(root(started_path(resource)), f"{STARTING} {before.key() if before else ''}".rstrip() + "\n", 0o644)


def started_by_agent(root: Root, resource: str, found: Process) -> bool:
    """Whether `found` (running the binary, named by the pid file) is the daemon the record says the agent
    started; the first one after a start is recorded as it."""
    try:
        head = read_head(root(started_path(resource)), 128, follow=False)
    except (NotRegular, OSError):
        return False
    words = (head or b"").decode("ascii", errors="replace").split()
    if words[:1] != [STARTING]:
        return words == found.key().split()
    if " ".join(words[1:]) == found.key():
        return False  # what the pid file named before the start: not the daemon started
    try:
        atomic_write(root(started_path(resource)), found.key() + "\n", 0o644)
    except OSError:
        return False  # not recorded: looked at again next time
    return True
