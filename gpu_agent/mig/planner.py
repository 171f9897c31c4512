"""From a GPU's MIG state and a mig-parted entry to the NVML changes that make one into the other.

Pure functions over the model (gpu_agent.nvml.model) and the GPU's own profile table; nothing here
talks to NVML. Per GPU:

- A GPU that already matches gets no change at all.
- A MIG device is one compute instance; the compute instances of one GPU instance profile are packed
  into as few GPU instances as fit (largest first), as mig-parted does.
- Every existing GPU instance that can stay stays: the layout keeps as many as still leaves room for
  the rest, and only the instances in the way are destroyed. New GPU instances get explicit
  placements, largest first, lowest start first, so the same input always gives the same plan.
- An impossible geometry is refused before any change, naming the GPU and the reason.
- `devices: all` selects the MIG-capable GPUs only, as mig-parted's apply has it since v0.2.0 (NVIDIA/mig-parted
  commit 24564e4c, "Change semantics of 'all' to mean 'all-mig-capable'"): a GPU that cannot do MIG is skipped,
  so an `all-*` config works on a node with such GPUs. A GPU named by index that cannot do MIG is refused
  when its entry enables MIG, as there. `assert` agrees with apply (mig-parted's assert still fails such a
  node, even right after its own apply succeeded; see README, compatibility).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Optional, Sequence

from gpu_agent.mig.checkpoint import Checkpoint
from gpu_agent.mig.config import MigConfigEntry, entry_for
from gpu_agent.mig.profile import ProfileName, compute_sizes, compute_starts, parse_profile
from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, MigProfile
from gpu_agent.plan import (
    Change,
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    SetMigMode,
)


@dataclass(frozen=True)
class GpuPlan:
    """What one GPU needs. `refused`: why nothing may be done; `note`: why nothing needs to be;
    `skipped`: why the selecting entry does not apply to it at all."""

    gpu: int
    uuid: str
    product: str
    changes: tuple[Change, ...] = ()
    refused: str = ""
    note: str = ""
    skipped: str = ""
    target: Optional[Geometry] = None  # what the entry asks for; None: no entry, or not MIG-capable

    @property
    def name(self) -> str:
        return gpu_name(self.gpu, self.product)


@dataclass(frozen=True)
class _Wanted:
    """A GPU instance the target asks for: its profile and the sizes of its compute instances."""

    profile: MigProfile
    computes: tuple[int, ...]  # slices of each compute instance, largest first
    names: tuple[str, ...]  # the MIG device name of each


@dataclass(frozen=True)
class _Placed:
    wanted: _Wanted
    placement: tuple[int, int]
    kept: Optional[GpuInstance] = None


Geometry = tuple[bool, tuple[tuple[str, int], ...]]  # MIG enabled, MIG device profile -> count (sorted)


class Refused(Exception):
    pass


NOT_SELECTED = "no entry of the config selects this GPU"


def plans_for(gpus: Sequence[Gpu], entries: Sequence[MigConfigEntry]) -> list[GpuPlan]:
    """Each GPU's plan for a config's entries (the last entry selecting a GPU applies)."""
    return [_plan_gpu(gpu, entry_for(tuple(entries), gpu.index, gpu.pci_device_id, gpu.pci_subsystem_id))
            for gpu in gpus]


def not_applied(plans: Sequence[GpuPlan]) -> list[str]:
    """Why the config is not what the GPUs have now, one line per GPU; empty when it is (mig assert).
    As with mig-parted, every GPU must be selected by an entry."""
    reasons = []
    for plan in plans:
        if plan.refused:
            reasons.append(plan.refused)
        elif plan.changes:
            reasons.append(f"{plan.name}: {len(plan.changes)} change(s) needed: "
                           + "; ".join(change.describe() for change in plan.changes[:4])
                           + ("; ..." if len(plan.changes) > 4 else ""))
        elif plan.note == NOT_SELECTED:
            reasons.append(f"{plan.name}: {NOT_SELECTED}")
    return reasons


def gpu_name(index: int, product: str) -> str:
    """`GPU 2 (A100-SXM4-40GB)`, as the operator reads nvidia-smi."""
    return f"GPU {index} ({product.removeprefix('NVIDIA ')})"


def plan_gpu(gpu: Gpu, entry: Optional[MigConfigEntry]) -> GpuPlan:
    """The changes that give `gpu` the geometry `entry` asks for (None: no entry selects it)."""
    base = GpuPlan(gpu.index, gpu.uuid, gpu.product)
    mig = gpu.mig
    if entry is None:
        return _with(base, note=NOT_SELECTED)
    if not mig.capable:
        if entry.mig_enabled and entry.devices == "all":
            return _with(base, skipped=f"{base.name}: not MIG-capable; {entry.where} (devices: all) enables MIG "
                                       "on the MIG-capable GPUs only, as mig-parted does")
        if entry.mig_enabled:
            return _with(base, refused=f"{base.name} is not MIG-capable; its entry ({entry.where}) enables MIG")
        return _with(base, note="not MIG-capable")
    base = _with(base, target=(entry.mig_enabled, tuple(sorted(entry.wanted.items())) if entry.mig_enabled else ()))
    if not entry.mig_enabled:
        if not mig.enabled and not mig.pending_enabled:
            return base
        return _with(base, changes=(*_destroy_all(gpu), SetMigMode(gpu.index, gpu.uuid, False)))
    try:
        wanted = _wanted(gpu, entry)
        placed = _layout(gpu, wanted)
    except Refused as exc:
        return _with(base, refused=f"{base.name}: {exc}")
    changes: list[Change] = []
    if not mig.enabled:
        changes.append(SetMigMode(gpu.index, gpu.uuid, True))
    changes += _changes(gpu, placed)
    return _with(base, changes=tuple(changes))



# The mig stage plans every GPU each pass and the geometry rarely changes. A plan depends on nothing but
# the GPU as NVML read it and its config entry (all frozen), so the same pair is planned once: hashing
# them costs a few microseconds, planning a GPU with MIG devices a fraction of a millisecond.
_plan_gpu = functools.lru_cache(maxsize=256)(plan_gpu)


def _with(plan: GpuPlan, **fields: object) -> GpuPlan:
    return replace(plan, **fields)  # type: ignore[arg-type]


# --- what the entry asks for -------------------------------------------------------------------


def _wanted(gpu: Gpu, entry: MigConfigEntry) -> list[_Wanted]:
    by_profile: dict[int, list[tuple[int, str]]] = {}
    profiles: dict[int, MigProfile] = {}
    for name, count in entry.wanted.items():
        device = parse_profile(name)
        profile = _gi_profile(gpu, device)
        sizes = compute_sizes(profile.slices)
        if device.c not in sizes:
            raise Refused(f"{device}: a {profile.slices}-slice GPU instance has compute instances of "
                          f"{', '.join(map(str, sizes))} slices")
        profiles[profile.id] = profile
        by_profile.setdefault(profile.id, []).extend([(device.c, str(device))] * count)
    wanted = []
    for profile_id, computes in by_profile.items():
        profile = profiles[profile_id]
        for packed in _pack(profile.slices, sorted(computes, key=lambda c: (-c[0], c[1]))):
            wanted.append(_Wanted(profile, tuple(c for c, _ in packed), tuple(n for _, n in packed)))
    _check_capacity(gpu, wanted)
    return sorted(wanted, key=_order)


def _gi_profile(gpu: Gpu, device: ProfileName) -> MigProfile:
    for profile in gpu.mig.profiles:
        try:
            if parse_profile(profile.name).gpu_instance == device.gpu_instance:
                return profile
        except ValueError:  # a profile name NVML may add one day that the grammar does not know
            continue
    known = ", ".join(p.name for p in gpu.mig.profiles)
    raise Refused(f"no MIG profile {device.gpu_instance}; this GPU has {known}")


def _pack(slices: int, computes: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Compute instances into GPU instances of `slices` compute slices: each goes into the first GPU
    instance that has room at an allowed start, else into a new one."""
    instances: list[list[tuple[int, str]]] = []
    for compute in computes:
        for instance in instances:
            if _starts(slices, [c for c, _ in instance] + [compute[0]]) is not None:
                instance.append(compute)
                break
        else:
            instances.append([compute])
    return instances


def _starts(slices: int, sizes: list[int], fixed: tuple[tuple[int, int], ...] = ()) -> Optional[list[int]]:
    """A start for each compute instance size (in the given order) that overlaps neither another nor the
    `fixed` (start, size) ones, lowest starts first; None when they do not fit."""
    used = [False] * slices
    for start, size in fixed:
        for s in range(start, start + size):
            used[s] = True
    found = []
    for size in sizes:
        free = next((s for s in compute_starts(slices, size) if not any(used[s:s + size])), None)
        if free is None:
            return None
        used[free:free + size] = [True] * size
        found.append(free)
    return found


def _check_capacity(gpu: Gpu, wanted: list[_Wanted]) -> None:
    """The refusals that need no placement search, with the numbers an operator can check."""
    memory = _memory_slices(gpu)
    compute = max(p.slices for p in gpu.mig.profiles)
    counts: dict[str, int] = {}
    for w in wanted:
        counts[w.profile.name] = counts.get(w.profile.name, 0) + 1
    summary = " + ".join(f"{n}x {name}" for name, n in counts.items())
    needed = sum(w.profile.placements[0][1] for w in wanted if w.profile.placements)
    if needed > memory:
        raise Refused(f"{summary} needs {needed} of {memory} memory slices")
    used = sum(w.profile.slices for w in wanted)
    if used > compute:
        raise Refused(f"{summary} needs {used} of {compute} compute slices")
    for w in wanted:
        if counts[w.profile.name] > w.profile.instances:
            raise Refused(f"{counts[w.profile.name]}x {w.profile.name} asked for, at most {w.profile.instances}")


def _memory_slices(gpu: Gpu) -> int:
    return max((start + size for p in gpu.mig.profiles for start, size in p.placements), default=0)


def _order(w: _Wanted) -> tuple[int, int, int, tuple[int, ...]]:
    """Largest first: memory slices, compute slices, then the profile id and compute instances."""
    size = w.profile.placements[0][1] if w.profile.placements else 0
    return (-size, -w.profile.slices, w.profile.id, tuple(-c for c in w.computes))


# --- where each GPU instance goes --------------------------------------------------------------


def _layout(gpu: Gpu, wanted: list[_Wanted]) -> list[_Placed]:
    """Keep as many existing GPU instances as leave room for the rest (those whose compute instances
    already match first), then place the rest; Refused when nothing fits."""
    wanted_profiles = {w.profile.id for w in wanted}
    candidates = sorted((gi for gi in gpu.mig.gpu_instances if gi.profile_id in wanted_profiles),
                        key=lambda gi: gi.placement)
    for count in range(len(candidates), -1, -1):
        options = []
        for keep in combinations(candidates, count):
            matched = _match(keep, wanted)
            if matched is not None:
                options.append(matched)
        options.sort(key=lambda m: -sum(1 for p in m[0] if p.kept is not None and _same_computes(p)))
        for kept, rest in options:
            taken = [p.placement for p in kept]
            placed = _place(rest, taken)
            if placed is not None:
                return kept + placed
    counts: dict[str, int] = {}
    for w in wanted:
        counts[w.profile.name] = counts.get(w.profile.name, 0) + 1
    summary = " + ".join(f"{n}x {name}" for name, n in counts.items())
    starts = "; ".join(f"{name} starts at {', '.join(str(s) for s, _ in p.placements)}"
                       for name, p in {w.profile.name: w.profile for w in wanted}.items())
    raise Refused(f"no placement fits {summary} ({starts})")


def _match(keep: tuple[GpuInstance, ...], wanted: list[_Wanted]) -> Optional[tuple[list[_Placed], list[_Wanted]]]:
    """Pair each kept GPU instance with a wanted one of its profile (the same compute instances first)."""
    rest = list(wanted)
    kept = []
    for gi in keep:
        same = [w for w in rest if w.profile.id == gi.profile_id]
        if not same:
            return None
        sizes = sorted((ci.slices for ci in gi.compute_instances), reverse=True)
        choice = next((w for w in same if list(w.computes) == sizes), same[0])
        rest.remove(choice)
        kept.append(_Placed(choice, gi.placement, gi))
    return kept, rest


def _same_computes(placed: _Placed) -> bool:
    assert placed.kept is not None
    return sorted((ci.slices for ci in placed.kept.compute_instances), reverse=True) == list(placed.wanted.computes)


def _place(rest: list[_Wanted], taken: list[tuple[int, int]]) -> Optional[list[_Placed]]:
    """Placements for `rest` (largest first, lowest start first) beside `taken`, by backtracking."""
    if not rest:
        return []
    first, others = rest[0], rest[1:]
    for placement in first.profile.placements:
        if any(_overlaps(placement, other) for other in taken):
            continue
        placed = _place(others, taken + [placement])
        if placed is not None:
            return [_Placed(first, placement)] + placed
    return None


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


# --- the changes ---------------------------------------------------------------------------------


def _destroy_all(gpu: Gpu) -> list[Change]:
    changes: list[Change] = []
    for gi in gpu.mig.gpu_instances:
        changes += [_destroy_compute(gpu, gi, ci) for ci in gi.compute_instances]
    changes += [_destroy_gpu_instance(gpu, gi) for gi in gpu.mig.gpu_instances]
    return changes


def _destroy_compute(gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> DestroyComputeInstance:
    return DestroyComputeInstance(gpu.index, gpu.uuid, gi.id, ci.id, ci.profile, gi.placement, ci.placement[0])


def _destroy_gpu_instance(gpu: Gpu, gi: GpuInstance) -> DestroyGpuInstance:
    return DestroyGpuInstance(gpu.index, gpu.uuid, gi.id, gi.profile, gi.placement)


def _changes(gpu: Gpu, placed: list[_Placed]) -> list[Change]:
    kept_ids = {p.kept.id for p in placed if p.kept is not None}
    destroy_ci: list[Change] = []
    create_ci: list[Change] = []
    for p in placed:
        if p.kept is None:
            continue
        keep, missing = _keep_computes(gpu, p)
        for ci in p.kept.compute_instances:
            if ci not in keep:
                destroy_ci.append(_destroy_compute(gpu, p.kept, ci))
        create_ci += missing
    gone = [gi for gi in gpu.mig.gpu_instances if gi.id not in kept_ids]
    for gi in gone:
        destroy_ci += [_destroy_compute(gpu, gi, ci) for ci in gi.compute_instances]
    destroy_gi: list[Change] = [_destroy_gpu_instance(gpu, gi) for gi in gone]
    create_gi: list[Change] = []
    new = sorted((p for p in placed if p.kept is None), key=lambda p: (_order(p.wanted), p.placement))
    for p in new:
        create_gi.append(CreateGpuInstance(gpu.index, gpu.uuid, p.wanted.profile.name, p.wanted.profile.id,
                                           p.placement))
        starts = _starts(p.wanted.profile.slices, list(p.wanted.computes))
        assert starts is not None  # packed so that they fit
        create_ci += [CreateComputeInstance(gpu.index, gpu.uuid, p.placement, name, size, start)
                      for size, name, start in zip(p.wanted.computes, p.wanted.names, starts)]
    return destroy_ci + destroy_gi + create_gi + create_ci


def _keep_computes(gpu: Gpu, placed: _Placed) -> tuple[list[ComputeInstance], list[Change]]:
    """Of a kept GPU instance's compute instances, those that stay, and the ones to create beside them."""
    assert placed.kept is not None
    gi, wanted = placed.kept, placed.wanted
    remaining = list(zip(wanted.computes, wanted.names))
    keep: list[ComputeInstance] = []
    for ci in sorted(gi.compute_instances, key=lambda ci: (-ci.slices, ci.placement)):
        match = next((w for w in remaining if w[0] == ci.slices and w[1] == ci.profile), None)
        if match is not None:
            remaining.remove(match)
            keep.append(ci)
    fixed = tuple(ci.placement for ci in keep)
    starts = _starts(wanted.profile.slices, [size for size, _ in remaining], fixed)
    if starts is None:  # the kept ones are in the way: start this GPU instance's compute instances afresh
        keep, remaining = [], list(zip(wanted.computes, wanted.names))
        starts = _starts(wanted.profile.slices, [size for size, _ in remaining])
        assert starts is not None
    create: list[Change] = [CreateComputeInstance(gpu.index, gpu.uuid, gi.placement, name, size, start)
                            for (size, name), start in zip(remaining, starts)]
    return keep, create



def plan_restore(gpu: Gpu, saved: Checkpoint) -> GpuPlan:
    """The changes that put a GPU back to a checkpoint, placements included (a rollback)."""
    base = GpuPlan(gpu.index, gpu.uuid, gpu.product)
    mig = gpu.mig
    if not saved.enabled:
        if not mig.enabled and not mig.pending_enabled:
            return base
        return _with(base, changes=(*_destroy_all(gpu), SetMigMode(gpu.index, gpu.uuid, False)))
    by_placement = {s.placement: s for s in saved.gpu_instances}
    destroy_ci: list[Change] = []
    destroy_gi: list[Change] = []
    create_ci: list[Change] = []
    restored = set()
    for gi in mig.gpu_instances:
        s = by_placement.get(gi.placement)
        if s is None or s.profile_id != gi.profile_id:
            destroy_ci += [_destroy_compute(gpu, gi, ci) for ci in gi.compute_instances]
            destroy_gi.append(_destroy_gpu_instance(gpu, gi))
            continue
        restored.add(gi.placement)
        missing = list(s.compute_instances)
        for ci in gi.compute_instances:
            match = next((c for c in missing if (c.slices, c.start) == (ci.slices, ci.placement[0])), None)
            if match is None:
                destroy_ci.append(_destroy_compute(gpu, gi, ci))
            else:
                missing.remove(match)
        create_ci += [CreateComputeInstance(gpu.index, gpu.uuid, gi.placement, c.profile, c.slices, c.start)
                      for c in missing]
    create_gi: list[Change] = []
    for s in saved.gpu_instances:
        if s.placement in restored:
            continue
        create_gi.append(CreateGpuInstance(gpu.index, gpu.uuid, s.profile, s.profile_id, s.placement))
        create_ci += [CreateComputeInstance(gpu.index, gpu.uuid, s.placement, c.profile, c.slices, c.start)
                      for c in s.compute_instances]
    mode: list[Change] = [] if mig.enabled else [SetMigMode(gpu.index, gpu.uuid, True)]
    return _with(base, changes=tuple(mode + destroy_ci + destroy_gi + create_gi + create_ci))
