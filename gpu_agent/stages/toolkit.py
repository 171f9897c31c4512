"""Container toolkit stage: the nvidia runtime in containerd, Docker and CRI-O, changed as
transactions (backup, atomic write, one restart, check, or everything restored)."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Optional

from gpu_agent.config.toolkit import ToolkitConfig
from gpu_agent.errors import StageError
from gpu_agent.host import proc
from gpu_agent.host.files import read_text
from gpu_agent.host.paths import Root
from gpu_agent.plan import InstallPackage
from gpu_agent.stages.base import Action, Stage
from gpu_agent.state import AgentState
from gpu_agent.errors import AgentError
from gpu_agent.toolkit import cdi, configfile, containerd, crio, docker, runtime_config, transaction
from gpu_agent.toolkit.packages import PACKAGE, PackageInstaller
from gpu_agent.toolkit.services import ServiceControl
from gpu_agent.toolkit.transaction import FileChange, RuntimeChange

log = logging.getLogger(__name__)

MINIMUM_VERSION = (1, 17, 8)  # fixes CVE-2025-23266
HOOK = "/usr/bin/nvidia-container-runtime-hook"
OCI_HOOK = "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json"


@dataclass(frozen=True)
class RuntimeKind:
    unit: str
    socket: str
    markers: tuple[str, ...]  # any of these present means the runtime is installed


RUNTIMES = {
    "containerd": RuntimeKind("containerd.service", "/run/containerd/containerd.sock",
                              (containerd.ROOT_CONFIG, "/usr/bin/containerd", "/usr/local/bin/containerd")),
    "docker": RuntimeKind("docker.service", "/run/docker.sock", (docker.DAEMON_JSON, "/usr/bin/dockerd")),
    "crio": RuntimeKind("crio.service", "/var/run/crio/crio.sock", (crio.MAIN, crio.DROP_IN_DIR, "/usr/bin/crio")),
}


@dataclass
class ToolkitState:
    runtimes: list[str]
    missing: list[str] = field(default_factory=list)
    version: Optional[str] = None
    changes: list[RuntimeChange] = field(default_factory=list)


class Toolkit(Stage):
    name = "toolkit"
    requires = ("discovery",)
    consumes = ("inventory",)

    def __init__(self, root: Root, services: ServiceControl, packages: PackageInstaller, state: AgentState,
                 settings: ToolkitConfig) -> None:
        self.root = root
        self.services = services
        self.packages = packages
        self.agent = state
        self.settings = settings
        self._restarted: set[str] = set()  # runtimes restarted in the current pass: one restart each
        self._ctk_version: Optional[tuple[tuple[int, int], Optional[str]]] = None

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> ToolkitState:
        runtimes = self._runtimes()
        state = ToolkitState(runtimes)
        if not runtimes:
            return state
        binaries = [self.settings.runtime_binary, HOOK] + ([cdi.HOOK] if self._cdi() else [])
        state.missing = [b for b in binaries if not self.root(b).exists()]
        state.version = self._version()
        if state.missing or self._too_old(state.version):
            return state
        builders = {"containerd": self._containerd, "docker": self._docker, "crio": self._crio}
        state.changes = [builders[name]() for name in runtimes]
        state.changes += self._own_files()
        if self._cdi():
            state.changes.append(self._cdi_spec())
        return state

    def _cdi_spec(self) -> RuntimeChange:
        """The CDI spec for the GPUs discovery found; rewritten only when its content changes
        (a driver update, a MIG change, device majors after a driver reload)."""
        inventory = self.inputs.get("inventory")
        if inventory is None:
            raise StageError("no GPU inventory for the CDI spec")
        try:
            files = cdi.discover(self.root, inventory.driver_version)
            if files.missing:
                raise StageError(f"driver {inventory.driver_version}'s userspace libraries are missing from the ld.so "
                                 f"cache ({', '.join(files.missing)}): reinstall the driver's userspace, or run ldconfig")
            spec = cdi.render(cdi.build_spec(inventory, self.root, files))
        except AgentError as exc:
            raise StageError(f"CDI spec: {exc}") from None
        current = configfile.read(self.root, self.settings.cdi.path)
        return RuntimeChange("cdi", None, None, [FileChange(current.target, current.text, spec, foreign=False)])

    def _runtimes(self) -> list[str]:
        if self.settings.runtimes != "auto":
            return list(self.settings.runtimes)
        return [name for name, kind in RUNTIMES.items() if any(self.root(m).exists() for m in kind.markers)]

    def _version(self) -> Optional[str]:
        """From the package database under the root; on the running system, nvidia-ctk --version."""
        status = read_text(self.root("/var/lib/dpkg/status")) or ""
        match = re.search(r"^Package: nvidia-container-toolkit\n(?:[^\n]+\n)*?Version: ([^\s-]+)", status, re.MULTILINE)
        if match:
            return match.group(1)
        ctk = self.root("/usr/bin/nvidia-ctk")
        if self.root.is_running_system and ctk.exists():
            stamp = (ctk.stat().st_ino, ctk.stat().st_mtime_ns)
            if self._ctk_version is None or self._ctk_version[0] != stamp:  # run it again only after an upgrade
                done = proc.run([str(ctk), "--version"], timeout=30)
                found = re.search(r"version (\d+\.\d+\.\d+)", done.stdout)
                self._ctk_version = (stamp, found.group(1) if found else None)
            return self._ctk_version[1]
        return None

    def _too_old(self, version: Optional[str]) -> bool:
        return (version is not None and not self.settings.allow_vulnerable_toolkit
                and tuple(int(p) for p in re.findall(r"\d+", version)[:3]) < MINIMUM_VERSION)

    def _cdi(self) -> bool:
        return self.settings.cdi.enabled

    def _containerd(self) -> RuntimeChange:
        files = containerd.plan(self.root, self.settings.runtime_binary, self._cdi(), self.settings.set_as_default)
        # The drop-in copies the CRI table, registry credentials included: it gets the root file's mode.
        changes = [FileChange(files.drop_in_target, files.drop_in_current, files.drop_in_desired, foreign=False,
                              mode=files.root_mode)]
        if files.root_desired is not None:
            changes.insert(0, FileChange(files.root_target, files.root_current, files.root_desired, foreign=True))
        change = RuntimeChange("containerd", RUNTIMES["containerd"].unit, RUNTIMES["containerd"].socket, changes)
        if change.needed:
            self._validate_containerd(files)
        return change

    def start_pass(self) -> None:
        self._restarted: set[str] = set()

    def _validate_containerd(self, files: containerd.ContainerdFiles) -> None:
        try:
            problem = containerd.validate(self.root, files, self.settings.runtime_binary)
        except containerd.Skipped:
            return
        if problem:
            raise StageError(f"{containerd.ROOT_CONFIG}: {problem}; nothing was changed")

    def _docker(self) -> RuntimeChange:
        current = configfile.read(self.root, docker.DAEMON_JSON)
        wanted = docker.desired(current.text, self.settings.runtime_binary, self._cdi(), self.settings.set_as_default,
                                current.shown)
        return RuntimeChange("docker", RUNTIMES["docker"].unit, RUNTIMES["docker"].socket,
                             [FileChange(current.target, current.text, wanted, foreign=True)])

    def _crio(self) -> RuntimeChange:
        wanted = crio.desired(self.root, self.settings.runtime_binary, self.settings.set_as_default)
        current = configfile.read(self.root, crio.DROP_IN)
        return RuntimeChange("crio", RUNTIMES["crio"].unit, RUNTIMES["crio"].socket,
                             [FileChange(current.target, current.text, wanted, foreign=False)])

    def _own_files(self) -> list[RuntimeChange]:
        """Files read by the toolkit itself at each container start: no restart needed."""
        changes = []
        current = configfile.read(self.root, runtime_config.PATH)
        wanted = runtime_config.desired(current.text, self.settings.runtime_config, current.shown)
        if wanted is not None:
            changes.append(RuntimeChange("nvidia-container-runtime", None, None,
                                         [FileChange(current.target, current.text, wanted, foreign=True)]))
        if self.settings.oci_hook:
            hook = json.dumps({
                "version": "1.0.0",
                "hook": {"path": HOOK, "args": ["nvidia-container-runtime-hook", "prestart"],
                         "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
                "when": {"always": True, "commands": [".*"]},
                "stages": ["prestart"],
            }, indent=2) + "\n"
            current = configfile.read(self.root, OCI_HOOK)
            changes.append(RuntimeChange("oci-hook", None, None,
                                         [FileChange(current.target, current.text, hook, foreign=False)]))
        return changes

    # --- plan, apply, verify ---------------------------------------------------------------------

    def plan(self, state: ToolkitState) -> list[Action]:
        if state.missing and self.settings.install:
            return [Action.of(InstallPackage(PACKAGE, f"{', '.join(state.missing)} missing"), self._install)]
        return [Action(change.planned(), lambda c=change: self._apply(c),
                       diff="".join(item.diff() for item in change.needed))
                for change in state.changes if change.needed]

    def _install(self) -> None:
        try:
            self.packages.install(PACKAGE)
        except AgentError as exc:
            raise StageError(str(exc)) from None

    def _apply(self, change: RuntimeChange) -> None:
        if change.unit is not None and change.runtime in self._restarted:
            log.warning("%s was restarted in this pass already; its next change waits for the next pass", change.runtime)
            return
        try:
            transaction.apply(self.root, change, self.services, self.settings.restart_timeout_seconds)
        finally:
            if change.restarts:
                self._restarted.add(change.runtime)
            for _ in change.restarts:
                self.agent.runtime_restarts[change.runtime] = self.agent.runtime_restarts.get(change.runtime, 0) + 1

    def verify(self, state: ToolkitState) -> str:
        if not state.runtimes:
            return "no container runtime found (containerd, Docker, CRI-O): nothing to configure"
        if state.missing:
            raise StageError(f"the NVIDIA Container Toolkit is not installed ({', '.join(state.missing)} missing): "
                             "install nvidia-container-toolkit 1.17.8 or newer, or set toolkit.install: true")
        if self._too_old(state.version):
            raise StageError(f"nvidia-container-toolkit {state.version} is older than 1.17.8 and open to "
                             "CVE-2025-23266 (container escape): upgrade it, or set toolkit.allow_vulnerable_toolkit")
        pending = [change.summary() for change in state.changes if change.needed]
        if pending:
            raise StageError("not converged: " + "; ".join(pending))
        version = f"toolkit {state.version}" if state.version else "toolkit version unknown"
        return f"nvidia runtime configured for {', '.join(state.runtimes)}; {version}"

    def watched(self) -> list[str]:
        """Files someone else may rewrite: a change is reconciled within seconds."""
        return [containerd.ROOT_CONFIG, containerd.DROP_IN, docker.DAEMON_JSON, crio.DROP_IN, runtime_config.PATH,
                self.settings.cdi.path]
