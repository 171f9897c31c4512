"""Kernel modules: what is loaded (/proc/modules, /sys/module) and one way to load more (modprobe)."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root
from gpu_agent.host.procfs import (
    DriverVersion,
    LoadedModule,
    parse_char_majors,
    parse_driver_version,
    parse_modules,
    read,
)


class ModuleLoadError(AgentError):
    def __init__(self, module: str, output: str) -> None:
        super().__init__(f"modprobe {module} failed: {output}")
        self.module = module
        self.output = output


class ModuleUnloadError(AgentError):
    def __init__(self, module: str, output: str) -> None:
        super().__init__(f"rmmod {module} failed: {output}")
        self.module = module
        self.output = output


DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


class KernelModules:
    """Reads the running kernel's module state under the root."""

    def __init__(self, root: Root) -> None:
        self.root = root

    def loaded(self) -> dict[str, LoadedModule]:
        """Modules in /proc/modules. One listed there whose /sys/module entry is missing is still
        initialising or half-removed: it is left out, so it is probed again."""
        text = read(self.root, "/proc/modules")
        modules = parse_modules("/proc/modules", text) if text is not None else {}
        stuck = set(_not_live(text or ""))
        return {name: module for name, module in modules.items() if self.present(name) and name not in stuck}

    def stuck(self) -> list[str]:
        """Modules /proc/modules lists as Loading or Unloading: one whose init hangs (its modprobe killed or
        not) stays so until its init returns, and neither loads nor unloads again till then."""
        return _not_live(read(self.root, "/proc/modules") or "")

    def present(self, module: str) -> bool:
        return self.root(f"/sys/module/{module}").is_dir()

    def version(self, module: str) -> Optional[str]:
        return self._stripped(f"/sys/module/{module}/version")

    def driver_version(self) -> Optional[DriverVersion]:
        """The loaded nvidia module's /proc/driver/nvidia/version: its version, open or proprietary."""
        text = read(self.root, DRIVER_VERSION_FILE)
        return parse_driver_version(DRIVER_VERSION_FILE, text) if text is not None else None

    def parameter(self, module: str, name: str) -> Optional[str]:
        return self._stripped(f"/sys/module/{module}/parameters/{name}")

    def _stripped(self, host_path: str) -> Optional[str]:
        text = read(self.root, host_path)
        return text.strip() if text is not None else None

    def char_majors(self) -> dict[str, int]:
        """Character device majors by driver name, from /proc/devices."""
        return parse_char_majors("/proc/devices", read(self.root, "/proc/devices") or "")


def _not_live(text: str) -> list[str]:
    """The names in /proc/modules whose state (the fifth field) is not Live."""
    return [fields[0] for fields in (line.split() for line in text.splitlines())
            if len(fields) >= 5 and fields[4] in ("Loading", "Unloading")]


class ModuleLoader(Protocol):
    def load(self, module: str) -> None:
        """Load `module` with its dependencies; raise ModuleLoadError with the kernel's words."""


@runtime_checkable
class ModuleUnloader(Protocol):
    def unload(self, module: str) -> None:
        """Remove `module` alone (never its dependencies); raise ModuleUnloadError with the kernel's words."""


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

    def unload(self, module: str) -> None:
        """rmmod: one module, so the caller decides the order and nothing else goes with it."""
        if not self.root.is_running_system:
            raise AgentError(f"refusing to unload {module} from the running kernel while --root is {self.root.path}")
        done = proc.run(["rmmod", module], timeout=self.timeout)
        if done.returncode != 0:
            raise ModuleUnloadError(module, done.output or f"exit status {done.returncode}")
