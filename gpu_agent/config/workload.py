"""The workload section: which GPUs serve containers and which are passed through to virtual machines (VFIO)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from gpu_agent.config.section import Bounds, Check, Section, setting, shown

CONTAINER = "container"
VM_PASSTHROUGH = "vm-passthrough"
VM_VGPU = "vm-vgpu"
MODES = (CONTAINER, VM_PASSTHROUGH)
MAX_GPU_ENTRIES = 1024
VGPU_REFUSED = (f"{VM_VGPU} needs NVIDIA's licensed vGPU manager (the host driver that splits a GPU into vGPUs, "
                "which the GPU Operator deploys as its vgpu-manager), which gpu-agent does not install or run: use "
                f"{VM_PASSTHROUGH} (a whole GPU per VM) or {CONTAINER}")
_INDEX = re.compile(r"[0-9]{1,4}")
_UUID = re.compile(r"GPU-[0-9a-fA-F-]{36}")
_BUS_ID = re.compile(r"(?:[0-9A-Fa-f]{1,8}:)?[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7]")


def _mode(value: str) -> str:
    if value == VM_VGPU:
        raise ValueError(VGPU_REFUSED)
    return value


def _gpu_key(value: str) -> str:
    if not (_INDEX.fullmatch(value) or _UUID.fullmatch(value) or _BUS_ID.fullmatch(value)):
        raise ValueError(f"{shown(value)} names no GPU: expected its index (\"4\"), its UUID (GPU-...) or its PCI bus "
                         "id (0000:9a:00.0)")
    return value


Mode = Annotated[Literal["container", "vm-passthrough", "vm-vgpu"], Check(_mode)]
GpuKey = Annotated[str, Bounds(max_length=64), Check(_gpu_key)]


@dataclass(frozen=True)
class WorkloadConfig(Section):
    mode: Mode = setting(
        CONTAINER, "What the node's GPUs serve: container (the nvidia driver, the device plugin's nvidia.com/gpu) or "
                   "vm-passthrough (bound to vfio-pci, served to KubeVirt as nvidia.com/<PCI device name>). vm-vgpu "
                   "is refused: it needs NVIDIA's licensed vGPU manager.")
    gpus: dict[GpuKey, Mode] = setting(
        {}, "Per GPU, by index (its place among the node's NVIDIA GPUs in PCI order), UUID or PCI bus id: its mode, "
            "instead of mode.", max_length=MAX_GPU_ENTRIES)
    follow_node_label: bool = setting(
        True, "The GPU Operator's node label nvidia.com/gpu.workload.config, when set, is the node's mode instead of "
              "mode (the entries of gpus still win for their GPUs).")
