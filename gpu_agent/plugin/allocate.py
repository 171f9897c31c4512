"""Allocate's answer for one container: the devices named as the runtime expects them, or a refusal
that names the device and the reason."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import AbstractSet, Optional, Sequence

from gpu_agent.config.section import shown
from gpu_agent.mps.layout import client_envs, client_mounts
from gpu_agent.plugin.devices import Resource, base_id
from gpu_agent.toolkit.cdi import KIND as CDI_KIND

CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


class AllocationError(Exception):
    """A request the plugin refuses; the message goes back to the kubelet (and the pod's events)."""


@dataclass(frozen=True)
class ContainerAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()  # (container path, host path)


def allocate(resource: Resource, requested: Sequence[str], strategy: str,
             fail_requests_greater_than_one: bool, spec: Optional[AbstractSet[str]] = None) -> ContainerAllocation:
    """What the container gets for `requested` device ids of `resource` under `strategy`
    (cdi-cri, cdi-annotations or envvar; "" while plugin.device_list_strategy auto has not chosen).
    `spec`: the CDI device names the agent's spec holds, where the agent writes it (None: not its spec)."""
    if strategy not in ("cdi-cri", "cdi-annotations", "envvar"):
        raise AllocationError("plugin.device_list_strategy is auto and no device path is chosen yet (see the "
                              "device-path stage in `gpu-agent status`)")
    if not requested:
        raise AllocationError(f"empty request for {resource.name}")
    devices = {device.id: device for device in resource.devices}
    for device_id in requested:
        device = devices.get(device_id)
        if device is None:
            raise AllocationError(f"unknown device {shown(device_id, 100)} for {resource.name}: this node advertises "
                                  "no such device (a stale id after a MIG change or GPU replacement?)")
    replicas = any(devices[device_id].id != devices[device_id].uuid for device_id in requested)
    if fail_requests_greater_than_one and replicas and len(requested) > 1:
        # NVIDIA's wording (v0.20), so that existing alerts on it keep matching
        raise AllocationError(f'invalid allocation request for "{resource.name}": invalid request: maximum request '
                              f"size for shared resources is 1; found {len(requested)}")
    for device_id in requested:
        device = devices[device_id]
        if not device.healthy:
            raise AllocationError(f"device {device_id} of {resource.name} (GPU {device.gpu_index}) is unhealthy: "
                                  f"{device.reason or 'see gpu-agent status'}")
    uuids = tuple(dict.fromkeys(base_id(device_id) for device_id in requested))  # replicas share their GPU
    names = tuple(f"{CDI_KIND}={uuid}" for uuid in uuids)
    missing = [name for name in names if spec is not None and name not in spec]
    if strategy != "envvar" and missing:
        raise AllocationError(f"the CDI spec holds no {missing[0]} (see the cdi stage in `gpu-agent status`): "
                              "a container runtime could not apply it")
    # MPS: its client environment and mounts under every list strategy, as NVIDIA's plugin adds them
    envs = client_envs(resource.name) if resource.strategy == "mps" else {}
    mounts = client_mounts(resource.name) if resource.strategy == "mps" else ()
    if strategy == "cdi-cri":
        return ContainerAllocation(envs=envs, cdi_devices=names, mounts=mounts)
    if strategy == "cdi-annotations":
        return ContainerAllocation(envs=envs, annotations={annotation_key(requested): ",".join(names)}, mounts=mounts)
    return ContainerAllocation(envs={**envs, VISIBLE_DEVICES: ",".join(uuids)}, mounts=mounts)


def annotation_key(requested: Sequence[str]) -> str:
    """cdi.k8s.io/gpu-agent_<id>, unique per request as the CDI annotation format asks (plugin name,
    '_', a device id; at most 63 characters after the prefix)."""
    digest = hashlib.sha256("\0".join(requested).encode()).hexdigest()[:16]
    return f"{CDI_ANNOTATION_PREFIX}gpu-agent_{digest}"
