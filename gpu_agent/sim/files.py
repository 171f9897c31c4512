"""How the simulator writes the simulated kernel's and driver's files (/sys, /proc, modules, libraries).

Each file is replaced whole (temp + rename), so a reader never sees half of it, but unlike the agent's
host.files.atomic_write nothing is fsync'd and nothing is recorded as the agent's own write: these files
stand for a kernel's and a package manager's, which a power cut does not need to find on disk, and
which the agent must see as someone else's. Tens of thousands of them are written in the test suite,
where the fsyncs and the own-write records were a fifth of its CPU."""
from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Optional

_serial = itertools.count()


def publish(path: Path, data: bytes | str, mode: Optional[int] = None) -> None:
    """Replace `path` with `data`: the replaced file's mode is kept, a new file gets `mode` (0644)."""
    if isinstance(data, str):
        data = data.encode()
    try:
        keep: Optional[int] = os.stat(path).st_mode & 0o7777 if mode is None else None
    except FileNotFoundError:
        keep = None
    tmp = f"{path.parent}/.{path.name}.{os.getpid()}.{next(_serial)}.sim"
    try:
        fd = _create(tmp)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _create(tmp)
    except FileExistsError:  # left by a killed process that had this pid
        os.unlink(tmp)
        fd = _create(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), keep if keep is not None else 0o644 if mode is None else mode)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
