"""The schema of a simulated machine file (`--simulate machine.yaml`), validated by pydantic: imported
only when such a file is loaded (sim/machine.py load_machine_file), so a built-in profile needs no pydantic."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


# GPU minors are 0, 1, ...; the driver keeps 254 for nvidia-modeset and 255 for nvidiactl.
MAX_GPUS = 254


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MigSpec(_Spec):
    enabled: bool = False
    devices: list[str] = Field(default_factory=list, description="MIG devices (3g.40gb, 1c.3g.40gb), placed first-fit")


class GpuSpec(_Spec):
    model: str
    count: int = Field(1, ge=1, le=MAX_GPUS)
    pci_bus_ids: Optional[list[str]] = None
    mig: MigSpec = MigSpec()
    numa_node: Optional[int] = Field(None, ge=0, lt=1024, description="the CPU NUMA node these GPUs hang off")
    pcie_switch: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
        description="the PCIe switches above these GPUs, from the root port down: `sw0`, or `sw0/sw0.1`")


class MachineSpec(_Spec):
    name: str = "custom"
    driver_version: Optional[str] = "550.90.07"
    cuda_version: str = "12.4"
    gpus: list[GpuSpec] = Field(default_factory=list)
    nvswitches: int = Field(0, ge=0, le=32, description="NVSwitches, on buses c0 to df")
    nvlinks: int = Field(0, ge=0, le=18, description="NVLinks from each GPU into the NVSwitches (all-to-all)")
    mellanox_nics: int = Field(0, ge=0, le=32, description="ConnectX NICs, for GPUDirect RDMA (nvidia_peermem), "
                                                           "on buses e0 to ff")
    nouveau: bool = Field(False, description="the distribution loaded nouveau at boot")
    product_name: str = Field("Standard PC", description="DMI product name (the gpu.machine label)")
    passthrough: bool = Field(False, description="a VM with its GPUs passed through: it cannot reset them")
