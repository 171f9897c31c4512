"""What an XID means for a GPU's health, and when an unhealthy GPU is healthy again.

Pure functions of a GpuHealth, the health settings and the time: the XID watcher and the sampler
apply them; tests call them with a clock of their own.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from gpu_agent.config.schema import HealthConfig
from gpu_agent.nvml.model import GpuHealth

XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    68: "video decoder exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

LOST_XIDS = frozenset({79})
NVML_RESPONSIVE = "nvml-responsive"  # the periodic checks' names, as /readyz?verbose shows them
GPU_CHECKS = ("row-remap-pending", "row-remap-failure", "temperature")
_THEN = "; then "  # the GPU is gone from the bus: time alone does not bring it back


def meaning(xid: int) -> str:
    return XID_MEANINGS.get(xid, "see NVIDIA's XID catalog")


def is_critical(xid: int, settings: HealthConfig) -> bool:
    """As the device plugin decides: critical unless ignored, and extra_critical_xids win over ignored_xids
    (`all` in either: every XID)."""
    extra, ignored = settings.extra_critical_xids, settings.ignored_xids
    return extra == "all" or xid in extra or not (ignored == "all" or xid in ignored)


def after_xid(health: GpuHealth, xid: int, at: float, settings: HealthConfig, when: str) -> GpuHealth:
    """The GPU's health once XID `xid` is seen at `at` (the clock's time; `when` is how it is shown)."""
    counts = dict(health.xid_counts)
    counts[xid] = counts.get(xid, 0) + 1
    seen = replace(health, last_xid=xid, xid_counts=tuple(sorted(counts.items())))
    if not is_critical(xid, settings):
        return seen
    reason = f"XID {xid} ({meaning(xid)}) at {when}"
    if health.lost and xid not in LOST_XIDS:  # still lost: a later XID does not make it less so
        reason = f"{health.xid_reason.split(_THEN)[0]}{_THEN}{reason}"
    # Missing already when NVML failed to answer for it before the event came (the sampler got there first).
    missing = (health.missing and health.lost) or (xid in LOST_XIDS and bool(health.query_error))
    return replace(seen, xid_reason=reason, critical_at=at, lost=health.lost or xid in LOST_XIDS, missing=missing)


def recovers_at(health: GpuHealth, settings: HealthConfig) -> Optional[float]:
    """When an XID-unhealthy GPU is healthy again if nothing new happens; None when time alone will not
    do it (a lost GPU) or it is not XID-unhealthy."""
    if not health.xid_reason or health.lost or health.critical_at is None:
        return None
    return health.critical_at + settings.recover_after_seconds


def recovered_in_time(health: GpuHealth, now: float, settings: HealthConfig) -> bool:
    due = recovers_at(health, settings)
    return due is not None and now >= due


def cleared(health: GpuHealth) -> GpuHealth:
    """Healthy again as far as XIDs go (the counts and the last XID stay, for the metrics)."""
    return replace(health, xid_reason="", critical_at=None, lost=False, missing=False)


def gates_readiness(failing: int, total: int, settings: HealthConfig) -> bool:
    """Whether `failing` unhealthy GPUs out of `total` make the node unready (health.unready_when)."""
    return failing > 0 and (settings.unready_when == "any" or failing >= total)


def after_reset(health: GpuHealth) -> GpuHealth:
    """Right after a GPU reset: an XID no longer counts against it. A lost GPU still has to answer
    again at its bus id, which the next sample checks."""
    if health.lost:
        return replace(health, missing=True)
    return cleared(health)
