"""NVML's MIG rules, as the simulated driver enforces them on one GPU's state.

A GPU's MIG state in the machine document:
    "mig": {"current": 0|1, "pending": 0|1, "serial": N,
            "gpu_instances": [{"id", "profile_id", "start", "size",
                               "compute_instances": [{"id", "profile_id", "start", "size", "uuid"}]}]}

- A GPU instance goes only where its profile can be placed (nvmlDeviceGetGpuInstancePossiblePlacements),
  never over another's memory slices, and at most `instances` of a profile exist:
  NVML_ERROR_INSUFFICIENT_RESOURCES otherwise.
- GPU instance ids are the driver's: fixed by placement, numbering the nodes of the binary tree of
  memory slices level by level (the whole GPU 0; on an 8-slice GPU the halves 1 and 2, the quarters
  3 to 6, the eighths 7 to 14). So a 3g at slice 4 is GI 2 and a 1g at slice 6 is GI 13, as the MIG
  user guide's examples show (`-cgi 19,14,5` gives GI 13, 5 and 1).
- Compute instances go inside a GPU instance by the same kind of rule (mig.profile.compute_starts);
  their ids are the lowest free from 0. A MIG device's UUID is new for every compute instance created.
- Destroying a GPU instance that holds compute instances, or an instance a process runs on: IN_USE.
"""
from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, Optional

import pynvml

from gpu_agent.errors import AgentError
from gpu_agent.mig.profile import compute_sizes, compute_starts, parse_profile
from gpu_agent.mig.reset import ResetImpossible
from gpu_agent.sim.profiles import GiProfile, GpuModel

# NVML_COMPUTE_INSTANCE_PROFILE_* constant (and so profile id) of each compute instance size.
CI_PROFILE_IDS = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


@dataclass(frozen=True)
class CiProfile:
    id: int
    slices: int
    instances: int
    multiprocessors: int
    name: str  # "MIG 1c.7g.80gb", or the GPU instance's own name for a full-size one
    starts: tuple[int, ...]


def fail(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def memory_slices(model: GpuModel) -> int:
    return max(start + p.size for p in model.mig_profiles for start in p.starts)


def compute_slices(model: GpuModel) -> int:
    return max(p.slices for p in model.mig_profiles)


def gi_id(model: GpuModel, start: int, size: int) -> int:
    """The GPU instance id the driver gives an instance at this placement (see the module's docstring)."""
    total = memory_slices(model)
    nodes = 1
    while total // nodes > size:
        nodes *= 2
    return nodes - 1 + start // max(total // nodes, 1)


def gi_profile(model: GpuModel, profile_id: int) -> GiProfile:
    profile = next((p for p in model.mig_profiles if p.id == profile_id), None)
    if profile is None:
        raise fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return profile


def ci_profiles(model: GpuModel, profile: GiProfile) -> tuple[CiProfile, ...]:
    one_slice = next((p.multiprocessors for p in model.mig_profiles if p.slices == 1), profile.multiprocessors)
    base = profile.name.removeprefix("MIG ")
    found = []
    for size in compute_sizes(profile.slices):
        full = size == profile.slices
        found.append(CiProfile(
            id=CI_PROFILE_IDS[size], slices=size, instances=len(compute_starts(profile.slices, size)),
            multiprocessors=profile.multiprocessors if full else one_slice * size,
            name=profile.name if full else f"MIG {size}c.{base}",
            starts=compute_starts(profile.slices, size),
        ))
    return tuple(found)


def ci_profile(model: GpuModel, gi: dict[str, Any], profile_id: int) -> CiProfile:
    profile = next((p for p in ci_profiles(model, gi_profile(model, gi["profile_id"])) if p.id == profile_id), None)
    if profile is None:
        raise fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return profile


def find_gi(gpu: dict[str, Any], gi_id_: int) -> dict[str, Any]:
    found = next((gi for gi in gpu["mig"]["gpu_instances"] if gi["id"] == gi_id_), None)
    if found is None:
        raise fail(pynvml.NVML_ERROR_NOT_FOUND)
    return found


def find_ci(gi: dict[str, Any], ci_id: int) -> dict[str, Any]:
    found = next((ci for ci in gi["compute_instances"] if ci["id"] == ci_id), None)
    if found is None:
        raise fail(pynvml.NVML_ERROR_NOT_FOUND)
    return found


def mig_devices(gpu: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(GPU instance, compute instance) of every MIG device, in the order NVML enumerates them."""
    pairs = [(gi, ci) for gi in gpu["mig"]["gpu_instances"] for ci in gi["compute_instances"]]
    return sorted(pairs, key=lambda pair: (pair[0]["id"], pair[1]["id"]))


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def create_gpu_instance(gpu: dict[str, Any], model: GpuModel, profile_id: int,
                        placement: Optional[tuple[int, int]]) -> dict[str, Any]:
    """nvmlDeviceCreateGpuInstance[WithPlacement] on the GPU's state; the new instance."""
    if not gpu["mig"]["current"]:
        raise fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    profile = gi_profile(model, profile_id)
    instances = gpu["mig"]["gpu_instances"]
    possible = [(start, profile.size) for start in profile.starts]
    if placement is not None and placement not in possible:
        raise fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if sum(1 for gi in instances if gi["profile_id"] == profile_id) >= profile.instances:
        raise fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    used_compute = sum(gi_profile(model, gi["profile_id"]).slices for gi in instances)
    if used_compute + profile.slices > compute_slices(model):
        raise fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    taken = [(gi["start"], gi["size"]) for gi in instances]
    free = [where for where in possible if not any(_overlaps(where, other) for other in taken)]
    if placement is not None:
        free = [where for where in free if where == placement]
    if not free:
        raise fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    start, size = free[0]
    instance = {"id": gi_id(model, start, size), "profile_id": profile_id, "start": start, "size": size,
                "compute_instances": []}
    instances.append(instance)
    instances.sort(key=lambda gi: gi["id"])
    return instance


def create_compute_instance(gpu: dict[str, Any], model: GpuModel, gi: dict[str, Any], profile_id: int,
                            start: Optional[int]) -> dict[str, Any]:
    """nvmlGpuInstanceCreateComputeInstance[WithPlacement]; the new compute instance."""
    profile = ci_profile(model, gi, profile_id)
    if start is not None and start not in profile.starts:
        raise fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    existing = gi["compute_instances"]
    taken = [(ci["start"], ci["size"]) for ci in existing]
    free = [s for s in profile.starts if not any(_overlaps((s, profile.slices), other) for other in taken)]
    if start is not None:
        free = [s for s in free if s == start]
    if not free or sum(ci["size"] for ci in existing) + profile.slices > gi_profile(model, gi["profile_id"]).slices:
        raise fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    ids = {ci["id"] for ci in existing}
    serial = gpu["mig"].get("serial", 0) + 1
    gpu["mig"]["serial"] = serial
    new_id = min(i for i in range(len(existing) + 1) if i not in ids)
    uuid = uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{gpu['uuid']}/{gi['id']}/{new_id}/{serial}")
    instance = {"id": new_id, "profile_id": profile_id, "start": free[0], "size": profile.slices,
                "uuid": f"MIG-{uuid}"}
    existing.append(instance)
    existing.sort(key=lambda ci: ci["id"])
    return instance


def busy(gpu: dict[str, Any], gi: Optional[dict[str, Any]] = None, ci: Optional[dict[str, Any]] = None) -> bool:
    """Whether a process runs on the GPU, on this GPU instance, or on this compute instance."""
    for process in gpu["processes"]:
        if gi is None:
            return True
        if process.get("gpu_instance_id") == gi["id"] and (
                ci is None or process.get("compute_instance_id") in (None, ci["id"])):
            return True
    return False


def destroy_compute_instance(gpu: dict[str, Any], gi: dict[str, Any], ci: dict[str, Any]) -> None:
    if busy(gpu, gi, ci):
        raise fail(pynvml.NVML_ERROR_IN_USE)
    gi["compute_instances"].remove(ci)


def destroy_gpu_instance(gpu: dict[str, Any], gi: dict[str, Any]) -> None:
    if gi["compute_instances"] or busy(gpu, gi):
        raise fail(pynvml.NVML_ERROR_IN_USE)
    gpu["mig"]["gpu_instances"].remove(gi)


def set_mode(gpu: dict[str, Any], model: GpuModel, enabled: bool) -> int:
    """nvmlDeviceSetMigMode: the activation status. Ampere keeps the new mode pending until a GPU
    reset (NVML_ERROR_RESET_REQUIRED); Hopper and later change at once (NVML_SUCCESS)."""
    mig = gpu["mig"]
    if busy(gpu):
        raise fail(pynvml.NVML_ERROR_IN_USE)
    if not enabled and mig["gpu_instances"]:
        raise fail(pynvml.NVML_ERROR_IN_USE)  # destroy the instances first
    mig["pending"] = int(enabled)
    if model.mig_needs_reset:
        return pynvml.NVML_SUCCESS if mig["pending"] == mig["current"] else pynvml.NVML_ERROR_RESET_REQUIRED
    mig["current"] = mig["pending"]
    return pynvml.NVML_SUCCESS


def reset(gpu: dict[str, Any]) -> None:
    """A GPU reset: a pending mode takes effect; MIG instances do not survive a mode change."""
    mig = gpu["mig"]
    if mig["current"] != mig["pending"]:
        mig["gpu_instances"] = []
    mig["current"] = mig["pending"]


def loses_mode_on_reload(model: GpuModel) -> bool:
    """Hopper and later (compute capability 9.0+) forget MIG mode when the driver reloads; Ampere keeps it."""
    return model.compute_capability >= (9, 0)


def reload_driver(gpu: dict[str, Any], model: GpuModel) -> None:
    """The nvidia module unloaded and loaded again: MIG instances are the driver's and are gone on every
    GPU; Hopper and later come back with MIG disabled; Ampere keeps its mode, and a pending one stays
    pending (only a GPU reset or a reboot applies it). The compute mode and time-slice, the driver's too, are
    Default again."""
    gpu.pop("compute_mode", None)
    gpu.pop("timeslice", None)
    mig = gpu["mig"]
    mig["gpu_instances"] = []
    if loses_mode_on_reload(model):
        mig["current"] = mig["pending"] = 0


def reboot(gpu: dict[str, Any], model: GpuModel) -> None:
    """A reboot: the processes are gone, a pending mode takes effect (the GPU is reset), then the driver
    loads afresh: compute mode is DEFAULT again (not persistent across reboots on Linux)."""
    gpu["processes"] = []
    reset(gpu)
    reload_driver(gpu, model)


def add_device(gpu: dict[str, Any], model: GpuModel, name: str) -> None:
    """A machine file's MIG device (`3g.40gb`, `1c.3g.40gb`): a GPU instance at its profile's first free
    placement, with one compute instance; AgentError naming the profile when it cannot be made."""
    try:
        wanted = parse_profile(name)
    except ValueError as exc:
        raise AgentError(str(exc)) from None
    profile = next((p for p in model.mig_profiles if p.name == f"MIG {wanted.gpu_instance}"), None)
    if profile is None or wanted.c not in CI_PROFILE_IDS:
        known = ", ".join(p.name.removeprefix("MIG ") for p in model.mig_profiles)
        raise AgentError(f"{model.name} has no MIG profile {name!r}; it has {known}")
    try:
        gi = create_gpu_instance(gpu, model, profile.id, None)
        create_compute_instance(gpu, model, gi, CI_PROFILE_IDS[wanted.c], None)
    except pynvml.NVMLError as exc:
        raise AgentError(f"no room for MIG device {name} on {model.name}: {exc}") from None


class SimGpuReset:
    """A GPU reset on the simulated machine: refused, as the driver refuses it, while a process runs on
    the GPU or nvidia_drm is loaded."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def blocker(self, index: int, bus_id: str) -> Optional[ResetImpossible]:
        return self._blocker(self.machine.read(), index, bus_id)

    @staticmethod
    def _blocker(state: dict[str, Any], index: int, bus_id: str) -> Optional[ResetImpossible]:
        gpu = state["gpus"][index]
        if index in state.get("lost_gpus", ()):
            return ResetImpossible(f"GPU {index} ({bus_id}) has fallen off the bus: reboot the node")
        if gpu["processes"]:
            pids = ", ".join(str(p["pid"]) for p in gpu["processes"])
            return ResetImpossible(f"GPU {index} ({bus_id}) cannot be reset while processes {pids} use it",
                                   until_reboot=False)
        if any(module["name"] == "nvidia_drm" for module in state["kernel"]["loaded"]):
            return ResetImpossible(f"GPU {index} ({bus_id}) cannot be reset while nvidia_drm is loaded; "
                                   "reboot the node (or unload nvidia_drm) for the MIG mode change")
        return None

    def reset(self, index: int, bus_id: str) -> None:
        with self.machine.edit() as state:
            blocked = self._blocker(state, index, bus_id)
            if blocked is not None:
                raise blocked
            gpu = state["gpus"][index]
            reset(gpu)
            state.setdefault("resets", []).append(index)
