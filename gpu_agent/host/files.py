"""Atomic file writes: temp file, fsync, rename, fsync of the directory."""
from __future__ import annotations

import difflib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from gpu_agent.host.paths import Root

BACKUP_DIR = "/var/lib/gpu-agent/backups"


def atomic_write(path: Path, data: bytes | str, mode: Optional[int] = None) -> None:
    """Replace `path` with `data` so a reader sees either the old or the new content, never a mix.

    The new file keeps the replaced file's mode and owner (a 0600 config with credentials stays
    0600); a new file gets `mode`, 0644 unless given.
    """
    if isinstance(data, str):
        data = data.encode()
    try:
        existing: Optional[os.stat_result] = os.stat(path)
    except FileNotFoundError:
        existing = None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if existing is not None:
                os.fchown(f.fileno(), existing.st_uid, existing.st_gid)
            os.fchmod(f.fileno(), existing.st_mode & 0o7777 if existing is not None and mode is None
                      else 0o644 if mode is None else mode)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def unified_diff(host_path: str, current: Optional[str], desired: str) -> str:
    return "".join(difflib.unified_diff(
        (current or "").splitlines(keepends=True), desired.splitlines(keepends=True),
        fromfile=host_path if current is not None else "/dev/null", tofile=host_path,
    ))


def backup(root: Root, host_path: str) -> Optional[Path]:
    """Copy a file someone else owns to /var/lib/gpu-agent/backups before it is replaced."""
    source = root(host_path)
    if not source.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = root(BACKUP_DIR) / f"{host_path.strip('/').replace('/', '_')}.{stamp}"
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy2(source, target)
    return target
