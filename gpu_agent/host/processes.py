"""The process table under --root, read with psutil: the processes NVML reports on a GPU, named.

psutil reads the table at psutil.PROCFS_PATH, one setting for the whole process. Every reader points it
at the /proc it means (the host's under --root) under one lock. psutil is imported when there is a
process to name: an agent whose GPUs run nothing does without its 0.75 MiB. Only a process's pid and name
are read: never its environment, never its command line beyond the program name (which psutil uses to
complete a name the kernel cut to 15 characters).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.host.paths import Root
from gpu_agent.numbers import decimal

_LOCK = threading.Lock()


@contextlib.contextmanager
def procfs(path: str) -> Iterator[None]:
    """psutil reads the process table at `path` (a /proc) while this is held."""
    import psutil

    with _LOCK:
        saved = psutil.PROCFS_PATH
        psutil.PROCFS_PATH = path
        try:
            yield
        finally:
            psutil.PROCFS_PATH = saved


@dataclass(frozen=True)
class NamedProcess:
    pid: int
    name: Optional[str]  # None when the process has ended or cannot be read

    def describe(self) -> str:
        """`1234 (python3)`, as a refusal names a process."""
        return f"{self.pid} ({self.name or 'process name unknown'})"


def named(root: Root, pids: Iterable[int]) -> list[NamedProcess]:
    """Each pid with its program name, from the process table under `root`."""
    pids = list(pids)
    if not pids:
        return []
    with procfs(str(root("/proc"))):
        return [NamedProcess(pid, _name(pid)) for pid in pids]


def _name(pid: int) -> Optional[str]:
    import psutil

    try:
        return psutil.Process(pid).name() or None
    except (psutil.Error, OSError, ValueError, RuntimeError):  # ended, not ours, a bad pid, no boot time
        return None


_NVIDIA_DEVICE = re.compile(r"(^|/)dev/nvidia")


def device_users(root: Root) -> list[NamedProcess]:
    """The processes that hold an NVIDIA device file (/dev/nvidia*) open, from /proc/PID/fd under the
    root; this process excluded. What holds the nvidia module when NVML cannot say (a version mismatch)."""
    return holding(root, _NVIDIA_DEVICE)


def holding(root: Root, device: re.Pattern[str]) -> list[NamedProcess]:
    """The processes with a file open whose path `device` matches (searched in the link's text, which under
    a sandbox root may be relative), from /proc/PID/fd under the root; this process excluded."""
    found = []
    proc = root("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        pid = decimal(entry.name)
        if pid is None or pid == os.getpid():
            continue
        try:
            with os.scandir(entry / "fd") as fds:
                held = any(device.search(os.readlink(fd.path)) for fd in fds if fd.is_symlink())
        except OSError:  # gone, or not ours to read
            continue
        if held:
            try:
                name = (read_head(entry / "comm", 64) or b"").decode(errors="replace").strip() or "?"
            except (OSError, NotRegular):
                name = "?"
            found.append(NamedProcess(pid, name))
    return sorted(found, key=lambda p: p.pid)


_STAT_HEAD = 512  # /proc/PID/stat up to its parent's pid: the name is at most 64 bytes


def parent(root: Root, pid: int) -> Optional[int]:
    """The pid of `pid`'s parent, from /proc/PID/stat under the root (its fourth field, after the name in
    parentheses, which may itself hold spaces and parentheses); None when it is gone or cannot be read."""
    try:
        head = (read_head(root(f"/proc/{pid}/stat"), _STAT_HEAD) or b"").decode(errors="replace")
    except (OSError, NotRegular):
        return None
    fields = head.rpartition(")")[2].split()
    return decimal(fields[1]) if len(fields) > 1 else None
