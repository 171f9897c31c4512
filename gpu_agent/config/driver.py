"""The driver section of the config: which NVIDIA modules to load, with which options."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from gpu_agent.config.mig import Unit
from gpu_agent.config.section import Check, Section, seconds, setting, shown

KNOWN_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_peermem", "nvidia_fs", "gdrdrv", "nvidia_drm")
_PARAMETER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_VALUE = re.compile(r"[^\s#]{1,4096}")


@dataclass(frozen=True)
class DriverModules(Section):
    """Feature modules beyond nvidia and nvidia_uvm, which every GPU node needs. A feature module that
    cannot be loaded degrades the agent; it does not make the GPUs unready."""

    nvidia_modeset: Union[bool, Literal["auto"]] = setting(
        "auto", "Display mode setting; auto: only when nvidia_drm is on (it needs it).")
    nvidia_peermem: Union[bool, Literal["auto"]] = setting(
        "auto", "GPUDirect RDMA; auto: only when a Mellanox (0x15b3) NIC is present.")
    nvidia_fs: bool = setting(False, "GPUDirect Storage.")
    gdrdrv: bool = setting(False, "GDRCopy.")
    nvidia_drm: bool = setting(False, "Off by default: it blocks the GPU resets MIG changes need.")


def _parameters(value: dict[str, dict[str, Union[str, int]]]) -> dict[str, dict[str, Union[str, int]]]:
    for module, options in value.items():
        if module not in KNOWN_MODULES:
            raise ValueError(f"unknown module {shown(module)}; one of {', '.join(KNOWN_MODULES)}")
        for name, setting_ in options.items():
            if not _PARAMETER.fullmatch(name):
                raise ValueError(f"{module}: {shown(name)} is not a module parameter name")
            if not _VALUE.fullmatch(str(setting_)):
                raise ValueError(f"{module}.{name}: {shown(setting_)} cannot be written to modprobe.d")
    return value


@dataclass(frozen=True)
class DriverConfig(Section):
    enabled: bool = setting(True, "Load, verify and repair the NVIDIA kernel driver.")
    version: Optional[str] = setting(None, 'Pin, e.g. "550.90.07": any other loaded version fails.', max_length=64)
    blacklist_nouveau: bool = setting(False, "Write /etc/modprobe.d/blacklist-nouveau.conf.")
    modules: DriverModules = setting(DriverModules())
    parameters: Annotated[dict[str, dict[str, Union[str, int]]], Check(_parameters)] = setting(
        {}, "Module options written to /etc/modprobe.d/gpu-agent-<module>.conf, "
        "e.g. {nvidia: {NVreg_EnableGpuFirmware: 0}}.")
    persistence: bool = setting(False, "Require nvidia-persistenced or persistence mode; "
                                           "turn persistence mode on when neither.")
    validate_cuda: bool = setting(False, "Create a CUDA context and allocate memory on each GPU.")
    modprobe_timeout_seconds: float = seconds(60, 3600, "How long one modprobe may take.")
    reload: Literal["never", "when-idle"] = setting(
        "never", "When the installed driver is not the loaded one: never (report it, the default), or when-idle: "
        "cordon, wait until no pod or process uses a GPU, unload and load the driver, uncordon.")
    reload_wait_seconds: float = seconds(3600, 7 * 86400, "How long a reload waits for the GPUs to be idle "
                                         "before it fails (and is tried again with backoff).")
    reload_units: list[Unit] = setting(
        ["nvidia-persistenced.service", "nvidia-fabricmanager.service", "nvidia-dcgm.service", "dcgm.service"],
        "Units that hold the driver: stopped (those running) before the unload, started after the load.",
        max_length=32)

