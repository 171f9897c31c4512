"""The process table under --root, read with psutil: the processes NVML reports on a GPU, named.

psutil reads the table at psutil.PROCFS_PATH, one setting for the whole agent. Every reader points it
at the /proc it means (the host's under --root here, the agent's own in metrics/own_process.py) under
one lock. Only a process's pid and name are read: never its environment, never its command line
beyond the program name (which psutil uses to complete a name the kernel cut to 15 characters).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import psutil

from gpu_agent.host.paths import Root

_LOCK = threading.Lock()


@contextlib.contextmanager
def procfs(path: str) -> Iterator[None]:
    """psutil reads the process table at `path` (a /proc) while this is held."""
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
    with procfs(str(root("/proc"))):
        return [NamedProcess(pid, _name(pid)) for pid in pids]


def _name(pid: int) -> Optional[str]:
    try:
        return psutil.Process(pid).name() or None
    except (psutil.Error, OSError, ValueError, RuntimeError):  # ended, not ours, a bad pid, no boot time
        return None
