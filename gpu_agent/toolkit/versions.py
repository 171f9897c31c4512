"""The versions of the container runtimes, the CDI consumers and the kubelet on the node: from the
package database under --root (dpkg's status file, also in a sandbox root), else, on the running system,
from the binary's own `--version` (run again only once the binary changed).

k3s, RKE2 and microk8s embed containerd and their own kubelet, and have no package record:
- k3s extracts its binaries to /var/lib/rancher/k3s/data/<hash>/bin, `current` linking to the one in
  use (k3s-io/k3s#11137 shows the layout); its bin/containerd is containerd's own main
  (k3s-io/k3s cmd/containerd/main.go), so `containerd --version` names the version the Node reports
  (`containerd github.com/k3s-io/containerd v1.7.23-k3s2`). `k3s --version` names k3s's, which is its
  kubelet's (`k3s version v1.31.4+k3s1`) and not containerd's.
- RKE2 links /var/lib/rancher/rke2/bin to its data/<version>/bin, containerd and its tools included
  (https://docs.rke2.io/reference/linux_agent_config and the cluster-access page put the tools on PATH
  from there); `rke2 --version` names its kubelet's.
- microk8s runs $SNAP/bin/containerd (canonical/microk8s microk8s-resources/wrappers/
  run-containerd-with-args); the snap's version (meta/snap.yaml, `version: v1.32.3`) is its
  Kubernetes', read as a file, so also in a sandbox root.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import AbstractSet, Optional, Union

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.bounded import Unreadable, read_checked, read_text
from gpu_agent.host.paths import Root, followed

DPKG_STATUS = "/var/lib/dpkg/status"
MAX_STATUS_BYTES = 32 << 20  # dpkg's status file of a full desktop install is a few MiB
MAX_SNAP_YAML_BYTES = 1 << 20  # microk8s's meta/snap.yaml is a few KiB
# Debian's packages and the runtimes' own repositories' (Docker's docker-ce, containerd.io).
PACKAGES = {
    "containerd": ("containerd", "containerd.io"),
    "docker": ("docker.io", "docker-ce", "moby-engine"),
    "crio": ("cri-o",),
    "kubelet": ("kubelet",),
    "podman": ("podman",),
    "nerdctl": ("nerdctl",),  # not packaged by Debian; its release tarball puts it in /usr/local/bin
    "nvidia-ctk": ("nvidia-container-toolkit",),
    "k3s": (), "rke2": (), "microk8s": (), "k3s-kubelet": (), "rke2-kubelet": (), "microk8s-kubelet": (),
}
BINARIES = {
    "containerd": ("/usr/bin/containerd", "/usr/local/bin/containerd"),
    "docker": ("/usr/bin/dockerd", "/usr/local/bin/dockerd"),
    "crio": ("/usr/bin/crio", "/usr/local/bin/crio"),
    "kubelet": ("/usr/bin/kubelet", "/usr/local/bin/kubelet"),
    "podman": ("/usr/bin/podman", "/usr/local/bin/podman"),
    "nerdctl": ("/usr/local/bin/nerdctl", "/usr/bin/nerdctl"),
    "nvidia-ctk": ("/usr/bin/nvidia-ctk",),
    "k3s": ("/var/lib/rancher/k3s/data/current/bin/containerd",),
    "rke2": ("/var/lib/rancher/rke2/bin/containerd",),
    "microk8s": ("/snap/microk8s/current/bin/containerd",),
    "k3s-kubelet": ("/usr/local/bin/k3s", "/usr/bin/k3s"),
    "rke2-kubelet": ("/usr/local/bin/rke2", "/usr/bin/rke2"),
    "microk8s-kubelet": (),
}
SNAP_YAML = {"microk8s-kubelet": "/snap/microk8s/current/meta/snap.yaml"}  # `version: v1.32.3`
TIMEOUT_S = 10.0
VERSION_OUTPUT_BYTES = 64 << 10  # of `--version`: a line or two; a program printing more is killed
MAX_VERSION_CHARS = 64  # of a version as read and shown: Debian's longest are about 40
_VERSION_CHARS = f"[0-9A-Za-z.~+-]{{0,{MAX_VERSION_CHARS - 3}}}"
# `containerd github.com/containerd/containerd 1.6.20~ds1 ...`, `Docker version 20.10.24+dfsg1, build x`,
# `crio version 1.28.1`, `Kubernetes v1.29.3`: the first word that is a version.
_VERSION = re.compile(rf"(?:^|\s)v?([0-9]{{1,9}}\.[0-9]{{1,9}}{_VERSION_CHARS})(?![0-9A-Za-z.~+-])")
_SNAP_VERSION = re.compile(rf"^version:[ \t]*['\"]?v?([0-9]{{1,9}}\.[0-9]{{1,9}}{_VERSION_CHARS})", re.MULTILINE)
# dpkg's status file: stanzas of `Field: value` lines, a blank line between them. Only these fields
# are read; whatever else a stanza holds (descriptions in any encoding) is skipped unread.
_FIELD = re.compile(rb"\n(?:(Package|Status|Version):[ \t]*([^\n]*)|(?=\n))")
_DEBIAN_VERSION = re.compile(rf"(?:[0-9]{{1,9}}:)?([0-9A-Za-z.+~:-]{{1,{MAX_VERSION_CHARS}}})")
UNREADABLE = ""  # a package installed whose Version is not one


def from_dpkg(status: Union[str, bytes], packages: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """(version without its epoch and Debian revision, package) of the first of `packages` installed."""
    return _first(installed_packages(status, set(packages)), packages)


def installed_packages(status: Union[str, bytes], wanted: AbstractSet[str]) -> dict[str, str]:
    """Each of the `wanted` packages installed, by name: its version without epoch and Debian revision
    (UNREADABLE where the stanza's Version is not a Debian version). Any bytes give an answer."""
    data = b"\n" + (status.encode("utf-8", "surrogateescape") if isinstance(status, str) else status)
    found: dict[str, str] = {}
    stanza: dict[bytes, bytes] = {}
    for match in _FIELD.finditer(data):
        if match.group(1) is None:  # a blank line ends the stanza
            _keep(stanza, wanted, found)
            stanza = {}
        else:
            stanza[match.group(1)] = match.group(2)
    _keep(stanza, wanted, found)
    return found


def _keep(stanza: dict[bytes, bytes], wanted: AbstractSet[str], found: dict[str, str]) -> None:
    name = stanza.get(b"Package", b"").strip().decode("ascii", errors="replace")
    if name in wanted and stanza.get(b"Status", b"").rstrip().endswith(b" installed"):
        version = stanza.get(b"Version", b"").strip().decode("ascii", errors="replace")
        match = _DEBIAN_VERSION.fullmatch(version)
        upstream = match.group(1) if match else UNREADABLE
        found[name] = upstream.rsplit("-", 1)[0] if "-" in upstream else upstream


def _first(found: dict[str, str], packages: tuple[str, ...]) -> Optional[tuple[str, str]]:
    return next(((found[name], name) for name in packages if name in found), None)


def from_output(text: str) -> Optional[str]:
    match = _VERSION.search(text)
    return match.group(1).rstrip(",") if match else None


class Versions:
    """What `read` answers, cached per binary (its inode and mtime) so a pass runs no process, and the
    package database read once per version of it (a pass asks for each runtime and consumer)."""

    def __init__(self, root: Root, timeout: float = TIMEOUT_S) -> None:
        self.root = root
        self.timeout = timeout
        self._ran: dict[str, tuple[tuple[int, int], Optional[str], str]] = {}  # stamp, version, why none
        self._dpkg: Optional[tuple[tuple[int, ...], dict[str, str], Optional[str]]] = None

    def _packages(self) -> tuple[dict[str, str], Optional[str]]:
        """The installed packages of PACKAGES from dpkg's status file, parsed once per version of it, and
        why it could not be read (None when it could, or is not there)."""
        try:
            path = self.root(followed(self.root, DPKG_STATUS))  # a link there leads inside the root
            status = os.stat(path)
        except OSError:
            self._dpkg = None
            return {}, None
        stamp = (status.st_ino, status.st_mtime_ns, status.st_size, status.st_mode)
        if self._dpkg is None or self._dpkg[0] != stamp:
            wanted = {package for packages in PACKAGES.values() for package in packages}
            try:
                self._dpkg = (stamp, installed_packages(read_checked(path, DPKG_STATUS, MAX_STATUS_BYTES) or b"",
                                                        wanted), None)
            except Unreadable as exc:
                self._dpkg = (stamp, {}, str(exc))
        return self._dpkg[1], self._dpkg[2]

    def _package(self, name: str) -> Optional[tuple[str, str]]:
        """(version, package) of `name`'s first package installed, from dpkg's status file."""
        return _first(self._packages()[0], PACKAGES[name])

    def installed(self, name: str) -> bool:
        """Whether the package database or a binary says `name` is on the node."""
        return self._package(name) is not None or any(self._exists(binary) for binary in BINARIES[name])

    def _exists(self, host_path: str) -> bool:
        try:
            return self.root(followed(self.root, host_path)).exists()
        except OSError:  # a loop of links
            return False

    def read(self, name: str) -> tuple[Optional[str], str]:
        """(version, where it was read) of a name of PACKAGES: containerd, docker, crio, kubelet, podman,
        nerdctl, nvidia-ctk, the containerd of k3s, rke2 or microk8s, or their kubelet (k3s-kubelet...);
        (None, why not)."""
        record = self._package(name)
        if record is not None:
            if record[0] == UNREADABLE:
                return None, f"package {record[1]}: its Version in {DPKG_STATUS} is not a version"
            return record[0], f"package {record[1]}"
        if name in SNAP_YAML:
            return self._snap_version(SNAP_YAML[name])
        problem = self._packages()[1]
        if not self.root.is_running_system:
            return None, problem or f"no package record under {self.root.path}"
        for binary in BINARIES[name]:
            path = self.root(binary)
            try:
                status = path.stat()
            except OSError:
                continue
            stamp = (status.st_ino, status.st_mtime_ns)
            if binary not in self._ran or self._ran[binary][0] != stamp:
                self._ran[binary] = (stamp, *self._run_version(binary, path))
            if self._ran[binary][1] is not None:
                return self._ran[binary][1], f"{binary} --version"
            return None, self._ran[binary][2]
        return None, problem or "no package record and no binary"

    def _run_version(self, binary: str, path: Path) -> tuple[Optional[str], str]:
        """(version, why none) from `binary --version`: its output bounded, what it prints decoded whatever
        the bytes, a binary that root does not own refused (host/trusted.py)."""
        try:
            done = proc.run([str(path), "--version"], timeout=self.timeout, limit=VERSION_OUTPUT_BYTES)
        except AgentError as exc:
            return None, str(exc)
        version = from_output(done.stdout + "\n" + done.stderr) if done.returncode == 0 else None
        exit_status = f" (exit {done.returncode})" if done.returncode else ""
        return version, f"{binary} --version told no version{exit_status}"

    def _snap_version(self, host_path: str) -> tuple[Optional[str], str]:
        try:
            text = read_text(self.root(followed(self.root, host_path)), host_path, MAX_SNAP_YAML_BYTES,
                             errors="replace") or ""
        except OSError:  # a loop of links
            text = ""
        except Unreadable as exc:
            return None, str(exc)
        match = _SNAP_VERSION.search(text)
        return (match.group(1), host_path) if match else (None, f"no version in {host_path}")
