"""Host paths resolved under the agent's root (like node_exporter's --path.rootfs)."""
from __future__ import annotations

import errno
import os
import posixpath
import stat
from pathlib import Path
from typing import Iterable, Optional

# The kernel's own file systems, its modules and their configuration. With a kernel directory they come from
# there instead (another kernel's trees, given by the composition root), never from the running kernel.
KERNEL_TREES = ("/proc", "/sys", "/dev", "/lib/modules", "/etc/modprobe.d", "/run/nvidia-persistenced")


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


MAX_LINKS = 40  # as Linux's MAXSYMLINKS


def resolve(root: Root, path: str) -> Optional[str]:
    """The host path `path` leads to, following symlinks (absolute ones under `root`); None if nothing is there."""
    try:
        done, rest, _ = walk(root, path)
    except OSError:
        return None
    return done if not rest else None


def first_executable(root: Root, directories: Iterable[str], name: str) -> Optional[str]:
    """DIRECTORY/name of the first of `directories` holding an executable regular file `name`, its links
    followed under the root; None when none does."""
    for directory in directories:
        path = f"{directory}/{name}"
        real = resolve(root, path)
        if real is not None:
            status = os.stat(root(real))
            if stat.S_ISREG(status.st_mode) and status.st_mode & 0o111:
                return path
    return None


def followed(root: Root, path: str) -> str:
    """`path` with its symbolic links followed as the kernel would inside a chroot at `root`: an absolute
    target, or a '..' above '/', stays under the root, so a link never leads to the real host's files
    (the kubelet's kubelet-client-current.pem is an absolute link). Where a part does not exist the
    walk ends and the rest is joined as written, so the result is also where a new file goes. Open
    `root(followed(root, path))`, never `root(path)`, whose links the OS would follow on the real host.
    OSError (ELOOP) for a loop of links."""
    done, rest, _ = walk(root, path)
    return posixpath.normpath(posixpath.join(done, *rest))


def walk(root: Root, path: str) -> tuple[str, list[str], bool]:
    """The longest existing prefix of `path` with its links followed under `root` (as in a chroot), the
    parts after it (none when all of it exists), and whether the first missing part was named by a link:
    a link that leads to nothing, as opposed to a file not made yet under links that all lead somewhere
    (/var/run/cdi/nvidia.yaml where /var/run links to /run and /run/cdi does not exist yet).
    OSError: ELOOP past MAX_LINKS links, or a part that cannot be looked up."""
    pending = [(part, False) for part in path.split("/") if part]  # (part, named by a link)
    pending.reverse()  # a stack: the next part on top
    done = "/"
    links = 0
    while pending:
        part, from_link = pending.pop()
        if part in (".", ".."):
            done = posixpath.dirname(done) if part == ".." else done
            continue
        candidate = posixpath.join(done, part)
        try:
            info = os.lstat(root(candidate))
            target = os.readlink(root(candidate)) if stat.S_ISLNK(info.st_mode) else None
        except (FileNotFoundError, NotADirectoryError):
            return done, [part] + [name for name, _ in reversed(pending)], from_link
        except OSError as exc:  # named by its host path, not by where the root puts it
            raise OSError(exc.errno, exc.strerror, candidate) from None
        if target is None:
            done = candidate
            continue
        links += 1
        if links > MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        done = "/" if target.startswith("/") else done
        pending.extend(reversed([(p, True) for p in target.split("/") if p]))
    return done, [], False


def place(root: Root, path: str) -> str:
    """The host path of the entry `path` names, for creating, replacing or removing that entry itself:
    its directory's links followed as in a chroot at `root` (followed()), its last part as written,
    so that a link there is replaced or removed, never followed. ValueError for a path that names no
    entry ("/", "x/.."); OSError (ELOOP) for a loop of links."""
    directory, name = posixpath.split(posixpath.normpath(path))
    if name in ("", ".", ".."):
        raise ValueError(f"{path!r} names no file")
    return posixpath.join(followed(root, directory), name)


def link_text(root: Root, link: str, target: str) -> str:
    """What to write in a new link at host path `link` (its place(), links followed) so that the OS,
    which follows it on the real file system, reaches what `target` names read as in a chroot at
    `root`: a relative path between the two places under the root, whose '..' climb only real
    directories there. A link written so cannot lead a later write out of the root, whatever the
    target said (absolute, or '../../..' above '/'). OSError (ELOOP) for a loop of links."""
    directory = posixpath.dirname(link)
    resolved = followed(root, target if target.startswith("/") else posixpath.join(directory, target))
    return os.path.relpath(root(resolved), root(directory))
