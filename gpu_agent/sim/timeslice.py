"""A GPU's compute time-slice on the simulated machine, as `nvidia-smi compute-policy --set-timeslice` sets
it: kept per GPU (`timeslice`, absent for Default) until the driver is reloaded or the machine reboots."""
from __future__ import annotations

from typing import Any

from gpu_agent.errors import AgentError


class SimTimeSlices:
    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def set_timeslice(self, uuid: str, level: int) -> None:
        if level not in range(4):
            raise AgentError(f"nvidia-smi compute-policy: invalid time-slice {level}")
        with self.machine.edit() as state:
            index = next((i for i, gpu in enumerate(state["gpus"]) if gpu["uuid"] == uuid), None)
            if index is None or index in state.get("lost_gpus", ()):
                raise AgentError(f"nvidia-smi compute-policy -i {uuid}: No devices were found")
            if level:
                state["gpus"][index]["timeslice"] = level
            else:
                state["gpus"][index].pop("timeslice", None)
