"""What is not wanted in a simulated kernel's tree goes, without listing every directory at every write.

The simulator rewrites its /sys and /proc trees at every change of its machine, and listing their
hundreds of directories each time was most of that. A directory that still has the stamp it had when
it held only what was wanted has not had an entry added or removed since, so it is not listed again.
A stamp is only kept when the directory's last change is older than a timestamp tick could hide (a
file system's mtime moves in ticks of a few milliseconds, so a change right after the stamp was taken
could leave it as it was): such a directory is listed again next time. What a render stops wanting is
removed by name, and a tree not seen before (or replaced: its directories' inodes are new) is listed in full.
"""
from __future__ import annotations

import collections
import os
import shutil
import stat
import time
from dataclasses import dataclass

_RACY_NS = 20_000_000  # more than a file system's timestamp tick (a jiffy: 10 ms at HZ=100)
_TREES = 16  # the trees of the last few machines this process drove

DirStamp = tuple[int, int, int, int, int]  # inode, mtime, ctime, size, links


@dataclass
class _Listing:
    wanted: set[str]
    wanted_dirs: set[str]
    stamps: dict[str, DirStamp]  # each wanted directory's, when it held only what was wanted


_LISTINGS: collections.OrderedDict[str, _Listing] = collections.OrderedDict()


def remove_unwanted(tree: str, wanted: set[str], wanted_dirs: set[str]) -> bool:
    """Remove from `tree` what is neither in `wanted` (files and links, relative paths) nor in
    `wanted_dirs` (directories, "" the tree itself, every parent of a wanted entry included).

    True when nothing changed in the tree's directories since the last remember(): the same entries are
    wanted, and each directory has the stamp it had then, so every link and file there is the one that
    render left (a file's content may still have been edited in place, which no directory shows)."""
    listing = _LISTINGS.get(tree)
    if listing is None:
        _remove_listed(tree, "", wanted, wanted_dirs)
        return False
    settled = listing.wanted == wanted and listing.wanted_dirs == wanted_dirs
    for relative in listing.wanted - wanted:
        _remove(os.path.join(tree, relative))
    for relative in sorted(listing.wanted_dirs - wanted_dirs, key=len):
        shutil.rmtree(os.path.join(tree, relative), ignore_errors=True)
    real_dirs: set[str] = set()
    for relative in sorted({"", *wanted_dirs}, key=lambda d: d.count("/") + bool(d)):  # parents first
        path = os.path.join(tree, relative) if relative else tree
        parent = os.path.dirname(relative)
        if relative and parent not in real_dirs:
            continue  # under a link or a file, or gone: its parent's listing removed what was there
        try:
            info = os.lstat(path)
        except OSError:
            settled = False
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue  # a link the render writes (its place a wanted directory's parent too)
        real_dirs.add(relative)
        if listing.stamps.get(relative) != _dir_stamp(info):
            settled = False
            _remove_listed(path, relative + "/" if relative else "", wanted, wanted_dirs, recurse=False)
    return settled


def remember(tree: str, wanted: set[str], wanted_dirs: set[str]) -> None:
    """`tree` holds only what is wanted now: keep its directories' stamps for the next removal."""
    now = time.time_ns()
    stamps = {}
    for relative in {"", *wanted_dirs}:
        try:
            info = os.lstat(os.path.join(tree, relative) if relative else tree)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and now - max(info.st_mtime_ns, info.st_ctime_ns) > _RACY_NS:
            stamps[relative] = _dir_stamp(info)
    _LISTINGS.pop(tree, None)
    _LISTINGS[tree] = _Listing(set(wanted), set(wanted_dirs), stamps)
    while len(_LISTINGS) > _TREES:
        _LISTINGS.popitem(last=False)


def forget(tree: str) -> None:
    _LISTINGS.pop(tree, None)


def _dir_stamp(info: os.stat_result) -> DirStamp:
    return (info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_nlink)


def _remove(path: str) -> None:
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        pass


def _remove_listed(directory: str, prefix: str, wanted: set[str], wanted_dirs: set[str],
                   recurse: bool = True) -> None:
    """Remove what under `directory` (`prefix` relative to the tree) is neither a wanted file or link
    nor a wanted directory: one scandir per directory, the wanted ones below it too when `recurse`."""
    with os.scandir(directory) as entries:
        for entry in entries:
            relative = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if relative not in wanted_dirs:
                    shutil.rmtree(entry.path, ignore_errors=True)
                elif recurse:
                    _remove_listed(entry.path, relative + "/", wanted, wanted_dirs)
            elif relative not in wanted:
                os.unlink(entry.path)
