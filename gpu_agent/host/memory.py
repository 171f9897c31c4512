"""The daemon's heap, kept to what it uses (glibc's malloc, through ctypes; a no-op elsewhere).

glibc gives each thread that allocates its own arena (up to 8 per core), and keeps freed memory in
them: a daemon with a dozen mostly idle worker threads holds several MiB it does not use, and
memory freed after start-up or a request flood stays resident. Two arenas are plenty for one event
loop and short jobs on workers; malloc_trim hands free pages back to the kernel.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

_M_ARENA_MAX = -8
_ARENAS = 2

_libc: Optional[Any] = None


def _lib() -> Optional[Any]:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None)
        except OSError:
            return None
    return _libc if hasattr(_libc, "malloc_trim") and hasattr(_libc, "mallopt") else None


def limit_arenas() -> bool:
    """At most _ARENAS malloc arenas for the threads started from now on; whether that took effect."""
    libc = _lib()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, _ARENAS))


def give_back() -> bool:
    """Return the heap's free pages to the kernel; whether any were."""
    libc = _lib()
    return bool(libc is not None and libc.malloc_trim(0))
