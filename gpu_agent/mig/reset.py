"""Resetting one GPU so a pending MIG mode takes effect (Ampere). Only the GPUs that need it, never all.

When a reset cannot happen, ResetImpossible says why and whether the agent can still do it itself:
- `until_reboot=False`: a condition that goes away on its own (a process that will exit): the GPU stays
  `pending` and the next pass tries the reset again;
- `until_reboot=True`: only a reboot applies the pending mode (nvidia_drm holds every GPU, the reset
  itself failed): the GPU is `rebooting`. The pending mode survives the reboot and takes effect at boot.
"""
from __future__ import annotations

from typing import Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.modules import KernelModules
from gpu_agent.host.paths import Root


class ResetImpossible(AgentError):
    """The GPU cannot be reset now; the message says why and what would allow it."""

    def __init__(self, message: str, until_reboot: bool = True) -> None:
        super().__init__(message)
        self.until_reboot = until_reboot


class GpuReset(Protocol):
    def blocker(self, index: int, bus_id: str) -> Optional[ResetImpossible]:
        """What is known, without trying, to stop a reset of the GPU now; None when it may work."""

    def reset(self, index: int, bus_id: str) -> None:
        """Reset the GPU; ResetImpossible when something holds it."""


class NvidiaSmiReset:
    """`nvidia-smi --gpu-reset -i N`, refused up front when nvidia_drm is loaded (it holds every GPU)."""

    def __init__(self, root: Root, timeout: float) -> None:
        self.root = root
        self.timeout = timeout

    def blocker(self, index: int, bus_id: str) -> Optional[ResetImpossible]:
        if not self.root.is_running_system:
            return ResetImpossible(f"GPU {index} ({bus_id}) is not reset while --root is {self.root.path}",
                                   until_reboot=False)
        if "nvidia_drm" in KernelModules(self.root).loaded():
            return ResetImpossible(f"GPU {index} ({bus_id}) cannot be reset while nvidia_drm is loaded; "
                                   "reboot the node (or unload nvidia_drm) for the MIG mode change")
        return None

    def reset(self, index: int, bus_id: str) -> None:
        blocked = self.blocker(index, bus_id)
        if blocked is not None:
            raise blocked
        try:
            done = proc.run(["nvidia-smi", "--gpu-reset", "-i", str(index)], timeout=self.timeout)
        except AgentError as exc:  # nvidia-smi missing, or the reset hung
            raise ResetImpossible(f"{exc}; reboot the node for the MIG mode change") from None
        if done.returncode != 0:
            raise ResetImpossible(f"nvidia-smi --gpu-reset -i {index} failed: {done.output or done.returncode}; "
                                  "reboot the node for the MIG mode change")
