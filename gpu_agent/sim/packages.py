"""The simulator's package manager: installs the toolkit's files on a sandbox root."""
from __future__ import annotations

from typing import Any

from gpu_agent.errors import AgentError
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root, followed, place

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
        status = self.root(followed(self.root, "/var/lib/dpkg/status"))
        status.parent.mkdir(parents=True, exist_ok=True)
        with open(status, "a") as db:
            db.write(f"Package: {package}\nStatus: install ok installed\nVersion: {self.VERSION}\n\n")
