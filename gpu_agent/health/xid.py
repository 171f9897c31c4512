"""GPU health from XID events: a thread blocks in NVML's event wait and records what it sees."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.nvml.client import Nvml, XidWait, describe
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
        self._lock = threading.Lock()
        self._watched: Optional[tuple[str, ...]] = None
        self._wait: Optional[XidWait] = None

    def start(self) -> None:
        """Register for events now (blocking, so none is missed after READY), then watch on a thread."""
        try:
            self._register()
        except (AgentError, self.nvml.lib.NVMLError) as exc:
            self._unavailable(exc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _register(self) -> Optional[XidWait]:
        """The event wait for the GPUs in the inventory, registered again when they change."""
        inventory = self.state.inventory
        uuids = tuple(gpu.uuid for gpu in inventory.gpus) if inventory else ()
        with self._lock:
            if uuids and (self._wait is None or uuids != self._watched):
                if self._wait is not None:
                    self._wait.free()
                self._wait, self._watched = self.nvml.watch_xids(), uuids
            return self._wait if uuids else None

    def _unavailable(self, exc: Exception) -> None:
        message = describe(exc) if isinstance(exc, self.nvml.lib.NVMLError) else str(exc)
        log.warning("XID events unavailable (%s); retrying in %.0f s", message, _RETRY_S)
        with self._lock:
            self._wait = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._register()
                if wait is None:
                    self._stop.wait(_WAIT_MS / 1000)
                    continue
                event = wait(_WAIT_MS)
            except (AgentError, self.nvml.lib.NVMLError) as exc:
                self._unavailable(exc)
                self._stop.wait(_RETRY_S)
                continue
            except Exception:  # a bug: log it, keep watching
                log.exception("XID watcher failed; this is a gpu-agent bug")
                self._stop.wait(_RETRY_S)
                continue
            if event is not None:
                self.record(event)

    def record(self, event: XidEvent) -> None:
        meaning = XID_MEANINGS.get(event.xid, "see NVIDIA's XID catalog")
        ignored = event.xid in self.state.config.config.health.ignored_xids
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event.at))

        def seen(health: GpuHealth) -> GpuHealth:
            counts = dict(health.xid_counts)
            counts[event.xid] = counts.get(event.xid, 0) + 1
            reason = health.xid_reason if ignored else f"XID {event.xid} ({meaning}) at {when}"
            return replace(health, last_xid=event.xid, xid_counts=tuple(sorted(counts.items())), xid_reason=reason)

        self.state.update_health(event.gpu_uuid, seen)
        if ignored:
            log.info("GPU %s: XID %d (%s), caused by an application; GPU stays healthy",
                     event.gpu_uuid, event.xid, meaning)
        else:
            log.error("GPU %s unhealthy: XID %d (%s); drain the node and reset the GPU",
                      event.gpu_uuid, event.xid, meaning)
        self.on_change()
