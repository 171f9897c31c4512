"""Reading a file that may be anything: at most a given number of bytes, of a regular file only.

A FIFO, a device, a socket or a directory is refused without blocking on it or reading from it, and
a file larger than the limit (or one that grows past it while it is read) is refused rather than
read whole. Each caller turns these refusals into its own message naming the file and the limit.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional, Union

# The most one read(2) asks for. Linux refuses a read of a /proc/sys file whose count is KMALLOC_MAX_SIZE
# (4 MiB on x86-64) or more with ENOMEM (fs/proc/proc_sysctl.c, proc_sys_call_handler, since 5.8), so
# asking for the whole limit at once failed every read of /proc/sys/kernel/osrelease on a real node; and a
# smaller request keeps Python from allocating the limit's bytes for each read of a 10-byte file.
READ_CHUNK = 64 << 10


class NotRegular(Exception):
    """The path names something other than a regular file; `kind` says what, in words."""

    def __init__(self, mode: int) -> None:
        super().__init__(kind_of(mode))
        self.mode = mode
        self.kind = kind_of(mode)


class TooLarge(Exception):
    """The file has more than the limit's bytes: `size` as fstat said before reading, None when it
    grew past the limit while it was read."""

    def __init__(self, limit: int, size: Optional[int]) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit
        self.size = size


def read_bounded(path: Union[str, Path], limit: int, follow: bool = True) -> Optional[bytes]:
    """The bytes of the regular file at `path`, at most `limit`; None when it does not exist.
    Raises NotRegular, TooLarge, or the OSError of opening or reading it (ELOOP for a link when not
    `follow`)."""
    found = read_bounded_file(path, limit, follow)
    return None if found is None else found[0]


def read_bounded_file(path: Union[str, Path], limit: int,
                      follow: bool = True) -> Optional[tuple[bytes, os.stat_result]]:
    """read_bounded(), with what fstat said of the file that was read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(info.st_mode)
        if info.st_size > limit:
            raise TooLarge(limit, info.st_size)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # /proc and /sys files say 0 bytes and may answer in pieces
            chunk = os.read(fd, min(READ_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise TooLarge(limit, None)
    return b"".join(chunks), info


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words: "a directory", "a FIFO", ..."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
