"""Files and links the agent owns: written through the ledger, so that every one can be undone.

The first time the agent writes a file it saves the original (or notes that there was none), and
before every write it records the digest of what it writes. Undoing a file removes it, or puts the
original back, only while it still holds what the agent wrote: a file someone changed since is left
as it is, and said so. A link the agent created is removed while it still points where the agent
made it point.

The ledger is trusted only so far: an entry is undone only for a path the agent's stages write
(OWNABLE, a closed set: each stage's files, or where a link at one of them leads under the root),
with its original only in ORIGINALS under the name the agent gives it. Every removal and restore
resolves the path as in a chroot at the root (host.paths.place), acts on a regular file only, and
never follows a link at the path itself. Anything else is refused, named with its reason, and left
alone.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded_file
from gpu_agent.host.files import atomic_write, read_bytes, remove
from gpu_agent.host.ledger import Ledger, Owned, OwnedLink
from gpu_agent.host.paths import Root, followed, place
from gpu_agent.plan import digest

log = logging.getLogger(__name__)

ORIGINALS = "/var/lib/gpu-agent/originals"
REMOVE, RESTORE, FORGET, CHANGED, REFUSED = "remove", "restore", "forget", "changed", "refused"
MAX_OWNED_BYTES = 16 << 20  # larger than any file the agent writes

# Every file a stage writes (a name pattern in its directory); tests/test_faults_ledger.py checks each
# stage's own constants against it.
OWNABLE = (
    "/etc/modprobe.d/blacklist-nouveau.conf", "/etc/modprobe.d/gpu-agent-*.conf",  # driver
    "/etc/containerd/config.toml", "/etc/containerd/conf.d/99-nvidia.toml",  # toolkit: containerd
    "/etc/docker/daemon.json",  # docker
    "/etc/crio/crio.conf.d/99-nvidia.conf",  # CRI-O
    *(f"/var/lib/rancher/{name}/agent/etc/containerd/{file}" for name in ("k3s", "rke2")  # k3s, RKE2
      for file in ("config-v3.toml.tmpl", "config.toml.tmpl", "config-v3.toml.d/99-nvidia.toml",
                   "config.toml.d/99-nvidia.toml")),
    "/var/snap/microk8s/current/args/containerd-template.toml",  # microk8s
    "/etc/nvidia-container-runtime/config.toml", "/var/lib/gpu-agent/runtime-config-keys.json",  # the toolkit's
    "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json",  # the OCI hook
    *(f"{directory}/*.{kind}" for directory in ("/etc/cdi", "/var/run/cdi", "/run/cdi") for kind in ("yaml", "json")),
    "/etc/kubernetes/node-feature-discovery/features.d/gpu-agent",  # labels: the NFD features file
)
OWNABLE_LINK = re.compile(r"/dev/char/[0-9]+:[0-9]+")  # the driver's /dev/char links


class NotOwnable(AgentError):
    """A path outside what the agent's stages write: never written, never undone."""


def refusal(root: Root, host_path: str) -> Optional[str]:
    """Why the agent may not write or undo the file `host_path` (None: it may): outside OWNABLE,
    or a link in its directory leads elsewhere than the agent's own places."""
    if not _ownable(root, host_path):
        return f"not a file gpu-agent writes (it writes {', '.join(OWNABLE)}, or where a link at one leads)"
    try:
        where = place(root, host_path)
    except (OSError, ValueError) as exc:
        return f"cannot resolve it under the root: {getattr(exc, 'strerror', None) or exc}"
    if where != host_path and not _ownable(root, where):
        return f"a link in its directory leads to {posixpath.dirname(where)}, not a place gpu-agent writes"
    return None


def _ownable(root: Root, host_path: str) -> bool:
    directory, name = posixpath.split(posixpath.normpath(host_path))
    for pattern in OWNABLE:
        pattern_directory, pattern_name = posixpath.split(pattern)
        if fnmatch.fnmatchcase(name, pattern_name) and directory in (pattern_directory, _led(root, pattern_directory)):
            return True
        if "*" not in pattern_name and host_path == _led(root, pattern):  # a linked file written through
            return True
    return False


def _led(root: Root, host_path: str) -> Optional[str]:
    try:
        return followed(root, host_path)
    except OSError:
        return None


def _where(root: Root, host_path: str) -> Path:
    """The file itself under the root (its directory's links followed there, never its own)."""
    return root(place(root, host_path))


def _regular(path: Path) -> Optional[bytes]:
    """The bytes of a regular file at `path`, not through a link; None for anything else or nothing."""
    try:
        found = read_bounded_file(path, MAX_OWNED_BYTES, follow=False)
    except (OSError, NotRegular, TooLarge):
        return None
    return None if found is None else found[0]


def original_of(host_path: str) -> str:
    """Where the agent keeps the original of `host_path`: the one place the ledger may name."""
    return f"{ORIGINALS}/{_flat(host_path)}"


def write(root: Root, ledger: Ledger, owner: str, host_path: str, content: str, mode: Optional[int] = None,
          restart: Optional[str] = None) -> None:
    """Write `content` to `host_path` as a file `owner` owns: original saved and intent recorded first.
    NotOwnable for a path outside what the stages write (OWNABLE)."""
    reason = refusal(root, host_path)
    if reason is not None:
        raise NotOwnable(f"{host_path}: {reason}; not written")
    with ledger.locked():  # the original is saved once: never again over what another writer wrote
        entry = ledger.owned().get(host_path)
        original = entry.original if entry is not None else _save_original(root, host_path)
        ledger.own(Owned(host_path, owner, original, digest(content.encode()), restart))
    atomic_write(_where(root, host_path), content, mode)


def put_back(root: Root, ledger: Ledger, host_path: str, before: Optional[Owned], content: Optional[str]) -> None:
    """Undo a write that a transaction rolls back: `content` (None: no file) and the ledger as they were."""
    if content is None:
        remove(_where(root, host_path))
    else:
        atomic_write(_where(root, host_path), content)
    if before is None:
        ledger.disown(host_path)
        _drop_original(root, host_path)
    else:
        ledger.own(before)


@dataclass(frozen=True)
class Undo:
    entry: Owned
    how: str  # REMOVE, RESTORE, FORGET (nothing left to undo), CHANGED (left alone) or REFUSED
    reason: str = ""  # why REFUSED: the ledger entry names what the agent never owns


def undo_of(root: Root, entry: Owned) -> Undo:
    """How to undo one owned file, from what it holds now."""
    reason = refusal(root, entry.path)
    if reason is None and entry.original is not None and entry.original != original_of(entry.path):
        reason = f"its original {entry.original} is not where gpu-agent keeps originals ({original_of(entry.path)})"
    if reason is not None:
        return Undo(entry, REFUSED, reason)
    path = _where(root, entry.path)
    if not os.path.lexists(path):
        return Undo(entry, FORGET if entry.original is None else RESTORE)
    current = _regular(path)
    if current is None or digest(current) != entry.written:  # a link or a FIFO there is no file the agent wrote
        if current is not None and entry.original is not None and _original(root, entry) == current:
            return Undo(entry, FORGET)  # it holds its original already
        return Undo(entry, CHANGED)
    if entry.original is not None and _original(root, entry) == current:
        return Undo(entry, FORGET)  # what the agent wrote last is the original: nothing to put back
    return Undo(entry, REMOVE if entry.original is None else RESTORE)


def _original(root: Root, entry: Owned) -> Optional[bytes]:
    return _regular(_where(root, original_of(entry.path)))


def carry_out(root: Root, ledger: Ledger, undo: Undo) -> None:
    entry = undo.entry
    if undo.how == REFUSED:
        log.error("ledger entry %s: %s: left alone", entry.path, undo.reason)
        ledger.disown(entry.path)
        return
    if undo.how == REMOVE:
        remove(_where(root, entry.path))
    elif undo.how == RESTORE:
        original = _where(root, original_of(entry.path))
        data = _regular(original)
        if data is None:
            raise OSError(f"the saved original {entry.original} is gone (or is no regular file)")
        atomic_write(_where(root, entry.path), data, stat.S_IMODE(os.lstat(original).st_mode))
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
    how: str  # REMOVE, FORGET (gone already), CHANGED (it points elsewhere now, or is no link: left alone), REFUSED
    reason: str = ""


def link_undo_of(root: Root, entry: OwnedLink) -> LinkUndo:
    if not OWNABLE_LINK.fullmatch(entry.path):
        return LinkUndo(entry, REFUSED, "not a link gpu-agent makes (it makes /dev/char/MAJOR:MINOR links)")
    try:
        path = _where(root, entry.path)
    except (OSError, ValueError) as exc:
        return LinkUndo(entry, REFUSED, f"cannot resolve it under the root: {getattr(exc, 'strerror', None) or exc}")
    if not path.is_symlink():
        return LinkUndo(entry, CHANGED if os.path.lexists(path) else FORGET)
    return LinkUndo(entry, REMOVE if os.readlink(path) == entry.target else CHANGED)


def carry_out_link(root: Root, ledger: Ledger, undo: LinkUndo) -> None:
    if undo.how == REMOVE:
        remove(_where(root, undo.entry.path))  # the link itself: unlink never follows it
    elif undo.how == CHANGED:
        log.warning("%s changed since gpu-agent linked it to %s: left as it is", undo.entry.path, undo.entry.target)
    elif undo.how == REFUSED:
        log.error("ledger link %s: %s: left alone", undo.entry.path, undo.reason)
    ledger.disown_link(undo.entry.path)


def _save_original(root: Root, host_path: str) -> Optional[str]:
    """The file as it was before the agent first wrote it, kept until it is undone; None if there was none."""
    source = root(followed(root, host_path))  # a link there read as in a chroot, never on the real host
    data = read_bytes(source)
    if data is None:
        return None
    saved = original_of(host_path)
    directory = _where(root, ORIGINALS)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(_where(root, saved), data, mode=stat.S_IMODE(os.stat(source).st_mode))
    return saved


def _drop_original(root: Root, host_path: str) -> None:
    remove(_where(root, original_of(host_path)))


def _flat(host_path: str) -> str:
    return host_path.strip("/").replace("_", "__").replace("/", "_")
