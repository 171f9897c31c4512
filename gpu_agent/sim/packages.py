"""The simulator's package manager: installs the toolkit's files on a sandbox root."""
from __future__ import annotations

from typing import Any

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import read_text
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root, followed, place
from gpu_agent.toolkit.versions import BINARIES, DPKG_STATUS, MAX_STATUS_BYTES, PACKAGES


class SimPackages:
    """Under simulation: 'installs' the toolkit's files on the sandbox root and records it;
    `gpu-agent sim fail install` makes it fail the way apt-get does without NVIDIA's repository."""

    VERSION = "1.17.8-1"
    FILES = ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-ctk",
             "/usr/bin/nvidia-cdi-hook")

    def __init__(self, machine: Any, root: Root) -> None:
        self.machine = machine
        self.root = root

    def install(self, package: str) -> None:
        with self.machine.edit() as state:
            fault = next((f for f in state["faults"] if f["call"] == "install"), None)
            if fault is not None and fault.get("times") is not None:
                fault["times"] -= 1
                if fault["times"] <= 0:
                    state["faults"].remove(fault)
            state.setdefault("installed_packages", []).append(package)
        if fault is not None:
            raise AgentError(f"apt-get install -y --no-install-recommends {package} failed: E: Unable to locate "
                             f"package {package} (is NVIDIA's package repository configured? see the NVIDIA "
                             "Container Toolkit install guide)")
        if str(self.root.path) == "/":
            raise AgentError(f"simulated GPUs on the real root /: not installing {package}")
        for path in self.FILES:  # where links in the sandbox lead, read as in a chroot at it
            atomic_write(self.root(place(self.root, path)),
                         "#!/bin/sh\n# placeholder installed by the gpu-agent simulator\n", 0o755)
        record(self.root, package, self.VERSION)


def record(root: Root, package: str, version: str) -> None:
    """`package` at `version` in the package database under the root, any earlier record of it replaced."""
    status = root(followed(root, DPKG_STATUS))
    status.parent.mkdir(parents=True, exist_ok=True)
    kept = [paragraph for paragraph in (read_text(status, DPKG_STATUS, MAX_STATUS_BYTES) or "").split("\n\n")
            if paragraph.strip() and f"Package: {package}" not in paragraph.splitlines()]
    kept.append(f"Package: {package}\nStatus: install ok installed\nVersion: {version}")
    atomic_write(status, "\n\n".join(kept) + "\n\n")


def install_runtime(root: Root, name: str, version: str) -> str:
    """A container runtime or the kubelet as Debian's package lays it out: its binary and its record."""
    if str(root.path) == "/":
        raise AgentError(f"simulated runtimes on the real root /: not installing {name}")
    package = PACKAGES[name][0]
    atomic_write(root(place(root, BINARIES[name][0])), f"#!/bin/sh\necho '{name} {version} (simulated)'\n", 0o755)
    record(root, package, f"{version}-1")
    return f"{name} {version} installed (package {package})"
