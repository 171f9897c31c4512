"""XID events through NVML: every GPU registered in one event set, waited on with a timeout."""
from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Optional

from gpu_agent.nvml.model import XidEvent
from gpu_agent.nvml.session import NvmlHung, NvmlSession, NvmlUnavailable, describe

log = logging.getLogger(__name__)

_NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId when it is not on a MIG device


class NvmlEvents:
    def __init__(self, session: NvmlSession) -> None:
        self.session = session

    def watch_xids(self) -> XidWait:
        """Register for XID events every GPU NVML answers for (one it does not answer for is that GPU's
        fact: the others are watched); returns wait(timeout_ms) -> event or None."""
        self.session.init()
        lib = self.session.lib
        event_set = self.session.call("nvmlEventSetCreate")
        uuids: dict[int, tuple[Any, str]] = {}
        for index in range(self.session.count()):
            try:
                handle = self.session.handle(index)
                self.session.call("nvmlDeviceRegisterEvents", handle, lib.nvmlEventTypeXidCriticalError, event_set)
            except lib.NVMLError_NotSupported:
                log.warning("GPU %d does not report XID events; its health is not watched", index)
                continue
            except lib.NVMLError as exc:
                log.warning("GPU %d: XID events not watched until NVML answers for it again: %s", index,
                            describe(exc))
                continue
            try:
                uuids[_handle_key(handle)] = (handle, self.session.call("nvmlDeviceGetUUID", handle))
            except lib.NVMLError:
                pass  # registered: an event of it asks NVML for its UUID then
        return XidWait(self.session, event_set, uuids)


def _handle_key(handle: Any) -> int:
    """What identifies a device handle across NVML calls: the address it points to (pynvml hands out a
    new pointer object for the same device), or the object's identity for a simulated one (the registered
    handles are kept alive beside their keys, so no other object can take that identity)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or id(handle)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class XidWait:
    """A registered NVML event set: wait(timeout_ms) returns the next XID event or None."""

    def __init__(self, session: NvmlSession, event_set: Any, uuids: dict[int, tuple[Any, str]]) -> None:
        self._call = session.call
        self._lib = session.lib
        self._event_set = event_set
        self._uuids = uuids  # by handle, read at registration: a GPU that fell off the bus may not answer

    def __call__(self, timeout_ms: int) -> Optional[XidEvent]:
        try:
            data = self._call("nvmlEventSetWait_v2", self._event_set, timeout_ms, extra_timeout=timeout_ms / 1000)
        except self._lib.NVMLError_Timeout:
            return None
        if data.eventType != self._lib.nvmlEventTypeXidCriticalError:
            return None
        gi, ci = (getattr(data, name, _NO_INSTANCE) for name in ("gpuInstanceId", "computeInstanceId"))
        known = self._uuids.get(_handle_key(data.device))
        uuid = known[1] if known else self._call("nvmlDeviceGetUUID", data.device)
        return XidEvent(gpu_uuid=uuid, xid=data.eventData, at=time.time(),
                        gpu_instance_id=None if gi == _NO_INSTANCE else gi,
                        compute_instance_id=None if ci == _NO_INSTANCE or gi == _NO_INSTANCE else ci)

    def free(self) -> None:
        try:
            self._call("nvmlEventSetFree", self._event_set)
        except (self._lib.NVMLError, NvmlHung, NvmlUnavailable) as exc:  # let go: shutdown freed it
            log.debug("nvmlEventSetFree: %s", exc)
