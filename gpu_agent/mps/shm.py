"""The MPS control daemons' shared memory: a tmpfs at /run/nvidia/mps/shm, mounted before the first
daemon starts and unmounted once the last one stopped, which each daemon has as its /dev/shm
(mps.launch) and each client container gets as /dev/shm (layout.client_mounts), instead of the
host's /dev/shm and every host process's shared memory in it.

As NVIDIA's mps-control-daemon mounts it (cmd/mps-control-daemon/mount/mount-shm.go): tmpfs,
nosuid,nodev,noexec, size half of MemTotal (65536k when /proc/meminfo cannot be read), mode 1777
(tmpfs's own default, written out). Recorded in the ledger (mounts) before it is mounted.
"""
from __future__ import annotations

import logging
from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import procfs
from gpu_agent.host.ledger import Ledger, OwnedMount
from gpu_agent.host.paths import Root
from gpu_agent.mps.control import MpsControl
from gpu_agent.mps.layout import SHM_DIR
from gpu_agent.numbers import decimal

log = logging.getLogger(__name__)

FALLBACK_SIZE = "65536k"
FSTYPE = "tmpfs"


def size(root: Root) -> str:
    """Half the node's memory, in MemTotal's unit (`k`), as NVIDIA's getDefaultShmSize."""
    try:
        meminfo = procfs.read(root, "/proc/meminfo") or ""
    except AgentError:
        return FALLBACK_SIZE
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            words = line[len("MemTotal:"):].split()
            total = decimal(words[0]) if words else None
            if total is not None:
                return f"{total // 2}{words[1][0] if len(words) > 1 else ''}"
            break
    return FALLBACK_SIZE


def options(root: Root) -> str:
    return f"nosuid,nodev,noexec,mode=1777,size={size(root)}"


def ensure(root: Root, ledger: Ledger, control: MpsControl) -> None:
    """The tmpfs mounted at SHM_DIR, in MPS_ROOT (made by the caller); nothing done when it is. An
    AgentError says why it cannot be, and a file system there that gpu-agent did not mount is refused,
    left as it is."""
    recorded = ledger.mounts().get(SHM_DIR)
    there = control.shm_fstype()
    if there is not None:
        if recorded is None or there != FSTYPE:
            raise AgentError(f"{SHM_DIR}: a {there} file system is mounted there, not gpu-agent's (NVIDIA's MPS "
                             "control daemon mounts its tmpfs there too); unmount it (umount -l "
                             f"{SHM_DIR}) so that gpu-agent can mount the MPS daemons' shared memory")
        return
    path = root(SHM_DIR)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise AgentError(f"{SHM_DIR}: not a directory (the MPS daemons' shared memory is mounted there); remove it")
    wanted = options(root)
    ledger.own_mount(OwnedMount(SHM_DIR, FSTYPE, wanted, made=not path.exists()))
    if not path.exists():
        try:
            path.mkdir(mode=0o755)
        except OSError as exc:
            raise AgentError(f"cannot make {SHM_DIR}: {exc.strerror or exc}") from None
    control.mount_shm(wanted)
    log.info("%s: tmpfs mounted (%s), the MPS control daemons' and their clients' /dev/shm", SHM_DIR, wanted)


def release(root: Root, ledger: Ledger, control: MpsControl) -> Optional[str]:
    """Once no daemon runs: the tmpfs the ledger holds unmounted (lazily: a client still holding it keeps
    its memory until it exits), its directory removed if gpu-agent made it, the entry dropped. Returns
    why it could not be, else None; nothing is done when the ledger holds no mount."""
    recorded = ledger.mounts().get(SHM_DIR)
    if recorded is None:
        return None
    try:
        if control.shm_fstype() == FSTYPE:
            control.unmount_shm()
            log.info("%s: tmpfs unmounted (no MPS control daemon runs)", SHM_DIR)
        there = control.shm_fstype()
    except (OSError, AgentError) as exc:
        return f"cannot unmount the MPS daemons' shared memory {SHM_DIR}: {getattr(exc, 'strerror', None) or exc}"
    if there is not None:
        return f"{SHM_DIR}: a {there} file system is still mounted there; left, with its ledger entry"
    path = root(SHM_DIR)
    if recorded.made and path.is_dir() and not path.is_symlink():
        try:
            path.rmdir()
        except OSError as exc:
            return f"cannot remove {SHM_DIR} after its unmount: {exc.strerror or exc}"
    ledger.disown_mount(SHM_DIR)
    return None
