"""The agent's threads, named for the kernel too: Python names a thread for itself only, so top -H,
/proc/PID/task/*/comm and perf would show every one as `python`. With the name there, a thread that
wakes an idle agent says which it is."""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Optional

_PR_SET_NAME = 15
_KERNEL_NAME_BYTES = 15  # TASK_COMM_LEN less its NUL

_prctl: Optional[Any] = None


def name_for_the_kernel(name: str) -> bool:
    """Give the calling thread `name` (cut to 15 bytes) in /proc/self/task/TID/comm; whether it took."""
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # not Linux, or no libc symbol: the thread stays `python`
            _prctl = False
            return False
    if _prctl is False:
        return False
    return _prctl(_PR_SET_NAME, name.encode("utf-8", "replace")[:_KERNEL_NAME_BYTES], 0, 0, 0) == 0


def daemon_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that runs `target` under `name`, for Python and the kernel alike."""

    def run() -> None:
        name_for_the_kernel(name)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
