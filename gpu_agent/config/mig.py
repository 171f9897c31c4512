"""The mig section: which MIG geometry the agent keeps on this node's GPUs."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Optional


from gpu_agent.config.section import AbsolutePath, Bounds, Check, Section, seconds, setting, shown

_UNIT = re.compile(r"[A-Za-z0-9:_.@\\-]+\.(service|socket|target)")


def _unit_name(value: str) -> str:
    if not _UNIT.fullmatch(value):
        raise ValueError(f"{shown(value)} is not a systemd unit name such as nvidia-dcgm.service")
    return value


Unit = Annotated[str, Bounds(max_length=256), Check(_unit_name)]


@dataclass(frozen=True)
class MigConfig(Section):
    config: Optional[str] = setting(
        None, "Name of the mig-configs entry of config_file to apply, e.g. all-balanced; "
              "null leaves MIG geometry alone.", min_length=1, max_length=253)
    config_file: AbsolutePath = setting("/etc/gpu-agent/mig.yaml", "A mig-parted version v1 file.")
    follow_node_label: bool = setting(
        False, "The node label nvidia.com/mig.config, when set, names the config instead "
               "(as with k8s-mig-manager).")
    force: bool = setting(
        False, "Change a GPU's MIG geometry even while compute processes run on it (NVML still "
               "refuses to destroy an instance a process uses).")
    stop_units: list[Unit] = setting(
        [], "systemd units stopped before a MIG change and started after it, e.g. nvidia-dcgm.service.",
        max_length=32)
    strategy: Optional[Literal["none", "single", "mixed"]] = setting(
        None, "How MIG devices are advertised, as GPU Feature Discovery and NVIDIA's device plugin "
              "mean it: none, single or mixed; read by the labels and the device plugin. Default none.")
    reset_timeout_seconds: float = seconds(60, 600, "How long one GPU reset (nvidia-smi --gpu-reset) may take.")
