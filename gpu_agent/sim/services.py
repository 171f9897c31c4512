"""The simulator's service manager: records restarts, fails them on request."""
from __future__ import annotations

from typing import Any, Optional

from gpu_agent.errors import AgentError

class SimServices:
    """Records restarts in the simulated machine; `gpu-agent sim fail restart --unit U --error
    failed|not-ready` makes the next restarts fail, or the runtime not come back."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def active(self, unit: str) -> bool:
        return self.machine.read().get("services", {}).get(unit, {}).get("active", True)

    def restart(self, unit: str) -> None:
        with self.machine.edit() as state:
            service = state.setdefault("services", {}).setdefault(unit, {"active": True, "restarts": 0})
            service["restarts"] += 1
            fault = self._take_fault(state, unit)
            service["active"] = fault != "failed"
            service["ready"] = fault is None
        if fault == "failed":
            raise AgentError(f"systemctl restart {unit} failed: Job for {unit} failed because the control "
                             f"process exited with error code; see journalctl -u {unit}")

    def wait_ready(self, unit: str, socket_path: str, timeout: float) -> Optional[str]:
        service = self.machine.read().get("services", {}).get(unit, {})
        if service.get("ready", True):
            return None
        return f"no answer on {socket_path} within {timeout:g} s (Connection refused)"

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
