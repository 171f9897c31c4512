"""Host paths resolved under the agent's root (like node_exporter's --path.rootfs)."""
from __future__ import annotations

import errno
import os
import posixpath
from pathlib import Path
from typing import Optional

# The kernel's own file systems, and the kernel's configuration. With a kernel directory they come from
# there instead (another kernel's trees, given by the composition root), never from the running kernel.
KERNEL_TREES = ("/proc", "/sys", "/dev", "/etc/modprobe.d", "/run/nvidia-persistenced")


class Root:
    """The directory every host path is resolved under; "/" on a real node."""

    _MAPPED_MAX = 4096  # more distinct host paths than the agent reads; beyond it (/proc/PID/...), start over

    def __init__(self, path: str | os.PathLike[str] = "/", kernel: Optional[Path] = None) -> None:
        self.path = Path(path).resolve()
        self.kernel = kernel  # holds proc/, sys/ and dev/ of a kernel that is not the running one
        self._mapped: dict[str, Path] = {}  # a reconcile pass maps the same hundred paths each time

    def __call__(self, host_path: str | os.PathLike[str]) -> Path:
        """Map an absolute host path such as /etc/gpu-agent/config.yaml to its place under the root."""
        host_path = str(host_path)
        mapped = self._mapped.get(host_path)
        if mapped is None:
            mapped = self._map(host_path)
            if len(self._mapped) >= self._MAPPED_MAX:
                self._mapped.clear()
            self._mapped[host_path] = mapped
        return mapped

    def _map(self, host_path: str) -> Path:
        if not host_path.startswith("/"):
            raise ValueError(f"host path must be absolute: {host_path!r}")
        normal = os.path.normpath(host_path)
        if self.kernel is not None and any(normal == t or normal.startswith(t + "/") for t in KERNEL_TREES):
            return self.kernel / normal.lstrip("/")
        relative = normal.lstrip("/")
        return self.path / relative if relative else self.path

    def with_kernel(self, kernel: Path) -> Root:
        return Root(self.path, kernel)

    @property
    def is_running_system(self) -> bool:
        """Whether the hardware and kernel behind this root are the machine this process runs on."""
        return str(self.path) == "/" and self.kernel is None

    def __repr__(self) -> str:
        return f"Root({str(self.path)!r}{f', kernel={str(self.kernel)!r}' if self.kernel else ''})"


def resolve(root: Root, path: str, hops: int = 40) -> Optional[str]:
    """The host path `path` leads to, following symlinks (absolute ones under `root`); None if nothing is there."""
    done, rest = _walk(root, path, hops)
    return done if done is not None and not rest else None


def followed(root: Root, path: str) -> str:
    """`path` with its symbolic links followed as the kernel would inside a chroot at `root`: an absolute
    target, or a '..' above '/', stays under the root, so a link never leads to the real host's files
    (the kubelet's kubelet-client-current.pem is an absolute link). Where a part does not exist the
    walk ends and the rest is joined as written, so the result is also where a new file goes. Open
    `root(followed(root, path))`, never `root(path)`, whose links the OS would follow on the real host.
    OSError (ELOOP) for a loop of links."""
    done, rest = _walk(root, path)
    if done is None:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    return posixpath.normpath(posixpath.join(done, *rest))


def _walk(root: Root, path: str, hops: int = 40) -> tuple[Optional[str], list[str]]:
    """The longest existing prefix of `path` with its links followed under `root`, and the parts after
    it (none when all of it exists); (None, []) after more than `hops` links."""
    pending = [part for part in path.split("/") if part]
    done = "/"
    while pending:
        part = pending.pop(0)
        if part in (".", ".."):
            done = posixpath.dirname(done) if part == ".." else done
            continue
        candidate = posixpath.join(done, part)
        local = root(candidate)
        if local.is_symlink():
            hops -= 1
            if hops < 0:
                return None, []
            target = os.readlink(local)
            done = "/" if target.startswith("/") else done
            pending = [p for p in target.split("/") if p] + pending
        elif os.path.lexists(local):
            done = candidate
        else:
            return done, [part] + pending
    return done, []
