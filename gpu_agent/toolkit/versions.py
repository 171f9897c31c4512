"""The versions of the container runtimes and of the kubelet on the node: from the package database
under --root (dpkg's status file, also in a sandbox root), else, on the running system, from the
binary's own `--version` (run again only once the binary changed)."""
from __future__ import annotations

import re
from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.files import read_text
from gpu_agent.host.paths import Root

DPKG_STATUS = "/var/lib/dpkg/status"
# Debian's packages and the runtimes' own repositories' (Docker's docker-ce, containerd.io).
PACKAGES = {
    "containerd": ("containerd", "containerd.io"),
    "docker": ("docker.io", "docker-ce", "moby-engine"),
    "crio": ("cri-o",),
    "kubelet": ("kubelet",),
}
BINARIES = {
    "containerd": ("/usr/bin/containerd", "/usr/local/bin/containerd"),
    "docker": ("/usr/bin/dockerd", "/usr/local/bin/dockerd"),
    "crio": ("/usr/bin/crio", "/usr/local/bin/crio"),
    "kubelet": ("/usr/bin/kubelet", "/usr/local/bin/kubelet"),
}
TIMEOUT_S = 10.0
# `containerd github.com/containerd/containerd 1.6.20~ds1 ...`, `Docker version 20.10.24+dfsg1, build x`,
# `crio version 1.28.1`, `Kubernetes v1.29.3`: the first word that is a version.
_VERSION = re.compile(r"(?:^|\s)v?(\d+\.\d+(?:\.\d+)?[0-9A-Za-z.~+-]*)")


def from_dpkg(status: str, packages: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """(version without its epoch and Debian revision, package) of the first of `packages` installed."""
    found: dict[str, str] = {}
    for paragraph in status.split("\n\n"):
        fields = dict(line.partition(": ")[::2] for line in paragraph.splitlines() if ": " in line)
        if fields.get("Package") in packages and fields.get("Status", "").endswith(" installed"):
            version = fields.get("Version", "").split(":", 1)[-1]
            found[fields["Package"]] = version.rsplit("-", 1)[0] if "-" in version else version
    return next(((found[name], name) for name in packages if found.get(name)), None)


def from_output(text: str) -> Optional[str]:
    match = _VERSION.search(text)
    return match.group(1).rstrip(",") if match else None


class Versions:
    """What `read` answers, cached per binary (its inode and mtime) so a pass runs no process."""

    def __init__(self, root: Root, timeout: float = TIMEOUT_S) -> None:
        self.root = root
        self.timeout = timeout
        self._ran: dict[str, tuple[tuple[int, int], Optional[str]]] = {}

    def read(self, name: str) -> tuple[Optional[str], str]:
        """(version, where it was read) of containerd, docker, crio or kubelet; (None, why not)."""
        record = from_dpkg(read_text(self.root(DPKG_STATUS)) or "", PACKAGES[name])
        if record is not None:
            return record[0], f"package {record[1]}"
        if not self.root.is_running_system:
            return None, f"no package record under {self.root.path}"
        for binary in BINARIES[name]:
            path = self.root(binary)
            try:
                status = path.stat()
            except OSError:
                continue
            stamp = (status.st_ino, status.st_mtime_ns)
            if binary not in self._ran or self._ran[binary][0] != stamp:
                try:
                    done = proc.run([str(path), "--version"], timeout=self.timeout)
                    version = from_output(done.stdout + "\n" + done.stderr) if done.returncode == 0 else None
                except AgentError:
                    version = None
                self._ran[binary] = (stamp, version)
            if self._ran[binary][1] is not None:
                return self._ran[binary][1], f"{binary} --version"
            return None, f"{binary} --version told no version"
        return None, "no package record and no binary"
