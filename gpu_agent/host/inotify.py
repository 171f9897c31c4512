"""Linux inotify through ctypes (the standard library has none): a descriptor that becomes readable
when an entry of a watched directory is written, renamed in or out, created, removed or changes
its attributes. Watchers block on it instead of polling, so an idle agent does not wake.

Where inotify cannot be had (not Linux, no libc symbol, the per-user watch limit reached) the
constructor or watch() raises OSError and the caller polls instead.
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
from pathlib import Path
from typing import Any, Iterable, Optional

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = 0o2000000
IN_ONLYDIR = 0x01000000
CHANGES = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
           | IN_DELETE_SELF | IN_MOVE_SELF)
_READ_SIZE = 64 * 1024
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name

_libc: Optional[Any] = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's symbols, libc's among them
        for name in ("inotify_init1", "inotify_add_watch", "inotify_rm_watch"):
            if not hasattr(libc, name):
                raise OSError(errno.ENOSYS, f"libc has no {name}")
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = libc
    return _libc


class DirectoryWatch:
    """One inotify descriptor and the directories it watches; `watch_for(paths)` sets them to the
    directories where those paths would change (the nearest existing ancestor of a missing one, so
    its creation is seen too)."""

    def __init__(self) -> None:
        try:
            libc = _lib()
        except (OSError, AttributeError) as exc:
            raise OSError(errno.ENOSYS, f"inotify unavailable: {exc}") from None
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self._libc = libc
        self._fd = fd
        self._watches: dict[str, int] = {}  # directory: watch descriptor
        self._names: dict[int, set[bytes]] = {}  # watch descriptor: the entries whose events count

    def fileno(self) -> int:
        return self._fd

    def watch_for(self, paths: Iterable[Path]) -> None:
        wanted: dict[str, set[bytes]] = {}
        for path in paths:
            parent, name = _watched_entry(Path(path))
            wanted.setdefault(str(parent), set()).add(os.fsencode(name))
        for directory in set(self._watches) - set(wanted):
            old = self._watches.pop(directory)
            self._names.pop(old, None)
            self._libc.inotify_rm_watch(self._fd, old)
        for directory, names in sorted(wanted.items()):
            if directory not in self._watches:
                wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), CHANGES | IN_ONLYDIR)
                if wd < 0:
                    code = ctypes.get_errno()
                    if code in (errno.ENOENT, errno.ENOTDIR, errno.EACCES):
                        continue  # gone meanwhile, or not ours to watch: its parent's events still come
                    raise OSError(code, f"inotify_add_watch {directory}: {os.strerror(code)}")
                self._watches[directory] = wd
            self._names[self._watches[directory]] = names

    def drain(self) -> bool:
        """Read every pending event; whether any says something changed (a watch removed does not)."""
        changed = False
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return changed
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
                changed = changed or self._counts(wd, mask, name)
                offset += _EVENT.size + length
            if not data:
                return changed

    def _counts(self, wd: int, mask: int, name: bytes) -> bool:
        """An event about a watched entry, the directory itself, or lost events (the queue overflowed)."""
        if mask & IN_IGNORED:
            return False
        return mask & IN_Q_OVERFLOW != 0 or not name or name in self._names.get(wd, ())

    def wait(self, timeout: float) -> bool:
        """Block this thread until something changes or `timeout` passes; whether something changed."""
        readable, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        return bool(readable) and self.drain()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._watches.clear()
            self._names.clear()


def _watched_entry(path: Path) -> tuple[Path, str]:
    """The directory whose entries change when `path` does, and the entry's name: its parent and its
    own name, or for a missing directory the nearest existing ancestor and the child on the way."""
    directory, name = path.parent, path.name
    while not directory.is_dir() and directory != directory.parent:
        directory, name = directory.parent, directory.name
    return directory, name
