"""A GPU's whole MIG state, saved before it is changed so a failure can put it back.

Kept under /var/lib/gpu-agent/mig/checkpoints/<GPU UUID>.json until the change succeeded or was undone.
The interface is three calls (save, load, clear) so it can move onto the agent-wide ledger unchanged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.host.files import atomic_write, read_text
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
    def __init__(self, root: Root) -> None:
        self.root = root

    def _path(self, gpu_uuid: str) -> Any:
        safe = "".join(c for c in gpu_uuid if c.isalnum() or c in "-_")
        return self.root(f"{CHECKPOINT_DIR}/{safe}.json")

    def save(self, gpu_uuid: str, checkpoint: Checkpoint) -> None:
        atomic_write(self._path(gpu_uuid), json.dumps(checkpoint.to_json(), indent=1, sort_keys=True) + "\n",
                     mode=0o600)

    def load(self, gpu_uuid: str) -> Optional[Checkpoint]:
        """The saved checkpoint; None when there is none or it cannot be read (then there is nothing to undo)."""
        text = read_text(self._path(gpu_uuid))
        if text is None:
            return None
        try:
            return Checkpoint.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    def clear(self, gpu_uuid: str) -> None:
        try:
            self._path(gpu_uuid).unlink()
        except FileNotFoundError:
            pass
