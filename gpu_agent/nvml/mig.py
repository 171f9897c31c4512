"""MIG through NVML: a GPU's profiles and instances as read, and the changes (mode, GPU and compute
instances). A change, even one that fails half-way, tells the session the GPUs changed."""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional, TypeVar, cast

from gpu_agent.nvml.model import ComputeInstance, GpuInstance, MigProfile, MigState
from gpu_agent.nvml.session import NvmlSession, describe

_F = TypeVar("_F", bound=Callable[..., Any])

# NVML_GPU_INSTANCE_PROFILE_* constants worth asking about, in the order nvidia-smi lists them: by slices,
# then the constant. The GFX, NO_ME and ALL_ME ones (Blackwell's `+gfx`, `-me` and `+me.all` profiles) are
# each their own profile, MIG devices of which the device plugin advertises as their own resources; a pynvml
# without one of them skips it.
_GI_PROFILE_PREFIX = "NVML_GPU_INSTANCE_PROFILE_"
_GI_PROFILE_CONSTANTS = (
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX",
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE",
)

# The compute instance profile constant of each size (NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_PROFILE_BY_SLICES = {
    1: "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE",
    2: "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
    3: "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE",
    4: "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
    6: "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE",
    7: "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
    8: "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE",
}


def _changes_gpus(method: _F) -> _F:
    @functools.wraps(method)
    def changing(self: NvmlMig, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.session.gpus_changed()

    return cast(_F, changing)


class NvmlMig:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self._static: dict[str, tuple[MigProfile, ...]] = {}  # MIG profile tables by GPU UUID
        self._ci_profiles: dict[tuple[str, int], tuple[Any, ...]] = {}  # by (GPU UUID, GPU instance profile id)
        self._mig_ids: dict[str, dict[str, tuple[int, int]]] = {}  # by GPU UUID: MIG device UUID -> (GI, CI id)

    # --- reading ---------------------------------------------------------------------------------

    def mode(self, handle: Any) -> Optional[tuple[int, int]]:
        """(current, pending) MIG mode; None where the GPU has no MIG."""
        try:
            current, pending = self.session.call("nvmlDeviceGetMigMode", handle)
        except self.session.lib.NVMLError_NotSupported:
            return None
        return current, pending

    def read(self, handle: Any, uuid: str, mode: Optional[tuple[int, int]]) -> MigState:
        """The GPU's MIG state given its mode (see mode()): its profiles and, when enabled, its instances."""
        if mode is None:
            return MigState(capable=False)
        lib = self.session.lib
        current, pending = mode
        enabled = current == lib.NVML_DEVICE_MIG_ENABLE
        if uuid not in self._static:
            self._static[uuid] = self._profiles(handle)
        profiles = self._static[uuid]
        return MigState(
            capable=True,
            enabled=enabled,
            pending_enabled=pending == lib.NVML_DEVICE_MIG_ENABLE,
            gpu_instances=self._gpu_instances(handle, uuid, profiles) if enabled else (),
            profiles=profiles,
        )

    def state(self, index: int) -> MigState:
        """One GPU's MIG mode and instances, read now (after a change)."""
        self.session.init()
        handle = self.session.handle(index)
        return self.read(handle, self.session.call("nvmlDeviceGetUUID", handle), self.mode(handle))

    def _profiles(self, handle: Any) -> tuple[MigProfile, ...]:
        lib = self.session.lib
        profiles = []
        for constant in _GI_PROFILE_CONSTANTS:
            if not hasattr(lib, constant):
                continue
            try:
                info = self.session.call("nvmlDeviceGetGpuInstanceProfileInfo", handle, getattr(lib, constant))
            except (lib.NVMLError_NotSupported, lib.NVMLError_InvalidArgument):
                continue
            profiles.append(
                MigProfile(
                    name=_profile_name(info.name),
                    id=info.id,
                    slices=info.sliceCount,
                    instances=info.instanceCount,
                    multiprocessors=info.multiprocessorCount,
                    memory_mib=info.memorySizeMB,
                    copy_engines=info.copyEngineCount,
                    decoders=info.decoderCount,
                    encoders=info.encoderCount,
                    jpeg_engines=info.jpegCount,
                    ofa_engines=info.ofaCount,
                    placements=self._placements(handle, info.id, info.instanceCount),
                    constant=constant.removeprefix(_GI_PROFILE_PREFIX),
                )
            )
        return tuple(profiles)

    def _placements(self, handle: Any, profile_id: int, max_count: int) -> tuple[tuple[int, int], ...]:
        placements = (self.session.lib.c_nvmlGpuInstancePlacement_t * max(max_count, 8))()
        count = ctypes.c_uint(len(placements))
        self.session.call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, placements,
                          ctypes.byref(count))
        return tuple((placements[i].start, placements[i].size) for i in range(count.value))

    def _gpu_instances(self, handle: Any, uuid: str, profiles: tuple[MigProfile, ...]) -> tuple[GpuInstance, ...]:
        """Every GPU instance, by profile, and under each its compute instances, as mig-parted walks them."""
        call = self.session.call
        devices = self._mig_device_uuids(handle, uuid)
        found = []
        taken: list[tuple[int, int]] = []  # the memory slices (start, size) of the GPU instances found so far
        for profile in profiles:
            if profile.placements and not any(_free(placement, taken) for placement in profile.placements):
                continue  # no GPU instance of this profile can sit beside those found: no need to ask NVML
            handles = (self.session.lib.c_nvmlGpuInstance_t * max(profile.instances, 1))()
            count = ctypes.c_uint(0)
            call("nvmlDeviceGetGpuInstances", handle, profile.id, handles, ctypes.byref(count))
            for gpu_instance in handles[: count.value]:
                info = call("nvmlGpuInstanceGetInfo", gpu_instance)
                taken.append((info.placement.start, info.placement.size))
                found.append(GpuInstance(
                    id=info.id, profile_id=profile.id, profile=profile.name, slices=profile.slices,
                    placement=(info.placement.start, info.placement.size), memory_mib=profile.memory_mib,
                    compute_instances=self._compute_instances(gpu_instance, info.id, profile, uuid, devices),
                ))
        return tuple(sorted(found, key=lambda gi: gi.id))

    def _compute_instance_profiles(self, gpu_instance: Any, key: tuple[str, int]) -> tuple[Any, ...]:
        """The compute instance profiles a GPU instance offers (the same for every GPU instance of a
        profile, so read once per GPU and profile)."""
        lib = self.session.lib
        if key not in self._ci_profiles:
            profiles = []
            for constant in range(lib.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    profiles.append(self.session.call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpu_instance,
                                                      constant, lib.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED))
                except (lib.NVMLError_NotSupported, lib.NVMLError_InvalidArgument):
                    continue
            self._ci_profiles[key] = tuple(profiles)
        return self._ci_profiles[key]

    def _compute_instances(self, gpu_instance: Any, gi_id: int, gi_profile: MigProfile, uuid: str,
                           devices: dict[tuple[int, int], tuple[int, str]]) -> tuple[ComputeInstance, ...]:
        call = self.session.call
        found = []
        for profile in self._compute_instance_profiles(gpu_instance, (uuid, gi_profile.id)):
            handles = (self.session.lib.c_nvmlComputeInstance_t * max(profile.instanceCount, 1))()
            count = ctypes.c_uint(0)
            call("nvmlGpuInstanceGetComputeInstances", gpu_instance, profile.id, handles, ctypes.byref(count))
            for compute_instance in handles[: count.value]:
                info = call("nvmlComputeInstanceGetInfo", compute_instance)
                index, device_uuid = devices.get((gi_id, info.id), (-1, ""))
                found.append(ComputeInstance(
                    id=info.id, profile_id=profile.id, profile=_device_profile(gi_profile, profile.sliceCount),
                    slices=profile.sliceCount,
                    placement=(info.placement.start, info.placement.size),
                    multiprocessors=profile.multiprocessorCount, uuid=device_uuid, device_index=index,
                ))
        return tuple(sorted(found, key=lambda ci: ci.id))

    def _mig_device_uuids(self, handle: Any, gpu_uuid: str) -> dict[tuple[int, int], tuple[int, str]]:
        """(GPU instance id, compute instance id) -> (MIG device index, UUID). A MIG device's UUID is made
        with its compute instance and never names another, so its two ids are asked once per device:
        kept by UUID for the devices of the GPU's last reading."""
        call = self.session.call
        known = self._mig_ids.get(gpu_uuid, {})
        seen: dict[str, tuple[int, int]] = {}
        devices = {}
        for slot in range(call("nvmlDeviceGetMaxMigDeviceCount", handle)):
            try:
                mig = call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except self.session.lib.NVMLError_NotFound:
                continue
            uuid = call("nvmlDeviceGetUUID", mig)
            ids = known.get(uuid)
            if ids is None:
                ids = (call("nvmlDeviceGetGpuInstanceId", mig), call("nvmlDeviceGetComputeInstanceId", mig))
            seen[uuid] = ids
            devices[ids] = (slot, uuid)
        self._mig_ids[gpu_uuid] = seen
        return devices

    # --- changes ---------------------------------------------------------------------------------

    @_changes_gpus
    def set_mode(self, index: int, enabled: bool) -> Optional[str]:
        """Ask for MIG mode; None when it took effect, else why it is pending (NVML's activation status:
        Ampere needs a GPU reset, Hopper and later do not)."""
        self.session.init()
        lib = self.session.lib
        handle = self.session.handle(index)
        mode = lib.NVML_DEVICE_MIG_ENABLE if enabled else lib.NVML_DEVICE_MIG_DISABLE
        status = self.session.call("nvmlDeviceSetMigMode", handle, mode)
        if status == lib.NVML_SUCCESS:
            return None
        return describe(lib.NVMLError(status))

    @_changes_gpus
    def create_gpu_instance(self, index: int, profile_id: int, placement: tuple[int, int]) -> int:
        """A GPU instance of the profile at exactly this placement; its id."""
        self.session.init()
        handle = self.session.handle(index)
        where = self.session.lib.c_nvmlGpuInstancePlacement_t()
        where.start, where.size = placement
        gpu_instance = self.session.call("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id,
                                         ctypes.byref(where))
        return int(self.session.call("nvmlGpuInstanceGetInfo", gpu_instance).id)

    @_changes_gpus
    def create_compute_instance(self, index: int, gi_id: int, slices: int, start: int) -> int:
        """A compute instance of `slices` compute slices at `start` in GPU instance `gi_id`; its id."""
        lib = self.session.lib
        gpu_instance = self._gpu_instance(index, gi_id)
        constant = _CI_PROFILE_BY_SLICES.get(slices)
        if constant is None or not hasattr(lib, constant):
            raise lib.NVMLError(lib.NVML_ERROR_NOT_SUPPORTED)
        profile = self.session.call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpu_instance,
                                    getattr(lib, constant), lib.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        where = lib.c_nvmlComputeInstancePlacement_t()
        where.start, where.size = start, profile.sliceCount
        compute_instance = self.session.call("nvmlGpuInstanceCreateComputeInstanceWithPlacement", gpu_instance,
                                             profile.id, ctypes.byref(where))
        return int(self.session.call("nvmlComputeInstanceGetInfo", compute_instance).id)

    @_changes_gpus
    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        gpu_instance = self._gpu_instance(index, gi_id)
        compute_instance = self.session.call("nvmlGpuInstanceGetComputeInstanceById", gpu_instance, ci_id)
        self.session.call("nvmlComputeInstanceDestroy", compute_instance)

    @_changes_gpus
    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self.session.call("nvmlGpuInstanceDestroy", self._gpu_instance(index, gi_id))

    def _gpu_instance(self, index: int, gi_id: int) -> Any:
        self.session.init()
        handle = self.session.handle(index)
        return self.session.call("nvmlDeviceGetGpuInstanceById", handle, gi_id)


def _free(placement: tuple[int, int], taken: list[tuple[int, int]]) -> bool:
    """Whether a placement (start, size in memory slices) overlaps none of the taken ones."""
    start, size = placement
    return all(start + size <= other or other + other_size <= start for other, other_size in taken)


def _profile_name(nvml_name: str) -> str:
    """NVML names profiles "MIG 1g.10gb"; everyone else says "1g.10gb"."""
    return nvml_name.removeprefix("MIG ").strip()


def _device_profile(gi_profile: MigProfile, ci_slices: int) -> str:
    """A MIG device's profile name as NVML names its GPU instance's profile (never worked out from its
    memory: that rounding names an H200's 1g.18gb "1g.16gb"), with the compute slices in front when
    the compute instance is smaller than its GPU instance, as nvidia-smi and GFD write it."""
    return gi_profile.name if ci_slices == gi_profile.slices else f"{ci_slices}c.{gi_profile.name}"
