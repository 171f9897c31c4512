"""Atomic file writes: temp file, fsync, rename, fsync of the directory; diffs of a planned write."""
from __future__ import annotations

import difflib
import errno
import hashlib
import os
import re
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import sandbox
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded, read_bounded_file
from gpu_agent.host.masking import masked
from gpu_agent.host.paths import Root

BACKUP_DIR = "/var/lib/gpu-agent/backups"
MAX_BACKUP_BYTES = 16 << 20  # as host.owned's limit: more than any file the agent replaces
KEEP_BACKUPS = 5  # per file; the original before gpu-agent's first change is kept apart (host/owned.py)
_TMP_SUFFIX = ".tmp"

Stamp = tuple[int, int, int]  # inode, mtime in ns, size: changes with every write


class _OwnWrites:
    """The stamps of the files this process last wrote or removed, so that watchers can tell the
    agent's own writes from someone else's. Keyed by the real path: a watcher looking through a
    symlink finds the target the agent wrote. Bounded: the oldest paths are forgotten first."""

    def __init__(self, capacity: int = 1024) -> None:
        self._stamps: OrderedDict[str, Optional[Stamp]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def record(self, path: Path, stamp: Optional[Stamp]) -> None:
        key = os.path.join(os.path.realpath(path.parent), path.name)  # the file itself, not where a link led
        with self._lock:
            self._stamps[key] = stamp
            self._stamps.move_to_end(key)
            while len(self._stamps) > self._capacity:
                self._stamps.popitem(last=False)

    def ours(self, path: Path, stamp: Optional[Stamp]) -> bool:
        key = os.path.realpath(path)
        with self._lock:
            return key in self._stamps and self._stamps[key] == stamp


_own_writes = _OwnWrites()


def stamp_of(path: Path) -> Optional[Stamp]:
    """The file's stamp, None when it does not exist (or cannot be looked at)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def written_by_us(path: Path, stamp: Optional[Stamp]) -> bool:
    """Whether `path` is, as `stamp` says it is now, as this process last left it."""
    return _own_writes.ours(path, stamp)


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise sandbox.read_only_error(path) from None
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if existing is not None:
                os.fchown(f.fileno(), existing.st_uid, existing.st_gid)
            os.fchmod(f.fileno(), existing.st_mode & 0o7777 if existing is not None and mode is None
                      else 0o644 if mode is None else mode)
            os.fsync(f.fileno())
            written = os.fstat(f.fileno())  # the rename keeps inode, mtime and size
        _own_writes.record(path, (written.st_ino, written.st_mtime_ns, written.st_size))
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Remove a file durably (missing is fine); watchers know it was the agent."""
    _own_writes.record(path, None)  # before: a watcher must never see it gone and not know why
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def stray_temps(directory: Path, names: Optional[Iterable[str]] = None) -> list[Path]:
    """Temp files atomic_write left when the process died between creating and renaming them
    (`.NAME.XXXXXXXX.tmp`): those of the files `names` in `directory` or, in a directory that is the
    agent's alone, all of them. Only regular files; reads only."""
    patterns = [f".{_glob_escape(name)}.*{_TMP_SUFFIX}" for name in names] if names is not None \
        else [f".*{_TMP_SUFFIX}"]
    found = []
    for pattern in patterns:
        try:
            candidates = sorted(directory.glob(pattern))
        except OSError:
            continue
        for candidate in candidates:
            try:
                if stat.S_ISREG(os.lstat(candidate).st_mode):
                    found.append(candidate)
            except OSError:
                pass  # gone already
    return found


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unified_diff(host_path: str, current: Optional[str], desired: str) -> str:
    """The change as a diff for people to read, masked (runtime configs hold registry passwords and
    tokens, and a diff's context lines would show them; host/masking.py) before it is compared. The
    work is bounded whatever the files hold: lines longer than LINE_CHARS are cut (their length and a
    digest of the whole line shown, so a change past the cut still shows), and past DIFF_LINES
    changed lines on either side, the changed part is one hunk, each side cut to DIFF_LINES lines."""
    old = [_cut(line) for line in masked(current or "").splitlines(keepends=True)]
    new = [_cut(line) for line in masked(desired).splitlines(keepends=True)]
    head = 0
    while head < min(len(old), len(new)) and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    start = max(0, head - CONTEXT_LINES)  # difflib sees the changed part and its context only
    shared_tail = max(0, tail - CONTEXT_LINES)
    old_part, new_part = old[start:len(old) - shared_tail], new[start:len(new) - shared_tail]
    header = [f"--- {host_path if current is not None else '/dev/null'}\n", f"+++ {host_path}\n"]
    if len(old_part) <= DIFF_LINES and len(new_part) <= DIFF_LINES:  # difflib's matching is quadratic at worst
        lines = list(difflib.unified_diff(old_part, new_part, n=CONTEXT_LINES))
        if not lines:  # the masked texts are the same: only a credential changes
            return "".join(header + ["@@ the change is in masked values only @@\n"]) if current != desired else ""
        return "".join(header + [_ended(_shifted(line, start)) for line in lines[2:]])
    hunk = [f"@@ -{start + 1},{len(old_part)} +{start + 1},{len(new_part)} @@\n"]
    for sign, part in (("-", old_part), ("+", new_part)):
        hunk += [sign + _ended(line) for line in part[:DIFF_LINES]]
        if len(part) > DIFF_LINES:
            hunk.append(f"{sign}... {len(part) - DIFF_LINES} more lines not shown\n")
    return "".join(header + hunk)


CONTEXT_LINES = 3
DIFF_LINES = 2000
LINE_CHARS = 1000
_HUNK = re.compile(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")


def _cut(line: str) -> str:
    body = line.rstrip("\r\n")
    if len(body) <= LINE_CHARS:
        return line
    digest = hashlib.sha256(body.encode(errors="replace")).hexdigest()[:12]
    return f"{body[:LINE_CHARS]}... ({len(body)} characters, sha256 {digest}...){line[len(body):]}"


def _ended(line: str) -> str:
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def _shifted(line: str, offset: int) -> str:
    """A hunk header of a diff of lines from `offset` on, numbered as in the whole file."""
    found = _HUNK.match(line) if line.startswith("@@") else None
    if found is None or not offset:
        return line
    old, new = int(found[1]) + offset, int(found[3]) + offset
    return f"@@ -{old}{found[2] or ''} +{new}{found[4] or ''} @@\n"


def backup(root: Root, host_path: str) -> Optional[Path]:
    """Copy a file someone else owns to /var/lib/gpu-agent/backups before it is replaced, atomically
    and with the file's mode; not again while the newest backup of it holds the same bytes."""
    source = root(host_path)
    try:
        found = read_bounded_file(source, MAX_BACKUP_BYTES)
    except (NotRegular, TooLarge) as exc:
        raise AgentError(f"cannot back up {host_path}: it is {exc}") from None
    if found is None:
        return None
    data, status = found
    mode = stat.S_IMODE(status.st_mode)
    directory = root(BACKUP_DIR)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = host_path.strip("/").replace("/", "_")
    earlier = _backups_of(directory, name)
    if earlier and read_bytes(earlier[-1]) == data:
        return earlier[-1]
    now = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    same_second = [_order(name, path)[1] for path in earlier if _order(name, path)[0] == now]
    count = max(same_second) + 1 if same_second else 0  # later than every backup of this second
    target = directory / (f"{name}.{now}" + (f"~{count}" if count else ""))
    atomic_write(target, data, mode=mode)
    for old in (earlier + [target])[:-KEEP_BACKUPS]:  # the last few changes of each file are kept
        remove(old)
    return target


_BACKUP_SUFFIX = re.compile(r"\.([0-9]{8}T[0-9]{6})(?:~([0-9]{1,9}))?$")


def _backups_of(directory: Path, name: str) -> list[Path]:
    """The backups of one file, oldest first."""
    found = [
        path for path in directory.glob(f"{_glob_escape(name)}.*") if _BACKUP_SUFFIX.fullmatch(path.name[len(name):])
    ]
    return sorted(found, key=lambda path: _order(name, path))


def _order(name: str, path: Path) -> tuple[str, int]:
    match = _BACKUP_SUFFIX.fullmatch(path.name[len(name):])
    assert match is not None
    return match.group(1), int(match.group(2) or 0)


def read_bytes(path: Path, limit: int = MAX_BACKUP_BYTES) -> Optional[bytes]:
    """The bytes of the regular file at `path`; None when it is missing, not a regular file, larger than
    `limit` or unreadable."""
    try:
        return read_bounded(path, limit)
    except (OSError, NotRegular, TooLarge):
        return None
