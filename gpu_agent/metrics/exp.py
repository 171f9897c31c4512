"""dcgm-exporter's own series (metrics.exporter_series), from what the agent already reads, with the names,
types and labels of dcgm-exporter 4.5.3-4.8.2 (internal/pkg/collector/{xid,clock_events,gpu_health,
p2p_status}_collector.go and expcollector.go at 691c927). Its default-counters.csv lists all four
commented out, as counters; so does the agent, and it writes them only when named.

- DCGM_EXP_XID_ERRORS_COUNT: per XID seen in the last metrics.xid_count_window_seconds, how many times
  (labels xid and window_size_in_ms); a GPU without one has a single series of 0 without xid.
- DCGM_EXP_CLOCK_EVENTS_COUNT: per clock event reason, how many of the window's samples had it (labels
  clock_event and window_size_in_ms); none in the window: a single 0 without clock_event. dcgm-exporter
  counts DCGM's samples of the field; the agent counts its own (metrics.sample_interval_seconds).
- DCGM_EXP_GPU_HEALTH_STATUS: per health watch, 0 (pass), 10 (warn) or 20 (fail), with health_watch and
  health_error_code, from the agent's own health verdicts (docs/metrics.md says which watch each
  feeds); DCGM's health engine is not there to ask.
- DCGM_EXP_P2P_STATUS: per other GPU (peer_gpu), NVML's NVLink P2P status and its name (link_status).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from gpu_agent.health.policy import GPU_CHECKS
from gpu_agent.nvml.model import GpuHealth

XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
CLOCK_EVENTS_COUNT = "DCGM_EXP_CLOCK_EVENTS_COUNT"
HEALTH_STATUS = "DCGM_EXP_GPU_HEALTH_STATUS"
P2P_STATUS = "DCGM_EXP_P2P_STATUS"


@dataclass(frozen=True)
class ExpSeries:
    name: str
    help: str
    per_gpu_instance: bool  # also written for each GPU instance of a MIG GPU, with the GPU's values


SERIES = {
    XID_COUNT: ExpSeries(XID_COUNT, "How many times each XID was reported in the counting window.", True),
    CLOCK_EVENTS_COUNT: ExpSeries(CLOCK_EVENTS_COUNT, "How many samples in the counting window had each clock "
                                  "event reason.", True),
    HEALTH_STATUS: ExpSeries(HEALTH_STATUS, "Health of each watched GPU subsystem: 0 pass, 10 warn, 20 fail.",
                             False),
    P2P_STATUS: ExpSeries(P2P_STATUS, "NVLink peer-to-peer status towards each other GPU (0: OK).", False),
}
KIND = "counter"  # as default-counters.csv declares each of them

# DCGM's clock event reason bits and the names dcgm-exporter gives them (its clockEventToString).
CLOCK_EVENTS = ((0x1, "gpu_idle"), (0x2, "clocks_setting"), (0x4, "power_cap"), (0x8, "hw_slowdown"),
                (0x10, "sync_boost"), (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"),
                (0x100, "display_clocks"))
# The health watches dcgm-exporter writes, in its order (gpuHealthChecks).
HEALTH_WATCHES = ("PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER", "DRIVER", "ALL")
PASS, WARN, FAIL = 0, 10, 20  # DCGM_HEALTH_RESULT_*
OK = "DCGM_FR_OK"
# NVML's nvmlGpuP2PStatus_t by number, as dcgm-exporter names them (p2pStatusToString); past the end: Unknown.
LINK_STATUS = ("OK", "ChipsetNotSupported", "GPUNotSupported", "TopologyNotSupported", "DisabledByRegKey",
               "NotSupported", "Unknown")
MAX_HISTORY = 8192  # (when, reasons) samples kept per GPU for the clock events window


def window_label(seconds: float) -> dict[str, str]:
    return {"window_size_in_ms": str(int(seconds * 1000))}


def xid_rows(log: tuple[tuple[float, int], ...], now: float, window: float) -> Iterator[tuple[dict[str, str], int]]:
    counts: dict[int, int] = {}
    for at, xid in log:
        if at >= now - window:
            counts[xid] = counts.get(xid, 0) + 1
    if not counts:
        yield window_label(window), 0
    for xid, count in sorted(counts.items()):
        yield {**window_label(window), "xid": str(xid)}, count


def clock_event_rows(history: tuple[tuple[float, int], ...], now: float,
                     window: float) -> Iterator[tuple[dict[str, str], int]]:
    counts = {name: sum(1 for at, reasons in history if at >= now - window and reasons & bit)
              for bit, name in CLOCK_EVENTS}
    seen = [(name, count) for name, count in counts.items() if count]
    if not seen:
        yield window_label(window), 0
    for name, count in seen:
        yield {**window_label(window), "clock_event": name}, count


def health_verdicts(health: Optional[GpuHealth]) -> dict[str, tuple[int, str]]:
    """(result, error code) of the watches the agent's verdicts speak for; the others pass."""
    found: dict[str, tuple[int, str]] = {}
    if health is None:
        return found
    if health.lost:
        found["ALL"] = (FAIL, "DCGM_FR_FALLEN_OFF_BUS")
    elif health.xid_reason:
        found["ALL"] = (FAIL, "DCGM_FR_XID_ERROR")
    if health.query_error and not health.lost:
        found["DRIVER"] = (FAIL, "DCGM_FR_NVML_API")
    failing = {name for name in GPU_CHECKS if f"{name}: " in health.check_reason}
    if "row-remap-failure" in failing:
        found["MEM"] = (FAIL, "DCGM_FR_ROW_REMAP_FAILURE")
    elif "row-remap-pending" in failing:
        pages = "retire" in health.check_reason.split("row-remap-pending: ", 1)[1].split(";", 1)[0]
        found["MEM"] = (WARN, "DCGM_FR_PENDING_PAGE_RETIREMENTS" if pages else "DCGM_FR_PENDING_ROW_REMAP")
    if "temperature" in failing:
        found["THERMAL"] = (WARN, "DCGM_FR_TEMP_VIOLATION")
    return found


def health_rows(health: Optional[GpuHealth]) -> Iterator[tuple[dict[str, str], int]]:
    verdicts = health_verdicts(health)
    for watch in HEALTH_WATCHES:
        result, code = verdicts.get(watch, (PASS, OK))
        yield {"health_watch": watch, "health_error_code": code}, result


def p2p_rows(peers: tuple[tuple[int, int], ...]) -> Iterator[tuple[dict[str, str], int]]:
    for peer, status in peers:
        name = LINK_STATUS[status] if 0 <= status < len(LINK_STATUS) else LINK_STATUS[-1]
        yield {"peer_gpu": str(peer), "link_status": name}, status
