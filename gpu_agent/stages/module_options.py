"""The options of loaded modules against driver.parameters: what the driver stage notes and what a reload
asked for with `gpu-agent driver reload` applies (the driver stage writes them to /etc/modprobe.d, where the
next load of the module reads them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from gpu_agent.host import devnodes
from gpu_agent.host.modules import KernelModules
from gpu_agent.host.paths import Root
from gpu_agent.numbers import decimal, hexadecimal

Options = Mapping[str, Mapping[str, Union[str, int]]]


@dataclass(frozen=True)
class Drift:
    module: str
    text: str  # `nvidia NVreg_EnableGpuFirmware is 0, configured 1`


def drift(root: Root, kernel: KernelModules, parameters: Options, loaded: Mapping[str, object]) -> list[Drift]:
    """The configured options a loaded module does not have (an option the module does not show is not known
    to differ)."""
    found = []
    for module, options in sorted(parameters.items()):
        if module not in loaded:
            continue
        for key, value in sorted(options.items()):
            current = _parameter(root, kernel, module, key)
            if current is not None and not same_value(current, value):
                found.append(Drift(module, f"{module} {key} is {current}, configured {value}"))
    return found


def _parameter(root: Root, kernel: KernelModules, module: str, key: str) -> Optional[str]:
    """A loaded module's parameter. The nvidia module keeps its NVreg_ ones out of sysfs: their live values
    are in /proc/driver/nvidia/params, without the prefix."""
    if module == "nvidia" and key.startswith("NVreg_"):
        return devnodes.driver_file(root, "/proc/driver/nvidia/params").get(key[len("NVreg_"):])
    return kernel.parameter(module, key)


def same_value(current: str, configured: object) -> bool:
    """1 and Y and 0x1 are the same to the kernel."""
    def normal(value: str) -> str:
        value = {"y": "1", "n": "0"}.get(value.lower(), value)
        number = hexadecimal(value) if value.strip().lower().startswith("0x") else decimal(value)
        return value if number is None else str(number)
    return normal(current) == normal(str(configured))
