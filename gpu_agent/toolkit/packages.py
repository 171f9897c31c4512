"""nvidia-container-toolkit put on the node by apt-get or dnf, whichever the distribution has."""
from __future__ import annotations

import shutil
from typing import Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root

PACKAGE = "nvidia-container-toolkit"
TIMEOUT_S = 600.0
_NONINTERACTIVE = {"DEBIAN_FRONTEND": "noninteractive"}


class PackageInstaller(Protocol):
    def install(self, package: str) -> None:
        """Install `package` or raise AgentError with the package manager's words."""


class SystemPackages:
    """apt-get or dnf on the running system, non-interactive, with a timeout."""

    def __init__(self, root: Root) -> None:
        self.root = root

    def install(self, package: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"refusing to install {package} on this machine while --root is {self.root.path}")
        if shutil.which("apt-get"):
            argv = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confold",
                    package]
        elif shutil.which("dnf"):
            argv = ["dnf", "install", "-y", package]
        else:
            raise AgentError(f"no apt-get or dnf to install {package} with: install it yourself")
        done = proc.run(argv, timeout=TIMEOUT_S, env=_NONINTERACTIVE)
        if done.returncode != 0:
            raise AgentError(f"{' '.join(argv)} failed: {done.output[-400:]} (is NVIDIA's package repository "
                             "configured? see the NVIDIA Container Toolkit install guide)")
