"""A lock for short critical sections on a file, between the threads of this process and between
processes: a re-entrant thread lock per lock file, then flock(2) on it, taken by the outermost holder
in this process. A caller waits at most its timeout, then hears who holds it (Busy): never a hang.

The kernel drops an flock with the descriptor, so a holder killed with -9 leaves the file but no lock.
The file holds the pid of its last holder, written only when it changes, for Busy to name; it is never
fsynced (a crash loses nothing of it that matters).
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

from gpu_agent.host import sandbox

_FIRST_PAUSE_S = 0.002
_LONGEST_PAUSE_S = 0.05


class Busy(Exception):
    """Another holder kept the lock past the timeout; `holder` says who, in words."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class _Shared:
    """This process's hold on one lock file: the thread that has it, how deep, and the flocked descriptor."""

    def __init__(self) -> None:
        self.threads = threading.RLock()
        self.depth = 0
        self.fd: Optional[int] = None


_shared: weakref.WeakValueDictionary[str, _Shared] = weakref.WeakValueDictionary()
_shared_guard = threading.Lock()


class FileLock:
    """The lock on `path` (made, with its directory, if missing). acquire() raises Busy past
    `timeout_s`, and OSError when the file cannot be opened or is not a regular file."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        with _shared_guard:  # every FileLock of one path in this process shares one _Shared
            found = _shared.get(str(path))
            if found is None:
                found = _shared[str(path)] = _Shared()
        self._shared = found

    def acquire(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        shared = self._shared
        if not shared.threads.acquire(timeout=max(self.timeout_s, 0)):
            raise Busy("another thread of this process")
        try:
            if shared.depth == 0:
                shared.fd = _flocked(self.path, deadline)
            shared.depth += 1
        except BaseException:
            shared.threads.release()
            raise

    def release(self) -> None:
        shared = self._shared
        shared.depth -= 1
        if shared.depth == 0 and shared.fd is not None:
            fd, shared.fd = shared.fd, None
            os.close(fd)  # the flock goes with it
        shared.threads.release()


def _flocked(path: Path, deadline: float) -> int:
    fd = _opened(path)
    try:
        pause = _FIRST_PAUSE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(_holder(fd)) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, _LONGEST_PAUSE_S)
        _sign(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _opened(path: Path) -> int:
    """The lock file, never through a link at its name (it is written to), never anything but a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise sandbox.read_only_error(path) from None
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not the lock file gpu-agent makes: remove it",
                          str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file, not the lock file gpu-agent makes: remove it", str(path))
    return fd


def _sign(fd: int) -> None:
    mine = f"{os.getpid()}\n".encode()
    if os.pread(fd, 32, 0) != mine:
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine, 0)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        text = ""
    return f"process {text}" if text.isdigit() else "another process"
