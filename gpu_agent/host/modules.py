"""Kernel modules: what is loaded (/proc/modules, /sys/module) and one way to load more (modprobe)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.files import read_text
from gpu_agent.host.paths import Root


class ModuleLoadError(AgentError):
    def __init__(self, module: str, output: str) -> None:
        super().__init__(f"modprobe {module} failed: {output}")
        self.module = module
        self.output = output


@dataclass(frozen=True)
class LoadedModule:
    name: str
    refcnt: int
    holders: tuple[str, ...]


class KernelModules:
    """Reads the running kernel's module state under the root."""

    def __init__(self, root: Root) -> None:
        self.root = root

    def loaded(self) -> dict[str, LoadedModule]:
        try:
            lines = self.root("/proc/modules").read_text().splitlines()
        except FileNotFoundError:
            return {}
        modules = {}
        for line in lines:
            fields = line.split()
            if len(fields) >= 4:
                holders = tuple(h for h in fields[3].split(",") if h and h != "-")
                modules[fields[0]] = LoadedModule(fields[0], int(fields[2]), holders)
        return modules

    def present(self, module: str) -> bool:
        return self.root(f"/sys/module/{module}").is_dir()

    def version(self, module: str) -> Optional[str]:
        return _stripped(self.root(f"/sys/module/{module}/version"))

    def parameter(self, module: str, name: str) -> Optional[str]:
        return _stripped(self.root(f"/sys/module/{module}/parameters/{name}"))

    def char_majors(self) -> dict[str, int]:
        """Character device majors by driver name, from /proc/devices."""
        text = read_text(self.root("/proc/devices")) or ""
        majors: dict[str, int] = {}
        in_char = False
        for line in text.splitlines():
            if line.strip() == "Character devices:":
                in_char = True
            elif line.strip().endswith("devices:"):
                in_char = False
            elif in_char and line.split()[:1] and line.split()[0].isdigit():
                number, name = line.split(None, 1)
                majors.setdefault(name.strip(), int(number))
        return majors


class ModuleLoader(Protocol):
    def load(self, module: str) -> None:
        """Load `module` with its dependencies; raise ModuleLoadError with the kernel's words."""


class Modprobe:
    """modprobe on the running kernel; only for --root / (a different root is not the running kernel)."""

    def __init__(self, root: Root, timeout: float) -> None:
        self.root = root
        self.timeout = timeout

    def load(self, module: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(
                f"refusing to load {module} into the running kernel while --root is {self.root.path}: "
                "use --simulate to rehearse against a sandbox root"
            )
        done = proc.run(["modprobe", module], timeout=self.timeout)
        if done.returncode != 0:
            raise ModuleLoadError(module, done.output or f"exit status {done.returncode}")


def _stripped(path: Path) -> Optional[str]:
    text = read_text(path)
    return text.strip() if text is not None else None
