"""XID events through NVML: every GPU registered in one event set, waited on with a timeout."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from gpu_agent.nvml.model import XidEvent
from gpu_agent.nvml.session import NvmlHung, NvmlSession

log = logging.getLogger(__name__)

_NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId when it is not on a MIG device


class NvmlEvents:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session

    def watch_xids(self) -> XidWait:
        """Register every GPU for XID events; returns wait(timeout_ms) -> event or None."""
        self.session.init()
        lib = self.session.lib
        event_set = self.session.call("nvmlEventSetCreate")
        for index in range(self.session.count()):
            handle = self.session.handle(index)
            try:
                self.session.call("nvmlDeviceRegisterEvents", handle, lib.nvmlEventTypeXidCriticalError, event_set)
            except lib.NVMLError_NotSupported:
                log.warning("GPU %d does not report XID events; its health is not watched", index)
        return XidWait(self.session, event_set)


class XidWait:
    """A registered NVML event set: wait(timeout_ms) returns the next XID event or None."""

    def __init__(self, session: NvmlSession, event_set: Any) -> None:
        self._call = session.call
        self._lib = session.lib
        self._event_set = event_set

    def __call__(self, timeout_ms: int) -> Optional[XidEvent]:
        try:
            data = self._call("nvmlEventSetWait_v2", self._event_set, timeout_ms, extra_timeout=timeout_ms / 1000)
        except self._lib.NVMLError_Timeout:
            return None
        if data.eventType != self._lib.nvmlEventTypeXidCriticalError:
            return None
        gi, ci = (getattr(data, name, _NO_INSTANCE) for name in ("gpuInstanceId", "computeInstanceId"))
        return XidEvent(gpu_uuid=self._call("nvmlDeviceGetUUID", data.device), xid=data.eventData, at=time.time(),
                        gpu_instance_id=None if gi == _NO_INSTANCE else gi,
                        compute_instance_id=None if ci == _NO_INSTANCE or gi == _NO_INSTANCE else ci)

    def free(self) -> None:
        try:
            self._call("nvmlEventSetFree", self._event_set)
        except (self._lib.NVMLError, NvmlHung) as exc:
            log.debug("nvmlEventSetFree: %s", exc)
