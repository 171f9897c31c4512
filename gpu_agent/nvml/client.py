"""The agent's NVML: one session (initialisation, timed calls, batches) and a view of it per concern.

A caller uses the concern it needs: `inventory` (which GPUs, their identity, topology and the driver's
view), `mig` (profiles, instances and their changes), `sampling` and `gpm` (metrics), `events` (XID
event sets) and `health` (the periodic checks' readings)."""
from __future__ import annotations

from typing import Any, Optional

from gpu_agent.host.paths import Root
from gpu_agent.nvml.events import NvmlEvents
from gpu_agent.nvml.gpm import NvmlGpm
from gpu_agent.nvml.health import NvmlHealth
from gpu_agent.nvml.inventory import NvmlInventory
from gpu_agent.nvml.mig import NvmlMig
from gpu_agent.nvml.sampling import NvmlSampling
from gpu_agent.nvml.session import NvmlSession


class Nvml:
    def __init__(self, lib: Any, call_timeout: float = 5.0, root: Optional[Root] = None) -> None:
        """`root`: where the GPUs' NUMA nodes, PCI classes and config space are read (sysfs); without it
        they are unknown."""
        self.lib = lib
        self.session = NvmlSession(lib, call_timeout)
        self.mig = NvmlMig(self.session)
        self.inventory = NvmlInventory(self.session, self.mig, root)
        self.sampling = NvmlSampling(self.session)
        self.gpm = NvmlGpm(self.session)
        self.events = NvmlEvents(self.session)
        self.health = NvmlHealth(self.session)

    def close(self) -> None:
        self.session.close()
