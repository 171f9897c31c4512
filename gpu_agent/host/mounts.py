"""Mounts: what is mounted where (/proc/self/mountinfo under the root), and mount(2), umount2(2) and
unshare(2) through ctypes, for the tmpfs the MPS control daemons and their clients share.

mountinfo's format is proc(5)'s: `ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE
SOURCE SUPER-OPTIONS`, with space, tab, newline and backslash in paths written as octal escapes.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.paths import Root

MOUNTINFO = "/proc/self/mountinfo"
_MAX_MOUNTINFO = 16 << 20  # a node with thousands of container mounts writes a few MiB

# <linux/mount.h>, <sched.h>
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}


@dataclass(frozen=True)
class Mount:
    point: str  # as the reader of mountinfo sees it
    device: str  # MAJ:MIN of the file system
    fstype: str
    source: str
    options: str  # the mount's own options (ro/rw, nosuid, ...)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (a later one on the same point is on top); a line
    that is not in the format is skipped."""
    found = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 3:
            continue
        found.append(Mount(_unescape(fields[4]), fields[2], fields[dash + 1], _unescape(fields[dash + 2]), fields[5]))
    return found


def mount_at(root: Root, host_path: str) -> Optional[Mount]:
    """What is mounted at `host_path` (the topmost mount, the one a lookup finds), from the root's
    /proc/self/mountinfo; None when nothing is. An AgentError names the file when it cannot be read."""
    target = str(root(host_path))
    on_it = [mount for mount in parse_mountinfo(read_mountinfo(root, MOUNTINFO, f"whether {host_path} is mounted"))
             if mount.point == target]
    return on_it[-1] if on_it else None


def read_mountinfo(root: Root, mountinfo: str, what: str) -> str:
    """The text of a mountinfo file (/proc/self/mountinfo, /proc/PID/mountinfo), read through the bounded
    reader; an AgentError says it cannot tell `what`, naming the file and why."""
    try:
        raw = read_bounded(root(mountinfo), _MAX_MOUNTINFO)
    except (NotRegular, TooLarge, OSError) as exc:
        raise AgentError(f"{mountinfo}: cannot tell {what}: {getattr(exc, 'strerror', None) or exc}") from None
    if raw is None:
        raise AgentError(f"{mountinfo}: cannot tell {what}: no such file")
    return raw.decode(errors="replace")


_libc: Optional[Any] = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.unshare.argtypes = [ctypes.c_int]
        _libc = libc
    return _libc


def _checked(result: int, what: str, path: Optional[str]) -> None:
    if result != 0:
        code = ctypes.get_errno() or errno.EIO
        raise OSError(code, f"{what}: {os.strerror(code)}", path)


def _bytes(text: Optional[str]) -> Optional[bytes]:
    return None if text is None else os.fsencode(text)


def mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    """mount(2); OSError with its errno and the target."""
    _checked(_lib().mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), "mount", target)


def mount_tmpfs(target: str, options: str, source: str = "shm") -> None:
    """A tmpfs at `target`: `options` as mount(8) takes them, the flags among them (nosuid, nodev,
    noexec) given as flags, the rest (mode=, size=) to tmpfs."""
    words = [word for word in options.split(",") if word]
    flags = 0
    for word in words:
        flags |= FLAGS.get(word, 0)
    mount(source, target, "tmpfs", flags, ",".join(word for word in words if word not in FLAGS))


def unmount(target: str) -> None:
    """umount2(target, MNT_DETACH): gone from the tree now, freed once no process uses it."""
    _checked(_lib().umount2(_bytes(target), MNT_DETACH), "umount2", target)


def private_mount_namespace() -> None:
    """This process in a mount namespace of its own, whose mounts (from now on) reach no other: unshare(2)
    CLONE_NEWNS, then the whole tree made private, as unshare(1) --mount does."""
    _checked(_lib().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)", None)
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def bind(source: str, target: str) -> None:
    """A bind mount of `source` at `target` (it keeps the source mount's nosuid, nodev, noexec)."""
    mount(source, target, None, MS_BIND)
