"""Units stopped before a MIG change and started after it (dcgm, nvidia-persistenced, a device plugin),
the starts always run, failure included."""
from __future__ import annotations

from typing import Protocol, Sequence

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root


class UnitControl(Protocol):
    def __call__(self, verb: str, unit: str) -> None:
        """`systemctl VERB UNIT` (stop or start); AgentError when it fails."""


class Systemctl:
    def __init__(self, root: Root, timeout: float) -> None:
        self.root = root
        self.timeout = timeout

    def __call__(self, verb: str, unit: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"refusing to {verb} {unit} on this machine while --root is {self.root.path}")
        done = proc.run(["systemctl", verb, unit], timeout=self.timeout)
        if done.returncode != 0:
            raise AgentError(f"systemctl {verb} {unit} failed: {done.output}; see journalctl -u {unit}")


class Hooks:
    def __init__(self, units: Sequence[str], systemctl: UnitControl) -> None:
        self.units = tuple(units)
        self.systemctl = systemctl
        self.stopped: list[str] = []

    def before(self) -> None:
        for unit in self.units:
            self.stopped.append(unit)  # started again after, even if this stop fails half-way
            self.systemctl("stop", unit)

    def after(self) -> list[str]:
        """Start what was stopped (in reverse), every unit even when one fails; the failures, as messages."""
        failures = []
        for unit in reversed(self.stopped):
            try:
                self.systemctl("start", unit)
            except AgentError as exc:
                failures.append(str(exc))
        self.stopped.clear()
        return failures
