"""What the device plugin advertises, computed from the state model alone: resources, their devices
(GPU or MIG UUIDs, `<uuid>::<n>` replicas when shared), each device's health and its GPU's NUMA node.

A pure function of its inputs, so that every strategy and sharing rule is tested without gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Union

from gpu_agent.config.plugin import RESOURCE_PREFIX, PluginConfig, ReplicatedResource, default_rename
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
    replicas: int = 1  # the most replicas of one device; > 1: shared
    strategy: str = "none"  # how its shared devices are shared: time-slicing or mps
    groups: tuple[tuple[str, Optional[str]], ...] = ()  # the VM path's: each device's PCI address and IOMMU group

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
    mig_index: Optional[int] = None  # its position among its GPU's MIG devices


def advertised(inventory: Optional[Inventory], health: Mapping[str, GpuHealth], strategy: str,
               settings: PluginConfig, unavailable: str = "", mps_down: Mapping[str, str] = {},
               mps_running: Optional[Collection[str]] = None) -> Advertised:
    """The resources to serve. `health`: by GPU UUID, and by MIG device UUID where the health model
    tracks a MIG device on its own; a MIG device is unhealthy when it or its GPU is.
    `unavailable`: why there is no inventory (NVML failing), for /status. `mps_down`: by resource name,
    why its MPS control daemon does not run as asked. `mps_running`: the resources whose daemon runs as
    asked: an MPS resource's devices are healthy only then (None: the devices alone, for a caller that
    wants what is advertised, not whether it is healthy)."""
    if inventory is None:
        return Advertised(reason=unavailable or "no GPU inventory yet (discovery has not succeeded)")
    if not inventory.gpus:
        return Advertised(reason="NVML reports no GPU on this node")
    bases, withheld = _bases(inventory, strategy)
    plan, refused = _sharing_plan(bases, settings)
    grouped: dict[str, list[PluginDevice]] = {}
    replicas_of: dict[str, int] = {}
    how: dict[str, str] = {}
    for base in bases:
        if base.resource in refused:
            withheld[base.resource] = refused[base.resource]
            continue
        own, whole = health.get(base.uuid, GpuHealth()), health.get(base.gpu.uuid, GpuHealth())
        state = own if not own.healthy else whole
        replicas, name = plan.get(base.uuid, (1, base.resource))
        healthy, reason = state.healthy, state.reason
        shared_by = "none" if replicas == 1 else "mps" if settings.sharing.strategy == "mps" else "time-slicing"
        if shared_by == "mps" and healthy and (name in mps_down or (mps_running is not None
                                                                     and name not in mps_running)):
            healthy, reason = False, mps_down.get(name, "its MPS control daemon is not running yet")
        ids = [base.uuid] if replicas == 1 else [f"{base.uuid}{REPLICA_SEPARATOR}{n}" for n in range(replicas)]
        grouped.setdefault(name, []).extend(
            PluginDevice(device_id, base.uuid, base.gpu.uuid, base.gpu.index, base.gpu.numa_node, healthy, reason)
            for device_id in ids)
        replicas_of[name] = max(replicas_of.get(name, 1), replicas)
        if shared_by != "none":
            how[name] = shared_by
    resources = {name: Resource(name, tuple(devices), replicas_of[name], how.get(name, "none"))
                 for name, devices in sorted(grouped.items())}
    ignored = ignored_sharing(bases, settings, strategy)
    if not resources and not withheld:
        return Advertised(ignored=ignored, reason=f"no device to advertise with mig.strategy {strategy}")
    return Advertised(resources, withheld, ignored, "" if resources else "; ".join(withheld.values()))


def ignored_sharing(bases: list[_Base], settings: PluginConfig, strategy: str) -> dict[str, str]:
    """The timeSlicing or mps resources no device of the node is advertised as: NVIDIA's plugin skips them
    (internal/rm/device_map.go, updateDeviceMapWithReplicas passes over a resource that matches no device)
    and GFD labels nothing for them (internal/lm/resource_test.go, test case "time-slicing ignores
    non-matching resource")."""
    present = {base.resource for base in bases}
    chosen = settings.sharing.replicated
    return {entry.name: f"matches no device of this node with mig.strategy {strategy}: ignored, as NVIDIA's "
                        "plugin does" for entry in (chosen.resources if chosen else ()) if entry.name not in present}


def _bases(inventory: Inventory, strategy: str) -> tuple[list[_Base], dict[str, str]]:
    """The devices before sharing, by strategy, and the resources withheld with the reason. A GPU NVML cannot
    read is there as last read (Unhealthy by its health); one whose MIG state is unknown (known by its identity
    alone) only as a whole GPU, where MIG plays no part (mig.strategy none)."""
    gpus = inventory.gpus if strategy == "none" else tuple(gpu for gpu in inventory.gpus if gpu.details_known)
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
        return [_Base(GPU_RESOURCE, device.uuid, gpu, gpu.mig.devices.index(device)) for gpu, device in migs], {}
    # mixed: whole GPUs where MIG is off, one resource per MIG profile
    bases = [base for base in whole if not base.gpu.mig.enabled]
    bases += [_Base(mig_resource(device.profile), device.uuid, gpu, gpu.mig.devices.index(device))
              for gpu, device in migs]
    return bases, {}


def _sharing_plan(bases: list[_Base], settings: PluginConfig) -> tuple[dict[str, tuple[int, str]], dict[str, str]]:
    """By base UUID, (replicas, the name it is advertised under) for each shared device; and the resources
    refused, with the reason (MPS on MIG devices, as NVIDIA's plugin refuses it). Per-GPU counts win over
    the sharing block. A sharing resource that matches no device is ignored, as NVIDIA's plugin does."""
    sharing, plan, refused = settings.sharing, {}, {}
    chosen = sharing.replicated
    extended = settings.per_resource_sharing
    for n, entry in enumerate(chosen.resources if chosen else ()):
        matching = [base for base in bases if base.resource == entry.name]
        if sharing.strategy == "mps" and any(base.mig_index is not None for base in matching):
            refused[entry.name] = (f"plugin.sharing.mps.resources.{n}: sharing using MPS is not supported for MIG "
                                   f"devices ({entry.name} is MIG devices under mig.strategy single)")
            continue
        selected, problem = _selected(entry, matching) if extended else (matching, "")
        if problem:
            refused[entry.name] = f"plugin.sharing.{_key(sharing.strategy)}.resources.{n}.devices: {problem}"
            continue
        for base in selected:
            plan[base.uuid] = (entry.replicas, shared_name(entry, settings))
    for base in bases:
        for key in (str(base.gpu.index), base.gpu.uuid):
            if key in settings.gpu_replicas:
                count = settings.gpu_replicas[key]
                renamed = default_rename(base.resource, bool(chosen and chosen.rename_by_default)) or base.resource
                rename = plan.get(base.uuid, (1, renamed))[1]
                plan[base.uuid] = (count, rename if count > 1 else base.resource)
                break
    return plan, refused


def shared_name(entry: ReplicatedResource, settings: PluginConfig) -> str:
    """The name `entry`'s shared devices are advertised under: its rename (plugin.per_resource_sharing
    only), <name>.shared under renameByDefault, else its name."""
    chosen = settings.sharing.replicated
    rename = entry.rename if settings.per_resource_sharing else None
    return rename or default_rename(entry.name, chosen.rename_by_default if chosen else False) or entry.name


def _key(strategy: str) -> str:
    return "mps" if strategy == "mps" else "timeSlicing"


def _selected(entry: ReplicatedResource, matching: list[_Base]) -> tuple[list[_Base], str]:
    """The devices of `entry.devices` among `matching`, as NVIDIA's getIDsOfDevicesToReplicate picks them,
    or why they cannot be."""
    devices = entry.devices
    if devices == "all":
        return matching, ""
    if isinstance(devices, int):
        if devices > len(matching):
            return [], f"requested {devices} devices to be replicated, but only {len(matching)} devices available"
        return matching[:devices], ""
    selected: list[_Base] = []
    for ref in devices:
        found = [base for base in matching if _is(ref, base)]
        if not found and isinstance(ref, str) and not ref[:1].isdigit():
            return [], f"no matching device with UUID: {ref}"
        selected += [base for base in found if base not in selected]
    return selected, ""


def _is(ref: Union[int, str], base: _Base) -> bool:
    if isinstance(ref, int):
        return base.mig_index is None and ref == base.gpu.index
    if ":" in ref and ref[:1].isdigit():
        gpu, mig = ref.split(":", 1)
        return base.mig_index is not None and (int(gpu), int(mig)) == (base.gpu.index, base.mig_index)
    return ref in (base.uuid, base.gpu.uuid)


@dataclass(frozen=True)
class Shared:
    """How a resource is shared, for GFD's labels: <name>.replicas and <name>.sharing-strategy."""

    replicas: int  # the smallest count among its shared devices: a scheduler trusting it never over-counts
    renamed: bool  # advertised under another name (renameByDefault or rename)
    strategy: str = "time-slicing"  # or mps


def sharing(inventory: Optional[Inventory], strategy: str, settings: PluginConfig) -> dict[str, Shared]:
    """By resource name without nvidia.com/ (gpu, mig-3g.40gb): the shared ones."""
    if inventory is None:
        return {}
    counts: dict[str, list[int]] = {}
    renamed: dict[str, bool] = {}
    bases = _bases(inventory, strategy)[0]
    plan, refused = _sharing_plan(bases, settings)
    for base in bases:
        replicas, name = plan.get(base.uuid, (1, base.resource))
        if replicas > 1 and base.resource not in refused:
            key = base.resource[len(RESOURCE_PREFIX):]
            counts.setdefault(key, []).append(replicas)
            renamed[key] = renamed.get(key, False) or name != base.resource
    how = "mps" if settings.sharing.strategy == "mps" else "time-slicing"
    return {key: Shared(min(values), renamed[key], how) for key, values in counts.items()}
