"""A GPU's whole MIG state, saved before it is changed so a failure can put it back.

Kept in the agent's ledger (/var/lib/gpu-agent/ledger.json, `mig_checkpoints`, by GPU UUID) from before
the GPU's first NVML change until the change was made or undone, with the geometry the change was making.
A checkpoint an interrupted change left behind (the agent was killed mid-apply) is kept by the next
change while the GPU is not what that change was making: it is the geometry from before both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.host import ledger as ledger_file
from gpu_agent.host.ledger import Ledger, LedgerError
from gpu_agent.host.paths import Root
from gpu_agent.nvml.model import MigState

CHECKPOINT_DIR = "/var/lib/gpu-agent/mig/checkpoints"


@dataclass(frozen=True)
class SavedComputeInstance:
    profile: str
    slices: int
    start: int


@dataclass(frozen=True)
class SavedGpuInstance:
    profile: str
    profile_id: int
    placement: tuple[int, int]
    compute_instances: tuple[SavedComputeInstance, ...]


@dataclass(frozen=True)
class Checkpoint:
    """What a GPU's MIG geometry was: the mode, and every GPU instance with its compute instances."""

    enabled: bool
    gpu_instances: tuple[SavedGpuInstance, ...]

    @classmethod
    def of(cls, mig: MigState) -> Checkpoint:
        return cls(mig.enabled, tuple(
            SavedGpuInstance(gi.profile, gi.profile_id, gi.placement,
                             tuple(SavedComputeInstance(ci.profile, ci.slices, ci.placement[0])
                                   for ci in gi.compute_instances))
            for gi in mig.gpu_instances))

    def geometry(self) -> tuple[bool, tuple[tuple[str, int], ...]]:
        """(MIG enabled, MIG device profile -> count), as mig.export.geometry gives a GPU's."""
        counts: dict[str, int] = {}
        for gi in self.gpu_instances if self.enabled else ():
            for ci in gi.compute_instances:
                counts[ci.profile] = counts.get(ci.profile, 0) + 1
        return self.enabled, tuple(sorted(counts.items()))

    def to_json(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "gpu_instances": [
            {"profile": gi.profile, "profile_id": gi.profile_id, "placement": list(gi.placement),
             "compute_instances": [{"profile": ci.profile, "slices": ci.slices, "start": ci.start}
                                   for ci in gi.compute_instances]}
            for gi in self.gpu_instances]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Checkpoint:
        return cls(bool(data["enabled"]), tuple(
            SavedGpuInstance(str(gi["profile"]), int(gi["profile_id"]),
                             (int(gi["placement"][0]), int(gi["placement"][1])),
                             tuple(SavedComputeInstance(str(ci["profile"]), int(ci["slices"]), int(ci["start"]))
                                   for ci in gi["compute_instances"]))
            for gi in data["gpu_instances"]))


class CheckpointStore:
    """The ledger's mig_checkpoints; every call may raise LedgerError (an AgentError naming the file)."""

    def __init__(self, root: Root) -> None:
        self.ledger = Ledger(root)

    def save(self, gpu_uuid: str, gpu_index: int, checkpoint: Checkpoint,
             toward: Optional[tuple[bool, tuple[tuple[str, int], ...]]]) -> None:
        """Record the GPU's state before a change toward the geometry `toward`, unless a change killed
        midway recorded one: the GPU is not what that change was making, so its checkpoint is the
        geometry from before both. One whose change did finish (killed before it was cleared) is replaced."""
        now = _geometry_json(checkpoint.geometry())
        self.ledger.save_mig_checkpoint(gpu_uuid, {
            "gpu": gpu_index, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "checkpoint": checkpoint.to_json(), "toward": _geometry_json(toward) if toward is not None else None},
            keep=lambda earlier: earlier.get("toward") != now)

    def load(self, gpu_uuid: str) -> Optional[Checkpoint]:
        """The saved checkpoint; None when there is none."""
        entry = self.ledger.mig_checkpoint(gpu_uuid)
        if entry is None:
            return None
        try:
            return Checkpoint.from_json(entry["checkpoint"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise LedgerError(f"{ledger_file.PATH}: mig_checkpoints.{gpu_uuid}: not a MIG checkpoint gpu-agent "
                              f"wrote ({type(exc).__name__}: {exc}); the GPU's previous geometry is unknown: "
                              "remove the entry and set the geometry by hand") from None

    def clear(self, gpu_uuid: str) -> None:
        self.ledger.clear_mig_checkpoint(gpu_uuid)

    @staticmethod
    def where(gpu_uuid: str) -> str:
        return f"{ledger_file.PATH} (mig_checkpoints.{gpu_uuid})"


def _geometry_json(geometry: tuple[bool, tuple[tuple[str, int], ...]]) -> dict[str, Any]:
    """As a mig-parted entry writes it: {"mig-enabled": true, "mig-devices": {"1g.10gb": 2}}."""
    return {"mig-enabled": geometry[0], "mig-devices": dict(geometry[1])}
