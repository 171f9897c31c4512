"""The simulator's service manager: the container runtimes' units, their restarts, and the configs
they loaded; `gpu-agent sim fail restart` makes restarts fail, or the runtime not come back."""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.files import read_bytes
from gpu_agent.host.paths import Root
from gpu_agent.toolkit.distributions import DISTRIBUTIONS
from gpu_agent.toolkit.services import UnitState

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
_HISTORY = 200  # restart times kept per unit


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
        if service is None:
            return UnitState(unit, "not-found", "inactive", "dead", "")
        since = service.get("since")
        return UnitState(unit, "loaded", service.get("active_state", "active"), service.get("sub_state", "running"),
                         systemd_time(since) if since else "")

    def restart(self, unit: str) -> None:
        with self.machine.edit() as state:
            service = state.setdefault("services", {}).get(unit)
            if service is None:
                raise AgentError(f"systemctl restart {unit} failed: Unit {unit} not found.")
            service["restarts"] = service.get("restarts", 0) + 1
            service["restart_times"] = (service.get("restart_times", []) + [time.time()])[-_HISTORY:]
            fault = self._take_fault(state, unit)
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

    @staticmethod
    def _take_fault(state: dict[str, Any], unit: str) -> Optional[str]:
        for fault in state["faults"]:
            if fault["call"] == "restart" and fault.get("unit") in (None, unit) and (fault.get("times") or 1) > 0:
                if fault.get("times") is not None:
                    fault["times"] -= 1
                    if fault["times"] <= 0:
                        state["faults"].remove(fault)
                return fault["error"]
        return None
