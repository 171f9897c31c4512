"""Reading a file that may be anything: at most a given number of bytes, of a regular file only, within
a time.

A FIFO, a device, a socket or a directory is refused without blocking on it or reading from it, a
file larger than the limit (or one that grows past it while it is read) is refused rather than read
whole, and one still answering in pieces after READ_SECONDS (a /proc or /sys file that trickles) is
given up. One read(2) that never returns (a file on a hung network or FUSE mount) is beyond what a
single thread can time out. Each caller turns these refusals into its own message naming the file
and the limit, or reads through read_text(), whose messages do.

Every file the agent reads from the host goes through here (tests/test_bounded_guard.py keeps it so).
"""
from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Optional, Union

from gpu_agent.errors import StageError

# The most one read(2) asks for. Linux refuses a read of a /proc/sys file whose count is KMALLOC_MAX_SIZE
# (4 MiB on x86-64) or more with ENOMEM (fs/proc/proc_sysctl.c, proc_sys_call_handler, since 5.8), so
# asking for the whole limit at once failed every read of /proc/sys/kernel/osrelease on a real node; and a
# smaller request keeps Python from allocating the limit's bytes for each read of a 10-byte file.
READ_CHUNK = 64 << 10
# A file of any limit the agent uses is read in milliseconds; a file that takes longer answers in pieces.
READ_SECONDS = 5.0


class NotRegular(Exception):
    """The path names something other than a regular file; `kind` says what, in words."""

    def __init__(self, mode: int) -> None:
        super().__init__(kind_of(mode))
        self.mode = mode
        self.kind = kind_of(mode)


class TooSlow(OSError):
    """The file was still answering after `seconds`: an OSError (ETIMEDOUT) whose strerror says so, so
    callers that report an OSError's strerror name the reason."""

    def __init__(self, seconds: float) -> None:
        super().__init__(errno.ETIMEDOUT, f"still answering after {seconds:g} s, given up")
        self.seconds = seconds


class TooLarge(Exception):
    """The file has more than the limit's bytes: `size` as fstat said before reading, None when it
    grew past the limit while it was read."""

    def __init__(self, limit: int, size: Optional[int]) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit
        self.size = size


def read_bounded(path: Union[str, Path], limit: int, follow: bool = True,
                 seconds: float = READ_SECONDS) -> Optional[bytes]:
    """The bytes of the regular file at `path`, at most `limit`; None when it does not exist.
    Raises NotRegular, TooLarge, TooSlow (an OSError) or the OSError of opening or reading it (ELOOP
    for a link when not `follow`)."""
    found = read_bounded_file(path, limit, follow, seconds)
    return None if found is None else found[0]


def read_bounded_file(path: Union[str, Path], limit: int, follow: bool = True,
                      seconds: float = READ_SECONDS) -> Optional[tuple[bytes, os.stat_result]]:
    """read_bounded(), with what fstat said of the file that was read."""
    deadline = time.monotonic() + seconds
    opened = _open_regular(path, follow)
    if opened is None:
        return None
    fd, info = opened
    try:
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
            if time.monotonic() > deadline:
                raise TooSlow(seconds)
    finally:
        os.close(fd)
    if size > limit:
        raise TooLarge(limit, None)
    return b"".join(chunks), info


def read_head(path: Union[str, Path], size: int, follow: bool = True) -> Optional[bytes]:
    """The first `size` bytes of the regular file at `path` (fewer when it is shorter), in one read(2),
    the rest left unread: what a reader of a record's first field needs (/proc/PID/cmdline's program, a
    sysfs attribute, a PCI config space). None when it does not exist; raises NotRegular or an OSError."""
    opened = _open_regular(path, follow)
    if opened is None:
        return None
    fd, _ = opened
    try:
        return os.read(fd, min(size, READ_CHUNK))
    finally:
        os.close(fd)


def _open_regular(path: Union[str, Path], follow: bool) -> Optional[tuple[int, os.stat_result]]:
    """A descriptor of the regular file at `path` and its fstat, opened without blocking on a FIFO;
    None when nothing is there. Raises NotRegular (the descriptor closed) or the OSError of opening it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words: "a directory", "a FIFO", ..."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


class Unreadable(StageError):
    """read_text() could not give the file's text: the message names the file and why."""


def read_checked(path: Union[str, Path], shown: str, limit: int, why_limit: str = "") -> Optional[bytes]:
    """read_bounded(), its refusals raised as Unreadable naming the file (`shown`: its host path) and
    the reason; `why_limit` says why the limit is enough, after its number."""
    try:
        return read_bounded(path, limit)
    except NotRegular as exc:
        raise Unreadable(f"cannot read {shown}: it is {exc.kind}, not a file") from None
    except TooLarge:
        raise Unreadable(f"cannot read {shown}: more than {limit} bytes{why_limit}") from None
    except OSError as exc:
        raise Unreadable(f"cannot read {shown}: {exc.strerror or exc}") from None


def read_text(path: Union[str, Path], shown: str, limit: int, errors: str = "strict",
              why_limit: str = "") -> Optional[str]:
    """The text of the regular file at `path`, as read_checked() reads it; None when it does not exist.
    Decoded as UTF-8 with `errors`, chosen per format: "strict" where other bytes mean it is not the
    file expected (the message names the line), "replace" where a file in that format may carry text
    in other encodings that the agent does not read (dpkg's descriptions, a program's output)."""
    data = read_checked(path, shown, limit, why_limit)
    if data is None:
        return None
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise Unreadable(f"cannot read {shown}:{line}: not UTF-8 text (byte {exc.start})") from None
