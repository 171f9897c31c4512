"""GPU discovery: what NVML sees, published for every other stage and output. Changes nothing."""
from __future__ import annotations

from typing import Any

from gpu_agent.config.schema import DiscoveryConfig
from gpu_agent.errors import StageError
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlUnavailable, describe
from gpu_agent.nvml.model import Inventory
from gpu_agent.stages.base import Stage


class Discovery(Stage):
    name = "discovery"
    produces = ("inventory",)
    consumes = ("workload",)  # the vfio stage's: GPUs passed through to VMs are outside NVML

    def __init__(self, nvml: Nvml, settings: DiscoveryConfig) -> None:
        self.nvml = nvml
        self.settings = settings

    def observe(self) -> Inventory:
        try:
            return self.nvml.inventory.pass_reading()  # the mig stage's reading of this pass, if nothing changed since
        except NvmlUnavailable as exc:
            if exc.no_driver:
                raise StageError(f"no NVIDIA GPU was found: {exc}") from None
            raise StageError(str(exc)) from None
        except self.nvml.lib.NVMLError as exc:
            raise StageError(f"NVML query failed: {describe(exc)}") from None

    def outputs(self, inventory: Inventory) -> dict[str, Any]:
        return {"inventory": inventory}

    def verify(self, inventory: Inventory) -> str:
        """A GPU NVML cannot read (off the bus, its queries failing) is in the inventory as what is known of it,
        and noted here: it is gpu-health's to judge, and the other GPUs are served as ever."""
        found = inventory.count
        workload = self.inputs.get("workload")
        passed = workload.vm_gpus() if workload is not None else ()
        if found == 0 and workload is not None and passed and len(passed) == len(workload.gpus):
            return f"no GPU serves containers: all {len(passed)} NVIDIA GPUs are passed through to VMs"
        if found == 0:
            raise StageError(
                f"no NVIDIA GPU was found: driver {inventory.driver_version} is loaded but NVML reports no GPU"
            )
        expected = self.settings.expected_gpus
        if expected is not None and found != expected:
            seen = ", ".join(gpu.pci_bus_id for gpu in inventory.gpus)
            raise StageError(
                f"expected {expected} GPUs (discovery.expected_gpus) but NVML reports {found}: {seen}; "
                "a missing GPU has usually fallen off the bus (check dmesg for XID 79)"
            )
        notes = inventory.unreadable_notes()
        return inventory.summary() + "".join(f"; {note} (gpu-health reports it)" for note in notes)
