"""Files and links the agent owns: written through the ledger, so that every one can be undone.

The first time the agent writes a file it saves the original (or notes that there was none), and
before every write it records the digest of what it writes. Undoing a file removes it, or puts the
original back, only while it still holds what the agent wrote: a file someone changed since is left
as it is, and said so. A link the agent created is removed while it still points where the agent
made it point.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Callable, Optional

from gpu_agent.host.files import atomic_write, read_bytes, remove
from gpu_agent.host.ledger import Ledger, Owned, OwnedLink
from gpu_agent.host.paths import Root
from gpu_agent.plan import digest

log = logging.getLogger(__name__)

ORIGINALS = "/var/lib/gpu-agent/originals"
REMOVE, RESTORE, FORGET, CHANGED = "remove", "restore", "forget", "changed"


def write(root: Root, ledger: Ledger, owner: str, host_path: str, content: str, mode: Optional[int] = None,
          restart: Optional[str] = None) -> None:
    """Write `content` to `host_path` as a file `owner` owns: original saved and intent recorded first."""
    entry = ledger.owned().get(host_path)
    original = entry.original if entry is not None else _save_original(root, host_path)
    ledger.own(Owned(host_path, owner, original, digest(content.encode()), restart))
    atomic_write(root(host_path), content, mode)


def put_back(root: Root, ledger: Ledger, host_path: str, before: Optional[Owned], content: Optional[str]) -> None:
    """Undo a write that a transaction rolls back: `content` (None: no file) and the ledger as they were."""
    if content is None:
        remove(root(host_path))
    else:
        atomic_write(root(host_path), content)
    if before is None:
        ledger.disown(host_path)
        _drop_original(root, host_path)
    else:
        ledger.own(before)


@dataclass(frozen=True)
class Undo:
    entry: Owned
    how: str  # REMOVE, RESTORE, FORGET (nothing left to undo) or CHANGED (left alone)


def undo_of(root: Root, entry: Owned) -> Undo:
    """How to undo one owned file, from what it holds now."""
    current = read_bytes(root(entry.path))
    if current is None:
        return Undo(entry, FORGET if entry.original is None else RESTORE)
    if digest(current) != entry.written:
        if entry.original is not None and read_bytes(root(entry.original)) == current:
            return Undo(entry, FORGET)  # it holds its original already
        return Undo(entry, CHANGED)
    if entry.original is not None and read_bytes(root(entry.original)) == current:
        return Undo(entry, FORGET)  # what the agent wrote last is the original: nothing to put back
    return Undo(entry, REMOVE if entry.original is None else RESTORE)


def carry_out(root: Root, ledger: Ledger, undo: Undo) -> None:
    entry = undo.entry
    if undo.how == REMOVE:
        remove(root(entry.path))
    elif undo.how == RESTORE:
        assert entry.original is not None
        original = root(entry.original)
        data = read_bytes(original)
        if data is None:
            raise OSError(f"the saved original {entry.original} is gone")
        atomic_write(root(entry.path), data, stat.S_IMODE(os.stat(original).st_mode))
    elif undo.how == CHANGED:
        log.warning("%s changed since gpu-agent wrote it: left as it is%s", entry.path,
                    f" (its original is kept at {entry.original})" if entry.original else "")
        ledger.disown(entry.path)
        return
    ledger.disown(entry.path)
    _drop_original(root, entry.path)


def make_link(ledger: Ledger, owner: str, host_path: str, target: str, create: Callable[[], None]) -> None:
    """Create the link `host_path` -> `target` (by calling `create`) as a link `owner` owns: recorded
    first, so that a crash between the two leaves nothing the ledger does not know."""
    ledger.own_link(OwnedLink(host_path, owner, target))
    create()


@dataclass(frozen=True)
class LinkUndo:
    entry: OwnedLink
    how: str  # REMOVE, FORGET (gone already) or CHANGED (it points elsewhere now, or is no link: left alone)


def link_undo_of(root: Root, entry: OwnedLink) -> LinkUndo:
    path = root(entry.path)
    if not path.is_symlink():
        return LinkUndo(entry, CHANGED if os.path.lexists(path) else FORGET)
    return LinkUndo(entry, REMOVE if os.readlink(path) == entry.target else CHANGED)


def carry_out_link(root: Root, ledger: Ledger, undo: LinkUndo) -> None:
    if undo.how == REMOVE:
        remove(root(undo.entry.path))
    elif undo.how == CHANGED:
        log.warning("%s changed since gpu-agent linked it to %s: left as it is", undo.entry.path, undo.entry.target)
    ledger.disown_link(undo.entry.path)


def _save_original(root: Root, host_path: str) -> Optional[str]:
    """The file as it was before the agent first wrote it, kept until it is undone; None if there was none."""
    source = root(host_path)
    data = read_bytes(source)
    if data is None:
        return None
    saved = f"{ORIGINALS}/{_flat(host_path)}"
    directory = root(ORIGINALS)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(root(saved), data, mode=stat.S_IMODE(os.stat(source).st_mode))
    return saved


def _drop_original(root: Root, host_path: str) -> None:
    remove(root(f"{ORIGINALS}/{_flat(host_path)}"))


def _flat(host_path: str) -> str:
    return host_path.strip("/").replace("_", "__").replace("/", "_")


