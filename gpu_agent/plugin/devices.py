"""What the device plugin advertises, computed from the state model alone: resources, their devices
(GPU or MIG UUIDs, `<uuid>::<n>` replicas when shared), each device's health and its GPU's NUMA node.

A pure function of its inputs, so that every strategy and sharing rule is tested without gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from gpu_agent.config.plugin import RESOURCE_PREFIX, PluginConfig, TimeSlicedResource
from gpu_agent.nvml.model import Gpu, GpuHealth, Inventory

GPU_RESOURCE = RESOURCE_PREFIX + "gpu"
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True)
class PluginDevice:
    id: str  # what kubelet sees: the GPU or MIG UUID, or `<uuid>::<n>` for a replica
    uuid: str  # the GPU or MIG device it gives: its CDI device name and NVIDIA_VISIBLE_DEVICES value
    gpu_uuid: str  # the GPU it is on
    gpu_index: int
    numa_node: Optional[int]  # its GPU's (discovery reads sysfs numa_node): the topology kubelet sees
    healthy: bool
    reason: str = ""  # why it is unhealthy


@dataclass(frozen=True)
class Resource:
    name: str  # nvidia.com/gpu, nvidia.com/mig-3g.40gb, nvidia.com/gpu.shared
    devices: tuple[PluginDevice, ...]
    replicas: int = 1  # the most replicas of one device; > 1: time-sliced

    @property
    def shared(self) -> bool:
        return self.replicas > 1

    @property
    def socket_name(self) -> str:
        """nvidia-gpu.sock, nvidia-mig-3g.40gb.sock: the resource name after nvidia.com/."""
        return f"nvidia-{self.name[len(RESOURCE_PREFIX):]}.sock"


@dataclass(frozen=True)
class Advertised:
    resources: dict[str, Resource] = field(default_factory=dict)
    withheld: dict[str, str] = field(default_factory=dict)  # resource name: why it is not advertised
    ignored: dict[str, str] = field(default_factory=dict)  # timeSlicing resource: why it shares nothing
    reason: str = ""  # why nothing is advertised at all


def mig_resource(profile: str) -> str:
    """nvidia.com/mig-1g.10gb+me -> nvidia.com/mig-1g.10gb.me, as NVIDIA's plugin names it."""
    return f"{RESOURCE_PREFIX}mig-{profile.replace('+', '.')}"


def base_id(device_id: str) -> str:
    """A replica's id without its `::n` suffix."""
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class _Base:
    resource: str
    uuid: str
    gpu: Gpu


def advertised(inventory: Optional[Inventory], health: Mapping[str, GpuHealth], strategy: str,
               settings: PluginConfig, unavailable: str = "") -> Advertised:
    """The resources to serve. `health`: by GPU UUID, and by MIG device UUID where the health model
    tracks a MIG device on its own; a MIG device is unhealthy when it or its GPU is.
    `unavailable`: why there is no inventory (NVML failing), for /status."""
    if inventory is None:
        return Advertised(reason=unavailable or "no GPU inventory yet (discovery has not succeeded)")
    if not inventory.gpus:
        return Advertised(reason="NVML reports no GPU on this node")
    bases, withheld = _bases(inventory, strategy)
    grouped: dict[str, list[PluginDevice]] = {}
    replicas_of: dict[str, int] = {}
    slicing = settings.sharing.time_slicing
    for base in bases:
        own, whole = health.get(base.uuid, GpuHealth()), health.get(base.gpu.uuid, GpuHealth())
        state = own if not own.healthy else whole
        replicas, entry = _replicas(base, settings)
        name = base.resource
        if replicas > 1:
            name = (entry.rename if entry and entry.rename else
                    f"{base.resource}.shared" if slicing.rename_by_default else base.resource)
        ids = [base.uuid] if replicas == 1 else [f"{base.uuid}{REPLICA_SEPARATOR}{n}" for n in range(replicas)]
        grouped.setdefault(name, []).extend(
            PluginDevice(device_id, base.uuid, base.gpu.uuid, base.gpu.index, base.gpu.numa_node, state.healthy,
                         state.reason) for device_id in ids)
        replicas_of[name] = max(replicas_of.get(name, 1), replicas)
    resources = {name: Resource(name, tuple(devices), replicas_of[name]) for name, devices in sorted(grouped.items())}
    ignored = ignored_sharing(bases, settings, strategy)
    if not resources and not withheld:
        return Advertised(ignored=ignored, reason=f"no device to advertise with mig.strategy {strategy}")
    return Advertised(resources, withheld, ignored, "" if resources else "; ".join(withheld.values()))


def ignored_sharing(bases: list[_Base], settings: PluginConfig, strategy: str) -> dict[str, str]:
    """The timeSlicing resources no device of the node is advertised as: NVIDIA's plugin skips them
    (internal/rm/device_map.go updateDeviceMapWithReplicas, "Skip any resources not matched") and GFD
    labels nothing for them (internal/lm/resource_test.go "time-slicing ignores non-matching resource")."""
    present = {base.resource for base in bases}
    return {entry.name: f"matches no device of this node with mig.strategy {strategy}: ignored, as NVIDIA's "
                        "plugin does" for entry in settings.sharing.time_slicing.resources if entry.name not in present}


def _bases(inventory: Inventory, strategy: str) -> tuple[list[_Base], dict[str, str]]:
    """The devices before sharing, by strategy, and the resources withheld with the reason."""
    gpus = inventory.gpus
    whole = [_Base(GPU_RESOURCE, gpu.uuid, gpu) for gpu in gpus]
    if strategy == "none":
        return whole, {}
    migs = [(gpu, device) for gpu in gpus if gpu.mig.enabled for device in gpu.mig.devices]
    if strategy == "single":
        if not any(gpu.mig.enabled for gpu in gpus):
            return whole, {}
        profiles = sorted({device.profile for _, device in migs})
        without = [str(gpu.index) for gpu in gpus if not (gpu.mig.enabled and gpu.mig.devices)]
        if without or len(profiles) != 1:
            why = (f"GPUs {', '.join(without)} have no MIG device" if without
                   else f"MIG devices of {len(profiles)} profiles ({', '.join(profiles)})")
            return [], {GPU_RESOURCE: f"mig.strategy single needs every GPU in MIG mode with MIG devices of one "
                                      f"profile, but {why}; use mig.strategy mixed or one profile throughout"}
        return [_Base(GPU_RESOURCE, device.uuid, gpu) for gpu, device in migs], {}
    # mixed: whole GPUs where MIG is off, one resource per MIG profile
    bases = [base for base in whole if not base.gpu.mig.enabled]
    bases += [_Base(mig_resource(device.profile), device.uuid, gpu) for gpu, device in migs]
    return bases, {}


def _replicas(base: _Base, settings: PluginConfig) -> tuple[int, Optional[TimeSlicedResource]]:
    """(replicas, the timeSlicing entry that shares it): per-GPU counts win over timeSlicing."""
    entry = next((entry for entry in settings.sharing.time_slicing.resources
                  if entry.name == base.resource and _selects(entry.devices, base)), None)
    for key in (str(base.gpu.index), base.gpu.uuid):
        if key in settings.gpu_replicas:
            return settings.gpu_replicas[key], entry
    return (entry.replicas if entry else 1), entry


def _selects(devices: Union[str, list[Union[int, str]]], base: _Base) -> bool:
    if devices == "all":
        return True
    return any(ref == base.gpu.index if isinstance(ref, int) else ref in (base.uuid, base.gpu.uuid)
               for ref in devices)


@dataclass(frozen=True)
class Shared:
    """How a resource is shared, for GFD's labels: <name>.replicas and <name>.sharing-strategy."""

    replicas: int  # the smallest count among its shared devices: a scheduler trusting it never over-counts
    renamed: bool  # advertised under another name (renameByDefault or rename)


def sharing(inventory: Optional[Inventory], strategy: str, settings: PluginConfig) -> dict[str, Shared]:
    """By resource name without nvidia.com/ (gpu, mig-3g.40gb): the time-shared ones."""
    if inventory is None:
        return {}
    counts: dict[str, list[int]] = {}
    renamed: dict[str, bool] = {}
    for base in _bases(inventory, strategy)[0]:
        replicas, entry = _replicas(base, settings)
        if replicas > 1:
            key = base.resource[len(RESOURCE_PREFIX):]
            counts.setdefault(key, []).append(replicas)
            renamed[key] = renamed.get(key, False) or bool(
                (entry and entry.rename) or settings.sharing.time_slicing.rename_by_default)
    return {key: Shared(min(values), renamed[key]) for key, values in counts.items()}
