"""GPU health from XID events: a thread blocks in NVML's event wait, records what it sees, and between
two waits brings back the GPUs whose critical XID is old enough (health.recover_after_seconds)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.threads import daemon_thread
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.events import XidWait
from gpu_agent.nvml.session import describe
from gpu_agent.health.policy import (
    LOST_XIDS,
    after_xid,
    cleared,
    is_critical,
    meaning,
    recovered_in_time,
    recovers_at,
)
from gpu_agent.nvml.model import GpuHealth, XidEvent
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

# At most, between two looks at the inventory and at recoveries: how late a GPU that comes (a driver
# reload, a GPU back on the bus) has its events registered, and a reload's shorter recover_after_seconds
# applies. An event ends the wait at once and a due recovery shortens it. It also bounds how long a driver
# reload's NVML pause waits: a real driver holds nvmlShutdown until the wait in flight returns (an H200:
# 4.5 s behind a 5 s wait), so the wait is short: a wake-up a second of an idle agent's watcher (a queue
# hand-off and one NVML call, some tens of microseconds of CPU).
_WAIT_MS = 1_000
_RETRY_S = 5.0


class XidWatcher:
    def __init__(self, nvml: Nvml, state: AgentState, on_change: Callable[[], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml
        self.state = state
        self.on_change = on_change
        self.clock = clock
        self._stop = threading.Event()
        self._thread = daemon_thread(self._run, "xid-watcher")
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
        """The event wait for the GPUs in the inventory, registered again when they change (a GPU NVML could
        not read, and so not register, is registered once it is read again)."""
        inventory = self.state.inventory
        uuids = tuple(gpu.uuid for gpu in inventory.readable) if inventory else ()
        with self._lock:
            if uuids and (self._wait is None or uuids != self._watched):
                if self._wait is not None:
                    self._wait.free()
                self._wait, self._watched = self.nvml.events.watch_xids(), uuids
            return self._wait if uuids else None

    def _unavailable(self, exc: Exception) -> None:
        message = describe(exc) if isinstance(exc, self.nvml.lib.NVMLError) else str(exc)
        log.warning("XID events unavailable (%s); retrying in %.0f s", message, _RETRY_S)
        with self._lock:
            self._wait = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.recover()
            try:
                wait = self._register()
                if wait is None:
                    self._stop.wait(self._wait_ms() / 1000)
                    continue
                event = wait(self._wait_ms())
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

    def _wait_ms(self) -> int:
        """Until the next GPU is due to recover (it wakes no sooner), at most _WAIT_MS."""
        settings = self.state.config.config.health
        dues = [due for due in (recovers_at(health, settings) for health in self.state.health.values())
                if due is not None]
        if not dues:
            return _WAIT_MS
        return max(1, min(_WAIT_MS, int((min(dues) - self.clock()) * 1000) + 1))

    def record(self, event: XidEvent) -> None:
        """Apply one XID event: an ignored one is counted, a critical one makes the GPU (or the MIG
        devices of the GPU instance NVML attributes it to) unhealthy now."""
        for uuid in self._affected(event):
            self._record_on(uuid, event)
        self.state.note_xid(event.gpu_uuid, event.xid, self.clock())
        self.on_change()

    def _affected(self, event: XidEvent) -> list[str]:
        """The MIG devices of the event's GPU instance (and compute instance, when NVML names one), or
        the whole GPU: for an event not on a MIG device, an instance no longer there, or a lost GPU."""
        inventory = self.state.inventory or self.state.last_inventory
        gpu = next((g for g in inventory.gpus if g.uuid == event.gpu_uuid), None) if inventory else None
        if gpu is None or event.gpu_instance_id is None or event.xid in LOST_XIDS:
            return [event.gpu_uuid]
        devices = [device.uuid for device in gpu.mig.devices if device.gpu_instance_id == event.gpu_instance_id
                   and event.compute_instance_id in (None, device.compute_instance_id)]
        return devices or [event.gpu_uuid]

    def _record_on(self, uuid: str, event: XidEvent) -> None:
        settings = self.state.config.config.health
        now = self.clock()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        before = self.state.health.get(uuid)
        after = self.state.update_health(uuid, lambda health: after_xid(health, event.xid, now, settings, when))
        device = self.state.gpu_name(uuid)
        if not is_critical(event.xid, settings):
            log.info("%s: XID %d (%s), caused by an application; it stays healthy", device, event.xid,
                     meaning(event.xid))
        elif before is None or before.healthy:
            log.error("%s unhealthy: XID %d (%s); %s", device, event.xid, meaning(event.xid), self._outlook(after))
        else:
            log.warning("%s still unhealthy: another XID %d (%s); %s", device, event.xid, meaning(event.xid),
                        self._outlook(after))

    def _outlook(self, health: GpuHealth) -> str:
        due = recovers_at(health, self.state.config.config.health)
        if due is None:
            return "it stays unhealthy until NVML sees it again at its PCI bus id: reset the GPU or reboot"
        return (f"healthy again at {time.strftime('%H:%M:%S', time.localtime(due))} unless another critical XID "
                "comes; if they keep coming, drain the node and reset the GPU")

    def recover(self) -> None:
        """Bring back every GPU whose last critical XID is health.recover_after_seconds old (a lost GPU
        waits for the sampler to find it on the bus again)."""
        settings = self.state.config.config.health
        now = self.clock()
        due = [uuid for uuid, health in self.state.health.items() if recovered_in_time(health, now, settings)]
        for uuid in due:
            after = self.state.update_health(
                uuid, lambda health: cleared(health) if recovered_in_time(health, now, settings) else health)
            if not after.xid_reason:
                log.info("%s: no critical XID for %g s; healthy again as far as XIDs go", self.state.gpu_name(uuid),
                         settings.recover_after_seconds)
        if due:
            self.on_change()
