"""Holds the device plugin off while the driver is reloaded: the kubelet sees the resources go, and
they come back (registered again) once the new driver serves the GPUs. Set from a stage's worker
thread; the daemon's listener wakes the plugin on the event loop. The reload sets it from its ledger
record, so a daemon restarted mid-reload holds the plugin off from its first pass.

It also carries the GPUs the vfio stage takes from the container path (`withdraw`): the plugin leaves them
out of its lists and says, after each sync, which it has left out (`applied`), so the stage unbinds a GPU only
once the kubelet has been sent lists without it (`wait_withdrawn`); and those whose binding it changes
(`leaving`), which the metrics sampler does not read."""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional


class PluginGate:
    def __init__(self) -> None:
        self.closed: Optional[str] = None  # why the plugin is held off; None: it may serve
        self.closures = 0  # how many times it closed: a plugin that did not see one still registers again
        self.listener: Callable[[], None] = lambda: None
        self.withdrawn: frozenset[str] = frozenset()  # PCI addresses (0000:9a:00.0) not to advertise
        # The GPUs the vfio stage switches, or switched, between nvidia and vfio-pci (its ledger's): NVML stops or
        # starts seeing them before the pass's discovery, so the sampler leaves them alone.
        self.leaving: frozenset[str] = frozenset()
        self._serving = False  # a device plugin runs and says what it has left out
        self._applied: frozenset[str] = frozenset()
        self._changed = threading.Condition()

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

    def withdraw(self, addresses: Iterable[str]) -> None:
        """From now on the container path advertises none of `addresses` (the others again)."""
        wanted = frozenset(addresses)
        with self._changed:
            if wanted == self.withdrawn:
                return
            self.withdrawn = wanted
        self.listener()

    def serving(self, running: bool) -> None:
        """The device plugin starts (True) or stops (False) answering for its lists."""
        with self._changed:
            self._serving, self._applied = running, frozenset()
            self._changed.notify_all()

    def applied(self, addresses: Iterable[str]) -> None:
        """The plugin: the lists it serves now (and has sent on every ListAndWatch) leave out `addresses`."""
        with self._changed:
            self._applied = frozenset(addresses)
            self._changed.notify_all()

    def wait_withdrawn(self, address: str, timeout_s: float) -> bool:
        """Whether the plugin's lists leave `address` out (at once where no plugin runs), waiting up to
        `timeout_s` for its next sync."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._serving or address in self._applied, timeout_s)
