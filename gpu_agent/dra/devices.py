"""What the node publishes for driver gpu.nvidia.com: its devices as resource.k8s.io/v1 ResourceSlice
entries, with the names and attributes NVIDIA's DRA driver gives them, so that its DeviceClasses and a
user's CEL selectors work unchanged. A pure function of the inventory and its health.

Names and attributes are the facts of kubernetes-sigs/dra-driver-nvidia-gpu's cmd/gpu-kubelet-plugin
(deviceinfo.go, mig.go, partitions.go at commit 95932046683719c43b6a0dd9613c2e5aad5d6703): a whole GPU
is `gpu-<minor>`, a MIG device `gpu-<parent minor>-mig-<profile, dots dropped>-<GI profile id>-<placement
start>`; version attributes are semantic versions (NVIDIA parses them with Masterminds semver, which
writes three numbers); memory is in bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpu_agent.kube.labels import family
from gpu_agent.numbers import version_numbers
from gpu_agent.nvml.model import Gpu, GpuHealth, GpuInstance, Inventory, MigProfile
from gpu_agent.nvml.session import short_bus_id

DRIVER = "gpu.nvidia.com"
MAX_DEVICES_PER_SLICE = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # per device: ResourceSliceMaxAttributesAndCapacitiesPerDevice
STANDARD = "resource.kubernetes.io/"  # the attribute domain every driver shares (k8s.io/dynamic-resource-allocation)
_NOT_DNS_LABEL = re.compile(r"[^a-z0-9-]")
# NVML's architecture names, by the family GFD derives from the compute capability.
_ARCHITECTURES = {"volta": "Volta", "turing": "Turing", "ampere": "Ampere", "ada-lovelace": "Ada Lovelace",
                  "hopper": "Hopper", "blackwell": "Blackwell", "pascal": "Pascal", "maxwell": "Maxwell",
                  "kepler": "Kepler"}


# Taint keys as NVIDIA's gpu-kubelet-plugin writes them (cmd/gpu-kubelet-plugin/device_health.go at
# 15a116f03ce09bbaabff2635c0bf3823d15aff19), so that tolerations written for its devices fit the agent's, and
# one of the agent's own for what NVIDIA's plugin does not check.
XID_TAINT = f"{DRIVER}/xid"  # a critical XID; its value the XID's number
GPU_LOST_TAINT = f"{DRIVER}/gpu-lost"  # NVML cannot reach the GPU (off the bus); no value
UNHEALTHY_TAINT = f"{DRIVER}/unhealthy"  # the agent's: NVML queries failing, or a failed periodic check
TAINT_EFFECT = "NoSchedule"  # not allocated again; the pods of claims already prepared are not evicted

@dataclass(frozen=True)
class DraDevice:
    """One device of the pool: its name in the pool, what containers get (the GPU or MIG device UUID, the
    name of its CDI device in the agent's spec) and the ResourceSlice entry, which carries a taint while
    the device is unhealthy."""

    name: str
    uuid: str
    gpu_uuid: str
    entry: dict[str, Any]

    @property
    def tainted(self) -> bool:
        return bool(self.entry.get("taints"))

    def to_json(self) -> dict[str, Any]:
        """As /status lists it."""
        shown = {"name": self.name, "uuid": self.uuid, "attributes": self.entry["attributes"],
                 "capacity": self.entry["capacity"]}
        if self.tainted:
            shown["taints"] = self.entry["taints"]
        return shown


def health_taints(health: GpuHealth, unreadable: bool = False) -> list[dict[str, Any]]:
    """The taints an unhealthy GPU or MIG device carries on its ResourceSlice entry (resource.k8s.io/v1
    DeviceTaint: a qualified key, a label value, an effect); none while it is healthy and readable.
    `unreadable`: NVML cannot read the GPU now."""
    taints = []
    if health.xid_reason:
        value = str(health.last_xid) if health.last_xid is not None else "unknown"
        taints.append({"key": XID_TAINT, "value": value, "effect": TAINT_EFFECT})
    if unreadable or health.lost or health.missing:
        taints.append({"key": GPU_LOST_TAINT, "effect": TAINT_EFFECT})
    elif health.query_error:
        taints.append({"key": UNHEALTHY_TAINT, "value": "nvml-query-failed", "effect": TAINT_EFFECT})
    if health.check_reason:
        taints.append({"key": UNHEALTHY_TAINT, "value": "health-check-failed", "effect": TAINT_EFFECT})
    return taints


def gpu_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor_number}"


def mig_device_name(gpu: Gpu, instance: GpuInstance) -> str:
    profile = _NOT_DNS_LABEL.sub("-", instance.profile.lower().replace(".", "")).strip("-")
    return f"gpu-{gpu.minor_number}-mig-{profile}-{instance.profile_id}-{instance.placement[0]}"


def quantity(value: int) -> str:
    """A whole number as the API server writes it back (a plain number parses as DecimalSI, whose canonical
    form moves trailing thousands into a suffix: 1000 is `1k`), so that what was written compares equal to
    what is read and an unchanged pool is never written again."""
    for exponent, suffix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if value and value % 10 ** exponent == 0:
            return f"{value // 10 ** exponent}{suffix}"
    return str(value)


def semver(text: str) -> Optional[str]:
    """`550.90.07` -> `550.90.7`, `12.4` -> `12.4.0`: the form the API's version attributes take."""
    numbers = version_numbers(text)
    if numbers is None:
        return None
    return ".".join(str(number) for number in (*numbers, 0, 0)[:3])


def published(inventory: Optional[Inventory], health: Mapping[str, GpuHealth]) -> tuple[DraDevice, ...]:
    """The devices of the node's pool, in name order: each readable GPU whose MIG mode is off, and each MIG
    device (a GPU instance with one compute instance as large as itself) of a readable GPU whose MIG mode is
    on. An unhealthy GPU or MIG device (a MIG device also while its GPU is) carries a taint
    (health_taints) until it recovers, and so does a GPU NVML cannot read now (off the bus), as last read;
    where the API server drops taints (DRADeviceTaints off) the publisher withdraws them instead
    (slices.py). A GPU known by its identity alone (no reading of its memory or MIG state) is not in the
    pool."""
    if inventory is None:
        return ()
    common = _driver_attributes(inventory)
    found: list[DraDevice] = []
    for gpu in inventory.gpus:
        if not gpu.details_known:
            continue
        attributes = {**_gpu_attributes(gpu), **common}
        gpu_taints = health_taints(health.get(gpu.uuid, GpuHealth()), bool(gpu.unreadable))
        if not gpu.mig.enabled:
            entry = _entry(gpu_device_name(gpu),
                           {"type": {"string": "gpu"}, "uuid": {"string": gpu.uuid}, **attributes},
                           {"memory": {"value": quantity(gpu.memory_mib * 1024 * 1024)}}, gpu_taints)
            found.append(DraDevice(entry["name"], gpu.uuid, gpu.uuid, entry))
            continue
        profiles = {profile.id: profile for profile in gpu.mig.profiles}
        for instance in gpu.mig.gpu_instances:
            single = instance.compute_instances
            if len(single) != 1 or single[0].slices != instance.slices:
                continue
            uuid = single[0].uuid
            entry = _entry(mig_device_name(gpu, instance),
                           {"type": {"string": "mig"}, "uuid": {"string": uuid}, "parentUUID": {"string": gpu.uuid},
                            "profile": {"string": instance.profile}, **attributes},
                           _mig_capacity(instance, profiles.get(instance.profile_id)),
                           gpu_taints or health_taints(health.get(uuid, GpuHealth())))
            found.append(DraDevice(entry["name"], uuid, gpu.uuid, entry))
    return tuple(sorted(found, key=lambda device: device.name))


def _entry(name: str, attributes: dict[str, Any], capacity: dict[str, Any],
           taints: list[dict[str, Any]]) -> dict[str, Any]:
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:  # a bug: the sets above are fixed
        raise AssertionError(f"{name}: {len(attributes) + len(capacity)} attributes and capacities")
    entry: dict[str, Any] = {"name": name, "attributes": attributes, "capacity": capacity}
    if taints:
        entry["taints"] = taints
    return entry


def _driver_attributes(inventory: Inventory) -> dict[str, Any]:
    found = {}
    for key, text in (("driverVersion", inventory.driver_version), ("cudaDriverVersion", inventory.cuda_version)):
        version = semver(text)
        if version is not None:
            found[key] = {"version": version}
    return found


def _gpu_attributes(gpu: Gpu) -> dict[str, Any]:
    major, minor = gpu.compute_capability
    attributes: dict[str, Any] = {
        "productName": {"string": gpu.product},
        "architecture": {"string": _ARCHITECTURES.get(family(major, minor), "Unknown")},
        "cudaComputeCapability": {"version": f"{major}.{minor}.0"},
        STANDARD + "pciBusID": {"string": short_bus_id(gpu.pci_bus_id)},
    }
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attributes[STANDARD + "numaNode"] = {"int": gpu.numa_node}
    return attributes


def _mig_capacity(instance: GpuInstance, profile: Optional[MigProfile]) -> dict[str, Any]:
    capacity: dict[str, Any] = {"memory": {"value": quantity(instance.memory_mib * 1024 * 1024)}}
    if profile is not None:
        for key, value in (("multiprocessors", profile.multiprocessors), ("copyEngines", profile.copy_engines),
                           ("decoders", profile.decoders), ("encoders", profile.encoders),
                           ("jpegEngines", profile.jpeg_engines), ("ofaEngines", profile.ofa_engines)):
            capacity[key] = {"value": quantity(value)}
    start, size = instance.placement
    for memory_slice in range(start, start + size):
        capacity[f"memorySlice{memory_slice}"] = {"value": "1"}
    return capacity


def slices(node: str, devices: tuple[DraDevice, ...], generation: int) -> list[dict[str, Any]]:
    """The pool's ResourceSlice specs: `node`'s pool, MAX_DEVICES_PER_SLICE devices each (one empty slice
    for a pool without devices, so the scheduler knows the pool is there and empty)."""
    chunks = [devices[at:at + MAX_DEVICES_PER_SLICE] for at in range(0, len(devices), MAX_DEVICES_PER_SLICE)] or [()]
    return [{"driver": DRIVER, "nodeName": node,
             "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
             "devices": [device.entry for device in chunk]} for chunk in chunks]
