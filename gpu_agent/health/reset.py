"""A GPU reset clears what XIDs said about that GPU: it recovers at once, not after
health.recover_after_seconds. Wraps whichever GpuReset the composition root built."""
from __future__ import annotations

import logging

from gpu_agent.health.policy import after_reset
from typing import Optional

from gpu_agent.mig.reset import GpuReset, ResetImpossible
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)


class ResetHealsGpu:
    def __init__(self, reset: GpuReset, state: AgentState) -> None:
        self.inner = reset
        self.state = state

    def blocker(self, index: int, bus_id: str) -> Optional[ResetImpossible]:
        return self.inner.blocker(index, bus_id)

    def reset(self, index: int, bus_id: str) -> None:
        self.inner.reset(index, bus_id)  # ResetImpossible: nothing happened, nothing to heal
        inventory = self.state.inventory or self.state.last_inventory
        gpu = next((g for g in inventory.gpus if g.pci_bus_id == bus_id), None) if inventory else None
        if gpu is None:
            return
        for uuid in (gpu.uuid, *(device.uuid for device in gpu.mig.devices)):
            before = self.state.health.get(uuid)
            if before is None or not before.xid_reason:
                continue
            after = self.state.update_health(uuid, after_reset)
            if after.xid_reason:
                log.info("%s was reset; it is healthy again once NVML answers for it at %s",
                         self.state.gpu_name(uuid), bus_id)
            else:
                log.info("%s was reset; healthy again as far as XIDs go", self.state.gpu_name(uuid))
