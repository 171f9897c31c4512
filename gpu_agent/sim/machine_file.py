"""The schema of a simulated machine file (`--simulate machine.yaml`), validated by pydantic: imported
only when such a file is loaded (sim/machine.py load_machine_file), so a built-in profile needs no pydantic."""
from __future__ import annotations

import re
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpu_agent.numbers import decimal


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
    audio: bool = Field(False, description="each GPU has an HD audio function beside it (function 1, its IOMMU group)")


# The driver's version names files (libcuda.so.550.90.07, the modules' modinfo): digits and dots only.
DRIVER_VERSION = re.compile(r"[0-9]{1,4}(?:\.[0-9]{1,4}){1,3}")
MAX_CUDA_PART = 99


class MachineSpec(_Spec):
    name: str = Field("custom", max_length=64)
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

    @field_validator("driver_version")
    @classmethod
    def _driver_version(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and DRIVER_VERSION.fullmatch(value) is None:
            raise ValueError("expected a driver version such as 550.90.07: up to four numbers of at most "
                             "four digits, separated by dots")
        return value

    @field_validator("cuda_version")
    @classmethod
    def _cuda_version(cls, value: str) -> str:
        major, dot, minor = value.partition(".")
        if not dot or decimal(major, MAX_CUDA_PART) is None or decimal(minor, MAX_CUDA_PART) is None:
            raise ValueError(f"expected MAJOR.MINOR such as 12.4, each at most {MAX_CUDA_PART}")
        return value

    @property
    def cuda(self) -> int:
        """The CUDA version as NVML's nvmlSystemGetCudaDriverVersion answers it: 12040 for 12.4."""
        major, _, minor = self.cuda_version.partition(".")
        return int(major) * 1000 + int(minor) * 10
