"""Service control for the container runtimes: systemd."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root

_POLL_S = 0.2
# The units systemd/gpu-agent.service orders after itself (Before=): they start once its first pass is
# done. k3s and RKE2 run their containerd in that same unit, which the toolkit stage restarts.
ORDERED_AFTER_AGENT = ("kubelet.service", "k3s.service", "k3s-agent.service", "rke2-server.service",
                       "rke2-agent.service", "snap.microk8s.daemon-kubelite.service")
_PROGRESS_S = 1.0


def _quiet(doing: str) -> None:
    pass


@dataclass(frozen=True)
class UnitState:
    """A unit as `systemctl show` describes it."""

    unit: str
    load: str  # LoadState: loaded, not-found, masked, ...
    active: str  # ActiveState: active, reloading, inactive, failed, activating, deactivating
    sub: str  # SubState: running, dead, failed, auto-restart, start, ...
    since: str  # StateChangeTimestamp as systemd prints it; "" when unknown
    file_state: str = ""  # UnitFileState: enabled, disabled, static, masked, ...; "" when unknown

    @property
    def exists(self) -> bool:
        return self.load == "loaded"

    @property
    def running(self) -> bool:
        return self.active in ("active", "reloading")

    @property
    def stopped(self) -> bool:
        """Stopped cleanly (by an administrator, or never started), as opposed to failed or in transition."""
        return self.active == "inactive"

    def describe(self) -> str:
        """`containerd.service is failed (since Mon 2025-01-06 10:00:00 UTC)`"""
        details = [self.sub] if self.sub not in ("", self.active) else []
        details += [f"since {self.since}"] if self.since else []
        return f"{self.unit} is {self.active}" + (f" ({', '.join(details)})" if details else "")


class ServiceControl(Protocol):
    def state(self, unit: str) -> Optional[UnitState]:
        """The unit's state; None where no service manager runs the root's units (a sandbox root)."""

    def restart(self, unit: str) -> None:
        """Restart the unit; raise AgentError when systemd reports a failure."""

    def wait_ready(self, unit: str, socket_path: str, timeout: float,
                   progress: Callable[[str], None] = _quiet) -> Optional[str]:
        """None once the runtime answers on its socket, else what went wrong; `progress` hears, about
        once a second, how long it has not answered and why."""


class Systemd:
    def __init__(self, root: Root, timeout: float) -> None:
        self.root = root
        self.timeout = timeout

    def state(self, unit: str) -> Optional[UnitState]:
        if not self.root.is_running_system:
            return None  # a sandbox root has no running services of its own
        done = proc.run(["systemctl", "show", "-p", SHOW_PROPERTIES, unit], timeout=self.timeout)
        if done.returncode != 0:
            raise AgentError(f"systemctl show {unit} failed: {done.output or f'exit status {done.returncode}'}")
        return parse_show(unit, done.stdout)

    def restart(self, unit: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"refusing to restart {unit} on this machine while --root is {self.root.path}")
        done = proc.run(restart_argv(unit), timeout=self.timeout)
        if done.returncode != 0:
            raise AgentError(f"systemctl restart {unit} failed: {done.output}; see journalctl -u {unit}")

    def wait_ready(self, unit: str, socket_path: str, timeout: float,
                   progress: Callable[[str], None] = _quiet) -> Optional[str]:
        return wait_for_socket(str(self.root(socket_path)), socket_path, timeout, progress)


def restart_argv(unit: str) -> list[str]:
    """`systemctl restart unit`; for a unit ordered after the agent, with its job's dependencies ignored.

    Until the agent's first pass is done its own start job runs, and a restart job of a unit ordered after
    it waits for that job: `systemctl restart k3s` from the first pass would wait for the pass itself, until
    TimeoutStartSec. Only a unit that has run (running, failed or in transition: its dependencies were met
    when it started) is restarted at all; one not started yet is left to start after the agent, and reads
    the new files then (transaction.RuntimeChange.restarts_unit)."""
    if unit in ORDERED_AFTER_AGENT:
        return ["systemctl", "restart", "--job-mode=ignore-dependencies", unit]
    return ["systemctl", "restart", unit]


SHOW_PROPERTIES = "LoadState,ActiveState,SubState,StateChangeTimestamp,ActiveEnterTimestamp,UnitFileState"


def parse_show(unit: str, text: str) -> UnitState:
    """`systemctl show -p ...` output: one Key=Value a line, in systemd's order, empty values for unset
    timestamps. For a unit that is not active, the time it entered its state (StateChangeTimestamp)
    says more than when it last became active (ActiveEnterTimestamp)."""
    values = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
    active = values.get("ActiveState", "").strip() or "unknown"
    since = values.get("StateChangeTimestamp", "").strip()
    if not since and active == "active":  # a systemd without StateChangeTimestamp
        since = values.get("ActiveEnterTimestamp", "").strip()
    return UnitState(unit, values.get("LoadState", "").strip() or "unknown", active,
                     values.get("SubState", "").strip(), "" if since == "n/a" else since,
                     values.get("UnitFileState", "").strip())


def wait_for_socket(path: str, name: str, timeout: float, progress: Callable[[str], None] = _quiet) -> Optional[str]:
    started = time.monotonic()
    deadline = started + timeout
    last, told = "no attempt", started
    while time.monotonic() < deadline:
        if time.monotonic() - told >= _PROGRESS_S:
            told = time.monotonic()
            progress(f"no answer on {name} for {told - started:.0f} s ({last})")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                return None
            except OSError as exc:
                last = exc.strerror or str(exc)
        time.sleep(_POLL_S)
    return f"no answer on {name} within {timeout:g} s ({last})"
