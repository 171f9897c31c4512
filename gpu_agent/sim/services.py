"""The simulator's service manager: the container runtimes' units, their restarts, and the configs
they loaded; `gpu-agent sim fail restart` makes restarts fail, or the runtime not come back. And every other
unit as systemd keeps it: one exists where its unit file is (or, for a runtime, where it is installed), runs
from boot, and `systemctl stop|start` change its ActiveState (`sim fail stop|start --unit U` make them fail)."""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.files import atomic_write, read_bytes
from gpu_agent.host.paths import Root
from gpu_agent.toolkit.distributions import DISTRIBUTIONS
from gpu_agent.toolkit.services import ServiceControl, UnitState

# What each simulated runtime reads when it starts.
CONFIGS = {
    "containerd.service": ("/etc/containerd/config.toml", "/etc/containerd/conf.d/*.toml"),
    "docker.service": ("/etc/docker/daemon.json",),
    "crio.service": ("/etc/crio/crio.conf", "/etc/crio/crio.conf.d/*.conf"),
}
# The distributions' units: there only where their unit file is (as their installers lay it out).
UNIT_FILES = {unit: files for distribution in DISTRIBUTIONS.values() for unit, files in distribution.units}
CONFIGS.update({unit: distribution.reads for distribution in DISTRIBUTIONS.values() for unit, _ in distribution.units})
RESTART_ERRORS = ("failed", "not-ready", "hangs")
UNIT_ERRORS = ("failed",)  # `sim fail stop|start`
UNIT_DIRS = ("/etc/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
_HISTORY = 200  # restart times kept per unit


def unit_file(root: Root, unit: str) -> bool:
    """Whether systemd would find `unit`'s unit file under the root."""
    return "/" not in unit and any(root(f"{directory}/{unit}").is_file() for directory in UNIT_DIRS)


def file_state(root: Root, unit: str, service: Optional[dict[str, Any]]) -> str:
    """UnitFileState as systemctl would show it: a mask or an enablement the simulated systemctl set, else
    the files under the root (a mask's link to /dev/null, an enablement's link in a .wants directory, an
    [Install] section), as a package's preset leaves them."""
    service = service or {}
    mask = root(f"{UNIT_DIRS[0]}/{unit}")
    if service.get("masked", mask.is_symlink() and os.readlink(mask) == "/dev/null"):
        return "masked"
    if service.get("enablement"):
        return str(service["enablement"])
    wants = [d for d in root(UNIT_DIRS[0]).glob("*.wants") if d.is_dir()]
    if any(os.path.lexists(d / unit) for d in wants):  # a link to the unit file, as a host path
        return "enabled"
    text = next((read_bytes(root(f"{d}/{unit}")) for d in UNIT_DIRS if root(f"{d}/{unit}").is_file()), None)
    if text is None:
        return ""
    return "disabled" if b"[Install]" in text else "static"


def install_unit(root: Root, unit: str, program: str) -> None:
    """A package's unit file, as its package lays it out (a placeholder that names what it runs)."""
    atomic_write(root(f"/usr/lib/systemd/system/{unit}"),
                 f"# placeholder installed by the gpu-agent simulator\n[Service]\nExecStart={program}\n")


def boot_services(root: Root, state: dict[str, Any]) -> None:
    """A reboot: every unit the machine knows runs again, its runtime's config read afresh."""
    for unit, service in state.get("services", {}).items():
        service.update(active_state="active", sub_state="running", since=time.time(), ready=True,
                       loaded=config_digests(root, unit))


def config_digests(root: Root, unit: str) -> dict[str, str]:
    """sha256 of every config file the unit's runtime would read now, by host path."""
    found = {}
    for pattern in CONFIGS.get(unit, ()):
        directory, _, name = pattern.rpartition("/")
        for path in sorted(root(directory).glob(name)):
            data = read_bytes(path) if path.is_file() else None
            if data is not None:
                found[f"{directory}/{path.name}"] = hashlib.sha256(data).hexdigest()
    return found


def systemd_time(seconds: float) -> str:
    return time.strftime("%a %Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class SimServices:
    """Each unit is kept in the simulated machine as {active_state, sub_state, since, ready, restarts,
    restart_times, loaded}: `loaded` is what its config files held when it last started (at boot:
    when the simulator first saw it), so tests can tell a runtime running an old config."""

    def __init__(self, machine: Any, timeout: float) -> None:
        self.machine = machine
        self.root: Root = machine.root
        self.timeout = timeout  # how long `systemctl restart` may take before it is killed
        installed = [unit for unit in CONFIGS if unit not in UNIT_FILES
                     or any(self.root(path).is_file() for path in UNIT_FILES[unit])]
        if any(unit not in machine.read().get("services", {}) for unit in installed):
            with machine.edit() as state:
                services = state.setdefault("services", {})
                for unit in installed:
                    if unit not in services:
                        services[unit] = self._started(unit, {"restarts": 0, "restart_times": []})

    def state(self, unit: str) -> Optional[UnitState]:
        service = self.machine.read().get("services", {}).get(unit)
        files = file_state(self.root, unit, service)
        load = "masked" if files == "masked" else "loaded"
        if service is None and unit_file(self.root, unit):  # started at boot (unless masked), untouched since
            return UnitState(unit, load, *(("inactive", "dead") if files == "masked" else ("active", "running")), "",
                             files)
        if service is None:
            return UnitState(unit, "not-found", "inactive", "dead", "")
        since = service.get("since")
        return UnitState(unit, load, service.get("active_state", "active"), service.get("sub_state", "running"),
                         systemd_time(since) if since else "", files)

    def restart(self, unit: str) -> None:
        with self.machine.edit() as state:
            service = state.setdefault("services", {}).get(unit)
            if service is None:
                raise AgentError(f"systemctl restart {unit} failed: Unit {unit} not found.")
            service["restarts"] = service.get("restarts", 0) + 1
            service["restart_times"] = (service.get("restart_times", []) + [time.time()])[-_HISTORY:]
            fault = take_fault(state, "restart", unit)
            if fault is None or fault == "not-ready":
                self._started(unit, service)
                service["ready"] = fault is None
            else:
                service.update(active_state="failed" if fault == "failed" else "activating",
                               sub_state="failed" if fault == "failed" else "start",
                               since=time.time(), ready=False, loaded=None)
        if fault == "failed":
            raise AgentError(f"systemctl restart {unit} failed: Job for {unit} failed because the control "
                             f"process exited with error code; see journalctl -u {unit}")
        if fault == "hangs":
            time.sleep(self.timeout)
            raise AgentError(f"systemctl restart {unit} did not finish within {self.timeout:g} s and was killed")

    def wait_ready(self, unit: str, socket_path: str, timeout: float,
                   progress: Callable[[str], None] = lambda waiting: None) -> Optional[str]:
        service = self.machine.read().get("services", {}).get(unit, {})
        if service.get("ready", False):
            return None
        return f"no answer on {socket_path} within {timeout:g} s (Connection refused)"

    def _started(self, unit: str, service: dict[str, Any]) -> dict[str, Any]:
        service.update(active_state="active", sub_state="running", since=time.time(), ready=True,
                       loaded=config_digests(self.root, unit))
        return service



def take_fault(state: dict[str, Any], call: str, unit: str) -> Optional[str]:
    """The error of the first fault set for `call` on `unit`, one of its times used up; None: no fault."""
    for fault in state["faults"]:
        if fault["call"] == call and fault.get("unit") in (None, unit) and (fault.get("times") or 1) > 0:
            if fault.get("times") is not None:
                fault["times"] -= 1
                if fault["times"] <= 0:
                    state["faults"].remove(fault)
            return str(fault["error"])
    return None


def _trigger_masked(root: Root, unit: str, services: dict[str, Any]) -> bool:
    """Whether `unit` is a path unit whose service (its namesake, as systemd.path(5) defaults Unit=) is masked:
    systemd refuses to start it ("Refusing to start, unit ... to trigger not loaded")."""
    if not unit.endswith(".path"):
        return False
    service = unit[:-len(".path")] + ".service"
    return file_state(root, service, services.get(service)) == "masked"


class SimUnits:
    """`systemctl stop|start|enable|disable|mask|unmask UNIT` on the simulated machine, as systemd answers: a
    unit with no unit file is not found; stop makes it inactive, start active (a masked unit refuses), or
    failed with `sim fail start`; the others change its UnitFileState; each call is recorded."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine
        self.root: Root = machine.root

    def __call__(self, verb: str, unit: str) -> None:
        error = None
        with self.machine.edit() as state:
            services = state.setdefault("services", {})
            service = services.get(unit)
            if service is None and not unit_file(self.root, unit):
                error = (f"Failed to stop {unit}: Unit {unit} not loaded." if verb == "stop" else
                         f"Failed to start {unit}: Unit {unit} not found.")
            else:
                if service is None:
                    service = services[unit] = {"active_state": "active", "sub_state": "running", "restarts": 0,
                                                "restart_times": []}
                service.setdefault("calls", []).append(verb)
                fault = take_fault(state, verb, unit)
                masked = file_state(self.root, unit, service) == "masked"
                if verb in ("mask", "unmask"):
                    service["masked"] = verb == "mask"
                elif verb in ("enable", "disable") and masked:
                    error = f"Unit file {unit} is masked."
                elif verb in ("enable", "disable"):
                    service["enablement"] = f"{verb}d"
                elif verb == "start" and masked:
                    error = f"Failed to start {unit}: Unit {unit} is masked."
                elif verb == "start" and _trigger_masked(self.root, unit, services):
                    error = "Job failed. See \"journalctl -xe\" for details."  # the path unit's refusal
                elif fault is not None:
                    error = (f"Job for {unit} failed because the control process exited with error code. "
                             f"See \"systemctl status {unit}\" and \"journalctl -xeu {unit}\" for details.")
                    if verb == "start":
                        service.update(active_state="failed", sub_state="failed", since=time.time(), ready=False)
                elif verb == "stop":
                    service.update(active_state="inactive", sub_state="dead", since=time.time(), ready=False)
                else:
                    service.update(active_state="active", sub_state="running", since=time.time(), ready=True,
                                   loaded=config_digests(self.root, unit))
        if error is not None:
            raise AgentError(f"systemctl {verb} {unit} failed: {error}; see journalctl -u {unit}")


class HostUnits:
    """Simulated GPUs on a root that is the running system bound elsewhere (GPU_AGENT_UNITS=host, for the
    booted e2e node): the container runtimes stay the simulator's (their restarts and the configs they
    loaded), every other unit is the running system's, through systemctl (`host`)."""

    def __init__(self, simulated: SimServices, host: ServiceControl) -> None:
        self.simulated = simulated
        self.host = host

    def _for(self, unit: str) -> ServiceControl:
        return self.simulated if unit in CONFIGS else self.host

    def state(self, unit: str) -> Optional[UnitState]:
        return self._for(unit).state(unit)

    def restart(self, unit: str) -> None:
        self._for(unit).restart(unit)

    def wait_ready(self, unit: str, socket_path: str, timeout: float,
                   progress: Callable[[str], None] = lambda waiting: None) -> Optional[str]:
        return self._for(unit).wait_ready(unit, socket_path, timeout, progress)
