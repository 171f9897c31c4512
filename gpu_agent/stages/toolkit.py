"""Container toolkit stage: the nvidia runtime in containerd, Docker and CRI-O, changed as
transactions (restart owed in the ledger, backup, atomic write, one restart, check, or everything
restored), one per runtime, so that one broken runtime blocks neither the others nor the CDI spec."""
from __future__ import annotations

import functools
import json
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpu_agent.config.toolkit import ToolkitConfig
from gpu_agent.errors import StageError
from gpu_agent.host import ledger as ledger_file
from gpu_agent.host import owned
from gpu_agent.host.files import BACKUP_DIR, remove, stray_temps
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root, resolve
from gpu_agent.numbers import version_numbers
from gpu_agent.plan import InstallPackage, RemoveFile
from gpu_agent.stages.base import Action, Stage
from gpu_agent.errors import AgentError
from gpu_agent.toolkit import cdi, configfile, containerd, crio, distributions, docker, runtime_config, transaction
from gpu_agent.toolkit.devicepath import DevicePath
from gpu_agent.toolkit.packages import PACKAGE, PackageInstaller
from gpu_agent.toolkit.services import ServiceControl
from gpu_agent.toolkit.transaction import FileChange, RuntimeChange
from gpu_agent.toolkit.versions import Versions

log = logging.getLogger(__name__)

MINIMUM_VERSION = (1, 17, 8)  # fixes CVE-2025-23266
HOOK = "/usr/bin/nvidia-container-runtime-hook"
OCI_HOOK = "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json"
PROBE_SECONDS = 1.0  # how long a runtime that owes a restart has to answer on its socket when observed


@dataclass(frozen=True)
class RuntimeKind:
    unit: str
    socket: str
    markers: tuple[str, ...]  # any of these present means the runtime is installed


RUNTIMES = {
    "containerd": RuntimeKind("containerd.service", "/run/containerd/containerd.sock",
                              (containerd.ROOT_CONFIG, "/usr/bin/containerd", "/usr/local/bin/containerd")),
    # Debian's and Ubuntu's docker.io install dockerd in /usr/sbin, Docker's own packages in /usr/bin.
    "docker": RuntimeKind("docker.service", "/run/docker.sock",
                          (docker.DAEMON_JSON, "/usr/bin/dockerd", "/usr/sbin/dockerd")),
    "crio": RuntimeKind("crio.service", "/var/run/crio/crio.sock", (crio.MAIN, crio.DROP_IN_DIR, "/usr/bin/crio")),
    # The distributions that embed containerd: found by the config they render (or template) at start;
    # their unit is the one the node runs (k3s or k3s-agent...), chosen when observed.
    **{name: RuntimeKind(d.units[0][0], d.socket, (d.rendered,)) for name, d in distributions.DISTRIBUTIONS.items()},
}


def found_runtimes(root: Root, settings: ToolkitConfig) -> list[str]:
    """toolkit.runtimes, or (auto) every runtime whose config file or binary the node has."""
    if settings.runtimes != "auto":
        return list(settings.runtimes)
    return [name for name, kind in RUNTIMES.items() if any(present(root, marker) for marker in kind.markers)]


def present(root: Root, host_path: str) -> bool:
    """Whether the node has `host_path`, its links followed under the root (/etc/containerd may link to
    /opt/containerd: that is the node's /opt, not this machine's)."""
    return root(configfile.resolve(root, host_path)).exists()


@dataclass
class ToolkitState:
    runtimes: list[str]
    missing: list[str] = field(default_factory=list)
    version: Optional[str] = None
    changes: list[RuntimeChange] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # by runtime (or "ledger"): what blocks its change
    strays: list[str] = field(default_factory=list)  # temp files of writes a crash interrupted

    def plannable(self, change: RuntimeChange) -> bool:
        return change.runtime not in self.errors and not (change.unit is not None and "ledger" in self.errors)


class Toolkit(Stage):
    name = "toolkit"
    produces = ("runtimes",)
    consumes = ("device_path",)

    def __init__(self, root: Root, services: ServiceControl, packages: PackageInstaller,
                 settings: ToolkitConfig, versions: Optional[Versions] = None) -> None:
        self.root = root
        self.versions = versions or Versions(root)  # shared with the device-path stage: dpkg parsed once
        self.services = services
        self.packages = packages
        self.settings = settings
        self.ledger = Ledger(root)
        self._restarted: dict[str, int] = {}  # by runtime: its restarts in the current pass (it gets one)
        self._failures: dict[str, str] = {}  # runtimes whose change failed in the current pass, and why

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> ToolkitState:
        runtimes = self._runtimes()
        state = ToolkitState(runtimes)
        if not runtimes:
            return state
        binaries = [self.settings.runtime_binary, HOOK] + ([cdi.HOOK] if self._cdi() else [])
        state.missing = [b for b in binaries if not self._present(b)]
        state.version = self._version()
        if state.missing or self._too_old(state.version):
            return state
        try:
            owed = self.ledger.pending_restarts()
        except AgentError as exc:
            owed, state.errors["ledger"] = set(), str(exc)
        state.changes = [self._runtime(name, owed, state.errors) for name in runtimes]
        state.changes += self._own_files(state.errors)
        state.strays = self._strays([item.path for change in state.changes for item in change.files])
        return state

    def _runtime(self, name: str, owed: set[str], errors: dict[str, str]) -> RuntimeChange:
        """One runtime's change: its files, its unit as systemd sees it, a restart owed from before."""
        kind = RUNTIMES[name]
        change = RuntimeChange(name, kind.unit, kind.socket, [], restart_owed=kind.unit in owed)
        builders: dict[str, Callable[[], list[FileChange]]] = {
            "containerd": self._containerd, "docker": self._docker, "crio": self._crio,
            **{other: functools.partial(self._distribution, other) for other in distributions.DISTRIBUTIONS}}
        try:
            if name in distributions.DISTRIBUTIONS:
                change.unit = distributions.unit(self.root, distributions.DISTRIBUTIONS[name], self.services)
                change.restart_owed = change.unit in owed
            assert change.unit is not None
            change.unit_state = self.services.state(change.unit)
            if change.restart_owed and change.unit_state is not None and change.unit_state.running:
                change.answer = self.services.wait_ready(change.unit, kind.socket, PROBE_SECONDS)
            change.files = builders[name]()
        except AgentError as exc:
            errors[name] = str(exc)
        return change

    def _strays(self, targets: list[str]) -> list[str]:
        """Host paths of the temp files atomic_write left, when a crash interrupted it, beside the files
        the stage writes (`targets`: where their symlinks lead) and in the backups directory."""
        managed = [containerd.ROOT_CONFIG, containerd.DROP_IN, docker.DAEMON_JSON, crio.DROP_IN, runtime_config.PATH,
                   runtime_config.RECORD, OCI_HOOK, ledger_file.PATH, *distributions.WRITTEN]
        by_directory: dict[str, list[str]] = {BACKUP_DIR: [], owned.ORIGINALS: []}
        for path in dict.fromkeys(managed + targets):
            by_directory.setdefault(posixpath.dirname(path), []).append(posixpath.basename(path))
        found_in = {directory: resolve(self.root, directory) for directory in by_directory}  # never the host's
        return [posixpath.join(real, found.name) for directory, names in by_directory.items()
                if (real := found_in[directory]) is not None
                for found in stray_temps(self.root(real), names or None)]

    def _runtimes(self) -> list[str]:
        return found_runtimes(self.root, self.settings)

    def _present(self, host_path: str) -> bool:
        return present(self.root, host_path)

    def _version(self) -> Optional[str]:
        """From the package database under the root; on the running system, nvidia-ctk --version."""
        return self.versions.read("nvidia-ctk")[0]

    def _too_old(self, version: Optional[str]) -> bool:
        numbers = version_numbers(version)
        return numbers is not None and not self.settings.allow_vulnerable_toolkit and numbers < MINIMUM_VERSION

    def _cdi(self, runtime: Optional[str] = None) -> bool:
        """Whether to write `runtime`'s CDI switch: where the device path says its version applies it."""
        path: Optional[DevicePath] = self.inputs.get("device_path")
        if runtime is None or path is None:
            return self.settings.cdi.enabled
        return runtime in path.cdi

    def _default(self, runtime: str) -> bool:
        """Whether nvidia is `runtime`'s default runtime: set_as_default true, or (auto) where the device path
        sends pods' GPUs through NVIDIA_VISIBLE_DEVICES."""
        path: Optional[DevicePath] = self.inputs.get("device_path")
        if path is None:
            return self.settings.set_as_default is True
        return runtime in path.nvidia_default

    def _containerd(self) -> list[FileChange]:
        files = containerd.plan(self.root, self.settings.runtime_binary, self._cdi("containerd"),
                               self._default("containerd"))
        # The drop-in copies the CRI table, registry credentials included: it gets the root file's mode.
        changes = [FileChange(files.drop_in_target, files.drop_in_current, files.drop_in_desired, foreign=False,
                              mode=files.root_mode)]
        if files.root_desired is not None:
            changes.insert(0, FileChange(files.root_target, files.root_current, files.root_desired, foreign=True))
        if any(change.needed for change in changes):
            self._validate_containerd(files)
        return changes

    def start_pass(self) -> None:
        self._restarted = {}
        self._failures = {}

    def _validate_containerd(self, files: containerd.ContainerdFiles) -> None:
        try:
            problem = containerd.validate(self.root, files, self.settings.runtime_binary)
        except containerd.Skipped:
            return
        if problem:
            raise StageError(f"{containerd.ROOT_CONFIG}: {problem}; nothing was changed")

    def _docker(self) -> list[FileChange]:
        current = configfile.read(self.root, docker.DAEMON_JSON)
        wanted = docker.desired(current.text, self.settings.runtime_binary, self._cdi("docker"),
                                self._default("docker"), current.shown)
        return [FileChange(current.target, current.text, wanted, foreign=True)]

    def _distribution(self, name: str) -> list[FileChange]:
        release = self.versions.read(f"{name}-kubelet")[0] if distributions.DISTRIBUTIONS[name].templated else None
        return distributions.plan(self.root, distributions.DISTRIBUTIONS[name], self.settings.runtime_binary,
                                  self._cdi(name), self._default(name), release)

    def _crio(self) -> list[FileChange]:
        wanted = crio.desired(self.root, self.settings.runtime_binary, self._default("crio"))
        if wanted is None:
            return []  # the other drop-ins (nvidia-ctk's) give it already: the agent's, if any, is undone
        current = configfile.read(self.root, crio.DROP_IN)
        return [FileChange(current.target, current.text, wanted, foreign=False)]

    def _own_files(self, errors: dict[str, str]) -> list[RuntimeChange]:
        """Files read by the toolkit itself at each container start: no restart needed. What blocks the
        runtime's config goes into `errors`, and the runtimes' own changes go on."""
        changes = []
        try:
            current = configfile.read(self.root, runtime_config.PATH)
            kept = configfile.read(self.root, runtime_config.RECORD)
            record = runtime_config.read_record(kept.text, kept.shown)
            wanted, after = runtime_config.desired(current.text, self.settings.runtime_config, record, current.shown)
            recorded = runtime_config.write_record(after)
        except AgentError as exc:
            errors["nvidia-container-runtime"] = str(exc)
            wanted = None
        if wanted is not None:
            files = [FileChange(current.target, current.text, wanted, foreign=True)]
            if recorded is not None:  # first: a crash between the two leaves keys recorded, never keys lost
                files.insert(0, FileChange(kept.target, kept.text, recorded, foreign=False, mode=0o600))
            changes.append(RuntimeChange("nvidia-container-runtime", None, None, files))
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
        actions = []
        if state.strays:  # temp files of writes a crash interrupted
            actions.append(Action(tuple(RemoveFile(path) for path in state.strays), lambda: self._remove(state.strays)))
        # Restarts owed by an earlier pass first; each change alone: one failing stops no other.
        owed_first = sorted(state.changes, key=lambda change: not change.restart_owed)
        actions += [Action(change.planned(), functools.partial(self._apply, change),
                           diff="".join(item.diff() for item in change.needed))
                    for change in owed_first if change.pending and state.plannable(change)]
        return actions

    def _remove(self, strays: list[str]) -> None:
        for path in strays:
            log.info("removing %s, left by a write that a crash interrupted", path)
            try:
                remove(self.root(path))
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc.strerror or exc)

    def _install(self) -> None:
        try:
            self.packages.install(PACKAGE)
        except AgentError as exc:
            raise StageError(str(exc)) from None

    def _apply(self, change: RuntimeChange) -> None:
        """One runtime's transaction; a failure is recorded for verify() and the next change still runs."""
        if change.restarts_unit and change.runtime in self._restarted:
            log.warning("%s was restarted in this pass already; its next change waits for the next pass",
                        change.runtime)
            return
        try:
            transaction.apply(self.root, change, self.services, self.ledger, self.settings.restart_timeout_seconds,
                              self.report)
        except AgentError as exc:
            self._failures[change.runtime] = str(exc)
        finally:
            if change.restarts:
                self._restarted[change.runtime] = self._restarted.get(change.runtime, 0) + len(change.restarts)

    def restarts(self) -> dict[str, int]:
        return dict(self._restarted)

    def verify(self, state: ToolkitState) -> str:
        if not state.runtimes:
            return "no container runtime found (containerd, Docker, CRI-O): nothing to configure"
        if state.missing:
            raise StageError(f"the NVIDIA Container Toolkit is not installed ({', '.join(state.missing)} missing): "
                             "install nvidia-container-toolkit 1.17.8 or newer, or set toolkit.install: true")
        if self._too_old(state.version):
            raise StageError(f"nvidia-container-toolkit {state.version} is older than 1.17.8 and open to "
                             "CVE-2025-23266 (container escape): upgrade it, or set toolkit.allow_vulnerable_toolkit")
        changed = {change.runtime for change in state.changes}
        problems = [error for name, error in state.errors.items() if name not in changed]  # the ledger
        for change in state.changes:
            failed = [text for text in (self._failures.get(change.runtime), state.errors.get(change.runtime)) if text]
            down = change.down()
            problems += failed + ([down] if down else [])
            if change.pending and not failed and state.plannable(change):
                problems.append(f"not converged: {change.summary()}")
        if problems:
            raise StageError("; ".join(problems))
        version = f"toolkit {state.version}" if state.version else "toolkit version unknown"
        return f"nvidia runtime configured for {', '.join(state.runtimes)}; {version}{self._path_notes(state)}"

    def _path_notes(self, state: ToolkitState) -> str:
        """What the device path changed here: CDI switches not written, and why; nvidia made the default."""
        path: Optional[DevicePath] = self.inputs.get("device_path")
        if path is None:
            return ""
        notes = [f"{name}: {why}" for name, why in path.no_cdi.items() if name in state.runtimes]
        notes += [f"nvidia is {name}'s default runtime" for name in path.nvidia_default if name in state.runtimes]
        return "".join(f"; {note}" for note in notes)

    def outputs(self, state: ToolkitState) -> dict[str, Any]:
        return {"runtimes": tuple(state.runtimes)}

    def claims(self, state: ToolkitState) -> Optional[set[str]]:
        """Every file of every runtime found; unknown while the toolkit is missing or a config is broken."""
        if state.missing or self._too_old(state.version) or state.errors:
            return None
        return {item.path for change in state.changes for item in change.files}

    def facts(self, observed: Any) -> dict[str, Any]:
        """The runtimes' units as systemd last showed them, and the restarts the ledger says are owed."""
        if not isinstance(observed, ToolkitState):
            return {}
        units = {c.unit: c.unit_state.describe() for c in observed.changes if c.unit and c.unit_state is not None}
        owed = sorted(c.unit for c in observed.changes if c.unit and c.restart_owed)
        return {"units": units, "owed_restarts": owed} if units or owed else {}

    def watched(self) -> list[str]:
        """Files someone else may rewrite: a change is reconciled within seconds."""
        return [containerd.ROOT_CONFIG, containerd.DROP_IN, docker.DAEMON_JSON, crio.DROP_IN, runtime_config.PATH,
                *(d.rendered for d in distributions.DISTRIBUTIONS.values())]
