"""GPU health from XID events: a thread blocks in NVML's event wait and records what it sees."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.nvml.client import Nvml, describe
from gpu_agent.nvml.model import GpuHealth, XidEvent
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

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

_WAIT_MS = 500
_RETRY_S = 5.0


class XidWatcher:
    def __init__(self, nvml: Nvml, state: AgentState, on_change: Callable[[], None]) -> None:
        self.nvml = nvml
        self.state = state
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xid-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        watched: Optional[tuple[str, ...]] = None
        wait: Optional[Callable[[int], Optional[XidEvent]]] = None
        while not self._stop.is_set():
            inventory = self.state.inventory
            if inventory is None or not inventory.gpus:
                self._stop.wait(1.0)
                continue
            uuids = tuple(gpu.uuid for gpu in inventory.gpus)
            try:
                if wait is None or uuids != watched:
                    wait, watched = self.nvml.watch_xids(), uuids
                event = wait(_WAIT_MS)
            except (AgentError, self.nvml.lib.NVMLError) as exc:
                message = describe(exc) if isinstance(exc, self.nvml.lib.NVMLError) else str(exc)
                log.warning("XID events unavailable (%s); retrying in %.0f s", message, _RETRY_S)
                wait = None
                self._stop.wait(_RETRY_S)
                continue
            if event is not None:
                self.record(event)

    def record(self, event: XidEvent) -> None:
        health = self.state.health.setdefault(event.gpu_uuid, GpuHealth())
        health.last_xid = event.xid
        # Replaced, not mutated: HTTP handlers read this dict on another thread.
        health.xid_counts = {**health.xid_counts, event.xid: health.xid_counts.get(event.xid, 0) + 1}
        meaning = XID_MEANINGS.get(event.xid, "see NVIDIA's XID catalog")
        if event.xid in self.state.config.config.health.ignored_xids:
            log.info("GPU %s: XID %d (%s), caused by an application; GPU stays healthy",
                     event.gpu_uuid, event.xid, meaning)
        else:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event.at))
            health.xid_reason = f"XID {event.xid} ({meaning}) at {when}"
            log.error("GPU %s unhealthy: XID %d (%s); drain the node and reset the GPU",
                      event.gpu_uuid, event.xid, meaning)
        self.on_change()
