"""Crash points for kill -9 trials of a simulated agent.

With GPU_AGENT_SIM_KILL_AT=N the process SIGKILLs itself at the Nth crash point it reaches. The points
are every os.fsync and os.rename: inside each atomic write (temp file written, then renamed, then the
directory synced), around each ledger update, and around each simulated service restart (a restart is
a write of the simulated machine). So every point of a pass can be reached, deterministically.
GPU_AGENT_SIM_CRASH_LOG=FILE appends one line per point reached ("N rename PATH"), so a test can count
the points of a pass and say where a trial was killed.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Callable, Optional

KILL_AT = "GPU_AGENT_SIM_KILL_AT"
CRASH_LOG = "GPU_AGENT_SIM_CRASH_LOG"

_armed = False


def arm_from_environment() -> None:
    """Arm the crash points if the environment asks for them; once per process."""
    global _armed
    kill_at, log_path = os.environ.get(KILL_AT), os.environ.get(CRASH_LOG)
    if _armed or (kill_at is None and log_path is None):
        return
    _armed = True
    points = _Points(int(kill_at) if kill_at else None, log_path)
    os.fsync = points.wrap("fsync", os.fsync)
    os.rename = points.wrap("rename", os.rename)


class _Points:
    def __init__(self, kill_at: Optional[int], log_path: Optional[str]) -> None:
        self.kill_at = kill_at
        self.log_path = log_path
        self.count = 0

    def wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def point(*args: Any, **kwargs: Any) -> Any:
            self.reach(f"{name} {args[-1] if name == 'rename' else ''}".strip())
            return call(*args, **kwargs)
        return point

    def reach(self, what: str) -> None:
        self.count += 1
        if self.log_path:
            with open(self.log_path, "a") as log:
                log.write(f"{self.count} {what}\n")
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
