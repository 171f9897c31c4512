"""A TimeSlicing claim's interval applied to its whole GPUs, and put back once the claim is unprepared.

As NVIDIA's gpu-kubelet-plugin applies it (cmd/gpu-kubelet-plugin/sharing.go SetTimeSlice and nvlib.go of
kubernetes-sigs/dra-driver-nvidia-gpu at 95932046): the GPU's compute mode DEFAULT (so that the pods sharing
the claim may all run on it), then `nvidia-smi compute-policy -i <uuid> --set-timeslice <n>`, n being 0
for Default, 1 Short, 2 Medium, 3 Long; at unprepare the time-slice is Default again.

NVML has no call that reads or sets a GPU's compute time-slice (only the vGPU scheduler's), so what it was
before cannot be told: like NVIDIA's, the agent takes it to be Default, and a claim asking for Default
changes no time-slice. Unlike NVIDIA's, the compute mode the GPU had is put back.

Each change is recorded in the ledger (`timeslices`, by GPU UUID) before it is made, with the boot it was
made in: a reboot sets both back, so a record of an earlier boot is applied again at the next prepare and
forgotten without a change at unprepare. A record whose claim is no longer prepared is put back at the next
unprepare (a failure there is logged, never the kubelet's error: the pod's end must not wait for a GPU),
and at `gpu-agent uninstall`.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.ledger import Ledger, TimeSlice
from gpu_agent.host.paths import Root
from gpu_agent.host import procfs
from gpu_agent.mps.control import ComputeModes

log = logging.getLogger(__name__)

DEFAULT_MODE = "DEFAULT"
NVIDIA_SMI_TIMEOUT_S = 60.0  # nvidia-smi initialises every GPU without persistence mode: seconds on 8


class TimeSlices(Protocol):
    def set_timeslice(self, uuid: str, level: int) -> None:
        """The GPU's compute time-slice level; an AgentError names the GPU and why not."""


class NvidiaSmiTimeSlices:
    """`nvidia-smi compute-policy -i <uuid> --set-timeslice <level>`, only on the running system."""

    def __init__(self, root: Root, timeout: float = NVIDIA_SMI_TIMEOUT_S) -> None:
        self.root = root
        self.timeout = timeout

    def set_timeslice(self, uuid: str, level: int) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"GPU {uuid}: its time-slice is not set while --root is {self.root.path}")
        argv = ["nvidia-smi", "compute-policy", "-i", uuid, "--set-timeslice", str(level)]
        done = proc.run(argv, timeout=self.timeout)
        if done.returncode != 0:
            raise AgentError(f"{' '.join(argv)} failed: {(done.output or str(done.returncode)).strip()[:300]}")


def boot_id(root: Root) -> str:
    return procfs.boot_id(root) or "unknown"


def apply(ledger: Ledger, modes: ComputeModes, slices: TimeSlices, boot: str, uid: str,
          wanted: Mapping[str, int]) -> None:
    """Each GPU in `wanted` (by UUID: the level its claim `uid` asks for) in compute mode DEFAULT with that
    time-slice; nothing done for one that has it already in this boot. An AgentError names the GPU and why
    (the record stays, not applied: the next prepare sets both again)."""
    records, mps_modes = ledger.timeslices(), ledger.compute_modes()
    for uuid, level in sorted(wanted.items()):
        recorded = records.get(uuid)
        if recorded is not None and recorded.boot != boot:
            ledger.clear_timeslice(uuid)  # a reboot put both back: the mode it had before is the one now
            recorded = None
        if recorded is not None and (recorded.claim, recorded.level, recorded.applied) == (uid, level, True):
            continue
        held = mps_modes.get(uuid)
        if held is not None:
            raise AgentError(f"cannot give GPU {uuid} the time-slice asked for: its compute mode is the MPS control "
                             f"daemon's of {held[1]} until that daemon stops; the kubelet asks again")
        try:
            mode = modes.compute_mode(uuid)
            if recorded is None and mode == DEFAULT_MODE and level == 0:
                continue  # nothing to change, nothing to put back
            before = None if mode == DEFAULT_MODE else mode
            ledger.save_timeslice(uuid, TimeSlice(uid, level, boot, before))  # an earlier record's mode is kept
            if mode != DEFAULT_MODE:
                modes.set_compute_mode(uuid, DEFAULT_MODE)
            if level != 0 or recorded is not None:
                slices.set_timeslice(uuid, level)
            ledger.save_timeslice(uuid, TimeSlice(uid, level, boot, before, applied=True))
        except AgentError as exc:
            raise AgentError(f"cannot give GPU {uuid} the time-slice asked for: {exc}") from None
        log.info("DRA: GPU %s: compute mode %s, time-slice level %d (claim %s)", uuid, DEFAULT_MODE, level, uid)


def put_back(ledger: Ledger, modes: ComputeModes, slices: TimeSlices, boot: str,
             prepared: Optional[set[str]] = None) -> list[str]:
    """The time-slice Default again and the compute mode as it was, on each GPU the ledger holds for a claim
    not in `prepared` (None: every claim); each forgotten once done. Returns what failed (still recorded)."""
    problems, mps_modes = [], ledger.compute_modes()
    for uuid, recorded in sorted(ledger.timeslices().items()):
        if prepared is not None and recorded.claim in prepared:
            continue
        if recorded.boot == boot:
            try:
                if recorded.level != 0:
                    slices.set_timeslice(uuid, 0)
                if recorded.mode_before is not None and uuid not in mps_modes:  # else an MPS daemon's
                    modes.set_compute_mode(uuid, recorded.mode_before)
            except AgentError as exc:
                problems.append(f"cannot put GPU {uuid}'s time-slice and compute mode back (set for DRA claim "
                                f"{recorded.claim}): {exc}")
                continue
        ledger.clear_timeslice(uuid)
    return problems
