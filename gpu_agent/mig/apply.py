"""Carrying out MIG plans, one GPU at a time, with a checkpoint and a rollback per GPU.

- A GPU that runs compute processes is never changed unless `force`; the refusal names the PIDs and
  process names (NVML's list, names from the process table under --root).
- Before the first change, the GPU's whole MIG state is checkpointed in the agent's ledger (one that a
  change killed midway left there stays: gpu_agent.mig.checkpoint). Any failure restores that
  checkpoint (placements included) instead of leaving the GPU empty, and says so.
- A mode change NVML leaves pending (Ampere) resets that GPU alone. When it cannot be reset, its instances
  wait and the GPU is `pending` while the agent can still reset it itself at a later pass (compute
  processes use it: it is reset once they exit), or `rebooting` when only a reboot applies the mode
  (nvidia_drm is loaded, the GPU is passed through into a VM, the reset failed). A mode already pending
  is not set again: a later pass only retries the reset.
- GPUs are independent: one GPU's failure does not undo another's success.
- Optional systemd units are stopped before the first change and started after the last, failure included.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.host import processes
from gpu_agent.mig.checkpoint import Checkpoint, CheckpointStore
from gpu_agent.mig.hooks import Hooks
from gpu_agent.mig.planner import GpuPlan, gpu_name, plan_restore
from gpu_agent.mig.reset import GpuReset, ResetImpossible
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlHung, describe
from gpu_agent.nvml.model import Gpu
from gpu_agent.plan import (
    Change,
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    SetMigMode,
)

log = logging.getLogger(__name__)

UNCHANGED, CREATED, DESTROYED, MODE_CHANGED, FAILED, RESTORED, SKIPPED = (
    "unchanged", "created", "destroyed", "mode-changed", "failed", "restored", "skipped")
# What a dry run says it would do, for each of the actions above that changes a GPU.
WOULD = {CREATED: "would-create", DESTROYED: "would-destroy", MODE_CHANGED: "would-change-mode"}
SUCCESS, PENDING, REBOOTING = "success", "pending", "rebooting"  # a GPU's state; with FAILED the node's
ALREADY_PENDING = "asked for earlier, not yet in effect"


@dataclass(frozen=True)
class Waiting:
    """A mode change that waits for a GPU reset: `pending` (the agent retries) or `rebooting`, and why."""

    state: str
    reason: str


@dataclass(frozen=True)
class GpuResult:
    gpu: int
    uuid: str
    product: str
    action: str  # unchanged | created | destroyed | mode-changed | failed | restored | skipped, or a dry run's WOULD
    state: str  # success | pending | rebooting | failed
    mutations: int  # NVML calls that changed the GPU, rollback included
    reason: str
    changes: tuple[Change, ...] = ()  # planned (dry run) or made

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "uuid": self.uuid, "product": self.product, "action": self.action,
                "state": self.state, "mutations": self.mutations, "reason": self.reason,
                "changes": [change.to_json() for change in self.changes]}


class Applier:
    def __init__(self, nvml: Nvml, reset: GpuReset, checkpoints: CheckpointStore, root: Root,
                 force: bool = False) -> None:
        self.nvml = nvml
        self.reset = reset
        self.checkpoints = checkpoints
        self.root = root
        self.force = force

    def apply_all(self, gpus: Sequence[Gpu], plans: Sequence[GpuPlan], dry_run: bool = False,
                  hooks: Optional[Hooks] = None) -> list[GpuResult]:
        by_index = {gpu.index: gpu for gpu in gpus}
        results: dict[int, GpuResult] = {}
        for plan in plans if not dry_run else ():
            waiting = self._only_a_reboot(by_index[plan.gpu], plan)
            if waiting:  # settled without touching the GPU or stopping a unit
                results[plan.gpu] = self._result(plan, MODE_CHANGED, REBOOTING, 0, waiting)
        changing = [plan for plan in plans if plan.changes and not plan.refused and plan.gpu not in results]
        if dry_run or not changing or hooks is None:
            return [results.get(plan.gpu) or self.apply(by_index[plan.gpu], plan, dry_run) for plan in plans]
        try:
            hooks.before()
        except AgentError as exc:
            failures = hooks.after()
            reason = f"stopping {', '.join(hooks.units)} before the MIG change failed: {exc}"
            reason += "".join(f"; {failure}" for failure in failures)
            return [self._result(plan, FAILED, FAILED, 0, reason) if plan in changing
                    else results.get(plan.gpu) or self.apply(by_index[plan.gpu], plan) for plan in plans]
        try:
            for plan in plans:
                if plan.gpu not in results:
                    results[plan.gpu] = self.apply(by_index[plan.gpu], plan)
        finally:
            failures = hooks.after()
        if failures:
            for index, result in results.items():
                if result.changes:
                    results[index] = replace(result, reason=f"{result.reason}; " + "; ".join(failures))
        return [results[plan.gpu] for plan in plans]

    def apply(self, gpu: Gpu, plan: GpuPlan, dry_run: bool = False) -> GpuResult:
        if plan.refused:
            return self._result(plan, FAILED, FAILED, 0, plan.refused)
        if plan.skipped:
            return self._result(plan, SKIPPED, SUCCESS, 0, plan.skipped)
        if not plan.changes:
            return self._result(plan, UNCHANGED, SUCCESS, 0, plan.note or "already as configured")
        if dry_run:
            return self._result(plan, WOULD[_action(plan.changes)], SUCCESS, 0,
                                f"would make {len(plan.changes)} NVML change(s)", plan.changes)
        until_reboot = self._only_a_reboot(gpu, plan)
        if until_reboot:
            return self._result(plan, MODE_CHANGED, REBOOTING, 0, until_reboot)
        try:
            busy = self._busy(gpu)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            return self._result(plan, FAILED, FAILED, 0, f"{plan.name}: cannot list its processes: {_reason(exc)}")
        if busy and not self.force:
            return self._result(plan, FAILED, FAILED, 0,
                                f"{plan.name} runs compute processes: {busy}; it is not repartitioned "
                                "while they run (set mig.force: true to do it anyway)")
        try:
            self.checkpoints.save(gpu.uuid, gpu.index, Checkpoint.of(gpu.mig), plan.target)
        except AgentError as exc:
            return self._result(plan, FAILED, FAILED, 0, f"{plan.name}: cannot checkpoint its MIG state, so it "
                                f"is not changed: {exc}")
        done: list[Change] = []
        try:
            waiting = self._run(gpu, plan.changes, done)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            return self._roll_back(gpu, plan, done, _reason(exc))
        self._clear_checkpoint(gpu)
        if waiting is not None:
            return self._result(plan, MODE_CHANGED, waiting.state, len(done), f"{plan.name}: {waiting.reason}",
                                tuple(done))
        return self._result(plan, _action(plan.changes), SUCCESS, len(done), f"made {len(done)} NVML change(s)",
                            tuple(done))

    def _busy(self, gpu: Gpu) -> str:
        """`1234 (python3), 5678 (trainer)` of the compute processes on the GPU; "" when there are none."""
        pids = [pid for pid, _ in self.nvml.inventory.processes(gpu.index)]
        return ", ".join(process.describe() for process in processes.named(self.root, pids))

    def _run(self, gpu: Gpu, changes: Sequence[Change], done: list[Change]) -> Optional[Waiting]:
        """Make the changes in order, appending each one made to `done`; a Waiting when the rest must
        wait for a GPU reset that cannot happen now, else None."""
        ids = {gi.placement: gi.id for gi in gpu.mig.gpu_instances}
        nvml, index = self.nvml, gpu.index
        for change in changes:
            if isinstance(change, SetMigMode):
                if awaits_reset(gpu, change):
                    pending: Optional[str] = ALREADY_PENDING
                else:
                    pending = nvml.mig.set_mode(index, change.enabled)
                    done.append(change)
                if pending is not None:
                    waiting = self._reset(gpu, change.enabled, pending)
                    if waiting is not None:
                        return waiting
                ids = {}  # a mode change leaves no instance behind
            elif isinstance(change, CreateGpuInstance):
                ids[change.placement] = nvml.mig.create_gpu_instance(index, change.profile_id, change.placement)
                done.append(change)
            elif isinstance(change, CreateComputeInstance):
                nvml.mig.create_compute_instance(index, ids[change.gpu_instance], change.slices, change.start)
                done.append(change)
            elif isinstance(change, DestroyComputeInstance):
                nvml.mig.destroy_compute_instance(index, change.gpu_instance_id, change.compute_instance_id)
                done.append(change)
            elif isinstance(change, DestroyGpuInstance):
                nvml.mig.destroy_gpu_instance(index, change.gpu_instance_id)
                ids.pop(change.placement, None)
                done.append(change)
            else:
                raise AgentError(f"{change.describe()}: not a MIG change")
        return None

    def _only_a_reboot(self, gpu: Gpu, plan: GpuPlan) -> str:
        """Why only a reboot can apply the mode change already pending on the GPU, learnt without touching
        it, so a later pass stops no unit for a reset that cannot happen; "" when a reset may work."""
        if plan.refused or not plan.changes or not awaits_reset(gpu, plan.changes[0]):
            return ""
        change = plan.changes[0]
        assert isinstance(change, SetMigMode)
        waiting = self._cannot_reset(gpu, change.enabled, ALREADY_PENDING)
        return f"{plan.name}: {waiting.reason}" if waiting is not None and waiting.state == REBOOTING else ""

    def _cannot_reset(self, gpu: Gpu, enabled: bool, pending: str) -> Optional[Waiting]:
        """Why the GPU cannot be reset for its pending mode now, or None when it may be."""
        waiting = f"MIG {'enable' if enabled else 'disable'} is pending a GPU reset ({pending})"
        try:
            passthrough = self.nvml.health.passthrough(gpu.index)
            busy = "" if passthrough else self._busy(gpu)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            return Waiting(PENDING, f"{waiting}; whether it can be reset is unknown: {_reason(exc)}")
        if passthrough:
            return Waiting(REBOOTING, f"{waiting}: it is passed through into this VM, which cannot reset it; "
                                      "reboot the VM for the MIG mode change")
        if busy:
            return Waiting(PENDING, f"{waiting}: compute processes use it: {busy}; it is reset once they exit")
        blocker = self.reset.blocker(gpu.index, gpu.pci_bus_id)
        if blocker is not None:
            return Waiting(REBOOTING if blocker.until_reboot else PENDING, f"{waiting}: {blocker}")
        return None

    def _reset(self, gpu: Gpu, enabled: bool, pending: str) -> Optional[Waiting]:
        """Reset a GPU whose new mode is pending; None once it took effect, else why it still waits."""
        waiting = self._cannot_reset(gpu, enabled, pending)
        if waiting is not None:
            return waiting
        mode = "enable" if enabled else "disable"
        try:
            self.reset.reset(gpu.index, gpu.pci_bus_id)
        except ResetImpossible as exc:
            return Waiting(REBOOTING if exc.until_reboot else PENDING,
                           f"MIG {mode} is pending a GPU reset ({pending}): {exc}")
        if self.nvml.mig.state(gpu.index).enabled != enabled:
            return Waiting(REBOOTING, f"MIG {mode} is still pending after a GPU reset; reboot the node")
        log.info("%s: reset for MIG %s", gpu_name(gpu.index, gpu.product), mode)
        return None

    def _roll_back(self, gpu: Gpu, plan: GpuPlan, done: list[Change], failure: str) -> GpuResult:
        try:
            saved = self.checkpoints.load(gpu.uuid)
        except AgentError as exc:
            return self._result(plan, FAILED, FAILED, len(done), f"{plan.name}: {failure}; its checkpoint "
                                f"cannot be read: {exc}", tuple(done))
        made = len(done)
        if saved is None or not done:
            self._clear_checkpoint(gpu)
            return self._result(plan, FAILED, FAILED, made, f"{plan.name}: {failure}; nothing was changed"
                                if not done else f"{plan.name}: {failure}; no checkpoint to restore", tuple(done))
        undo: list[Change] = []
        try:
            now = replace(gpu, mig=self.nvml.mig.state(gpu.index))
            restore = plan_restore(now, saved)
            waiting = self._run(now, restore.changes, undo)
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            return self._result(plan, FAILED, FAILED, made + len(undo),
                                f"{plan.name}: {failure}; restoring its previous MIG geometry failed too: "
                                f"{_reason(exc)} (its checkpoint stays in {self.checkpoints.where(gpu.uuid)})",
                                tuple(done))
        self._clear_checkpoint(gpu)
        if waiting is not None:
            return self._result(plan, RESTORED, waiting.state, made + len(undo),
                                f"{plan.name}: {failure}; its previous MIG geometry is restored but "
                                f"{waiting.reason}", tuple(done))
        log.warning("%s: %s; its previous MIG geometry is restored", plan.name, failure)
        return self._result(plan, RESTORED, FAILED, made + len(undo),
                            f"{plan.name}: {failure}; its previous MIG geometry is restored", tuple(done))

    def _clear_checkpoint(self, gpu: Gpu) -> None:
        """Once the change is made or undone; a checkpoint that cannot be cleared is only logged: the next
        change of this GPU keeps it as the geometry to restore."""
        try:
            self.checkpoints.clear(gpu.uuid)
        except AgentError as exc:
            log.warning("%s: %s", gpu_name(gpu.index, gpu.product), exc)

    @staticmethod
    def _result(plan: GpuPlan, action: str, state: str, mutations: int, reason: str,
                changes: tuple[Change, ...] = ()) -> GpuResult:
        return GpuResult(plan.gpu, plan.uuid, plan.product, action, state, mutations, reason, changes)


def _action(changes: Sequence[Change]) -> str:
    if any(isinstance(change, SetMigMode) for change in changes):
        return MODE_CHANGED
    if any(isinstance(change, (CreateGpuInstance, CreateComputeInstance)) for change in changes):
        return CREATED
    return DESTROYED


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (AgentError, NvmlHung)):
        return str(exc)
    return describe(exc) if isinstance(exc, Exception) else str(exc)


def awaits_reset(gpu: Gpu, change: Change) -> bool:
    """Whether `change` is a mode change NVML already holds pending on the GPU (only a reset is left)."""
    return (isinstance(change, SetMigMode) and gpu.mig.pending_enabled == change.enabled
            and gpu.mig.enabled != change.enabled)


def node_state(results: Sequence[GpuResult]) -> str:
    """The node's nvidia.com/mig.config.state: failed if any GPU failed, rebooting if one waits for a reboot,
    pending if one waits for the agent, else success."""
    states = {result.state for result in results}
    for state in (FAILED, REBOOTING, PENDING):
        if state in states:
            return state
    return SUCCESS
