"""Directories that appeared after the agent started, read-only in its systemd sandbox.

systemd/gpu-agent.service runs the agent under ProtectSystem=strict: all of / is read-only to it but its
ReadWritePaths=, and one prefixed "-" is skipped when it does not exist as the unit starts (systemd.exec(5):
the mount namespace is set up once, at start). A node provisioned GPU-first (gpu-agent, then containerd or
the kubelet) gets those directories after the agent started: every write there fails with EROFS until the
agent is started again. A write that fails so says why (read_only()), naming the directory where it failed,
and under systemd the agent asks to be restarted, once per such directory, only for one of those
directories that was not there when it started: one that was is writable under the unit, and a write
refused there or below (a read-only mount) would be refused after a restart too. The directory where the
write failed is remembered in /run/gpu-agent (RESTARTED) before the exit; one still read-only after the
restart (access(2) tested there, not at the top directory) is never restarted for again, and the stage
fails, saying so.

The directories are listed here, not read from the unit at run time: the agent runs also without it, and
tests/test_systemd.py holds this list equal to the unit's ReadWritePaths=-... entries.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Mapping, Optional

from gpu_agent.host.bounded import Unreadable, read_text
from gpu_agent.host.paths import Root

log = logging.getLogger(__name__)

# The unit's ReadWritePaths= entries prefixed "-": writable only when they exist as the agent starts.
LATE_WRITABLE = (
    "/etc/containerd", "/etc/docker", "/etc/crio", "/etc/nvidia-container-runtime",
    "/etc/cdi", "/run/cdi", "/etc/modprobe.d", "/etc/kubernetes/node-feature-discovery/features.d",
    "/usr/share/containers/oci/hooks.d",
    "/var/lib/rancher/k3s/agent/etc/containerd", "/var/lib/rancher/rke2/agent/etc/containerd",
    "/var/snap/microk8s/current/args",
    "/var/lib/kubelet/device-plugins", "/var/snap/microk8s/common/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry",
    "/var/snap/microk8s/common/var/lib/kubelet/plugins", "/var/snap/microk8s/common/var/lib/kubelet/plugins_registry",
    "/run/nvidia/mps",
)
RESTARTED = "/run/gpu-agent/restarted-for"  # where the writes failed that a restart was asked for, one a line
MAX_RESTARTED_BYTES = 64 << 10  # a few directory names
RESTARTING = "read-only in gpu-agent's sandbox (EROFS) until it restarts, as it does now"  # the error's reason
EXIT_RESTART = 75  # EX_TEMPFAIL (sysexits.h): the unit's Restart=on-failure and RestartForceExitStatus=75


def late_writable(host_path: str) -> Optional[str]:
    """The directory of LATE_WRITABLE that holds `host_path` (/var/run is /run), None if none does."""
    path = "/run/" + host_path[len("/var/run/"):] if host_path.startswith("/var/run/") else host_path
    found = [d for d in LATE_WRITABLE if path == d or path.startswith(d + "/")]
    return max(found, key=len) if found else None


def in_systemd_unit(root: Root, environ: Mapping[str, str]) -> bool:
    """Whether this process runs as a systemd service (INVOCATION_ID, systemd.exec(5)) writing the files of the
    node it runs on (the root is /, its GPUs simulated or not), booted with systemd (/run/systemd/system,
    sd_booted(3))."""
    return root.path == Path("/") and bool(environ.get("INVOCATION_ID")) and root("/run/systemd/system").is_dir()


def _writable(path: Path) -> bool:
    """access(2) says EROFS, also to root, for a directory on a read-only mount."""
    return os.access(path, os.W_OK)


class Sandbox:
    """What a write refused with EROFS means, and the restart it asks for under systemd (`restart`, called
    at most once, from any thread: the daemon exits with EXIT_RESTART)."""

    def __init__(self, root: Root, systemd: bool = False, restart: Callable[[], object] = lambda: None) -> None:
        self.root = root
        self.systemd = systemd
        self._restart = restart
        self._lock = threading.RLock()  # the marker's own write may fail and ask why
        self._asked: Optional[str] = None  # the directory this process asked to be restarted for
        # The directories of LATE_WRITABLE there as the agent started: the unit made them writable.
        self._present = {d for d in LATE_WRITABLE if root(d).is_dir()} if systemd else set()
        self._tried = self._still_read_only() if systemd else set()

    def _still_read_only(self) -> set[str]:
        """Where the writes failed that an earlier run restarted for, read-only still: that restart did not
        help. The others (writable now, or gone) are forgotten, so that their next failure restarts again."""
        try:
            text = read_text(self.root(RESTARTED), RESTARTED, MAX_RESTARTED_BYTES, errors="replace")
            listed = set((text or "").split())
        except Unreadable as exc:  # forgotten: the next start may restart again
            log.warning("%s", exc)
            return set()
        kept = {d for d in listed if late_writable(d) is not None and self.root(d).is_dir()
                and not _writable(self.root(d))}
        if kept != listed:
            try:
                self._record(kept)
            except OSError as exc:  # forgotten in this run all the same; the next start tries again
                log.warning("cannot update %s: %s", RESTARTED, exc.strerror or exc)
        return kept

    def _record(self, directories: set[str]) -> None:
        from gpu_agent.host.files import atomic_write, remove  # files.py asks this module why a write failed

        path = self.root(RESTARTED)
        if directories:
            atomic_write(path, "".join(f"{d}\n" for d in sorted(directories)), 0o644)
        else:
            remove(path)

    def read_only(self, path: Path) -> str:
        """Why a write at `path` (under the root) failed with EROFS, as the error's reason, naming the directory
        where it failed; under systemd, for a directory that appeared after the agent started, the restart
        that makes it writable is asked for."""
        host = self._host(path)
        failed = self._host(_nearest_existing(Path(path).parent))
        directory = late_writable(host)
        if directory is None or not self.systemd:
            return f"{failed} is on a read-only file system (EROFS)"
        if not self.root(directory).is_dir():
            return (f"read-only in gpu-agent's sandbox (EROFS): {directory} did not exist when gpu-agent started, "
                    f"and its unit makes only existing directories writable; create it (mkdir -p {directory}) "
                    "and gpu-agent restarts to write there")
        appeared = (f"{directory} appeared after gpu-agent started and is read-only in its sandbox "
                    "(ProtectSystem=strict)" + (f" (the write failed in {failed})" if failed != directory else ""))
        with self._lock:
            if failed in self._tried:
                return (f"{failed} is read-only to gpu-agent (EROFS) although gpu-agent restarted to make it "
                        "writable: a read-only mount, or a gpu-agent.service without "
                        f"ReadWritePaths=-{directory}; not restarting again")
            if directory in self._present:
                return (f"{failed} is read-only to gpu-agent (EROFS) although {directory} was there when gpu-agent "
                        "started, so its unit made it writable: a read-only mount, or a gpu-agent.service without "
                        f"ReadWritePaths=-{directory}; a restart would not change that (if {directory} was made "
                        "as gpu-agent started, `systemctl restart gpu-agent`)")
            if self._asked is not None:
                return RESTARTING
            try:
                self._record(self._tried | {failed})
            except OSError as exc:
                return (f"{appeared}: restart gpu-agent to make it writable (it cannot record a restart of its own "
                        f"in {RESTARTED}: {exc.strerror or exc}, and so does not restart itself)")
            self._asked = failed
        log.warning("%s: restarting so that systemd makes it writable", appeared)  # the one line that says why
        self._restart()
        return RESTARTING

    def _host(self, path: Path) -> str:
        try:
            relative = str(Path(path).relative_to(self.root.path))
        except ValueError:
            return str(path)
        return "/" if relative == "." else f"/{relative}"


def _nearest_existing(path: Path) -> Path:
    """`path`, or the closest folder above it that exists: where a write (or the making of the folders
    it needed) failed."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


_current = Sandbox(Root("/"))  # outside the daemon: the reason only


def current() -> Sandbox:
    return _current


def install(sandbox: Optional[Sandbox]) -> None:
    """The daemon's (None: back to the reason only)."""
    global _current
    _current = sandbox if sandbox is not None else Sandbox(Root("/"))


def read_only_error(path: Path) -> OSError:
    """EROFS for a write at `path`, its reason saying why (Sandbox.read_only)."""
    return OSError(errno.EROFS, _current.read_only(path), str(path))
