"""Holds the device plugin off while the driver is reloaded: the kubelet sees the resources go, and
they come back (registered again) once the new driver serves the GPUs. Set from a stage's worker
thread; the daemon's listener wakes the plugin on the event loop. The reload sets it from its ledger
record, so a daemon restarted mid-reload holds the plugin off from its first pass."""
from __future__ import annotations

from typing import Callable, Optional


class PluginGate:
    def __init__(self) -> None:
        self.closed: Optional[str] = None  # why the plugin is held off; None: it may serve
        self.closures = 0  # how many times it closed: a plugin that did not see one still registers again
        self.listener: Callable[[], None] = lambda: None

    def close(self, reason: str) -> None:
        if self.closed != reason:
            if self.closed is None:
                self.closures += 1
            self.closed = reason
            self.listener()

    def open(self) -> None:
        if self.closed is not None:
            self.closed = None
            self.listener()
