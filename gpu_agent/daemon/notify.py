"""sd_notify: READY, STATUS, WATCHDOG, RELOADING and STOPPING for systemd (Type=notify)."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import sdnotify

from gpu_agent.numbers import decimal
from gpu_agent.printable import printable

log = logging.getLogger(__name__)


class Notifier:
    """Talks to systemd when NOTIFY_SOCKET is set; a no-op otherwise (a terminal, a test without it)."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        if self._sd is not None and self._sd.socket is not None:
            # A full notify queue must drop a message, never block the event loop (and with it
            # /healthz and SIGTERM); the next STATUS or WATCHDOG follows within seconds.
            self._sd.socket.setblocking(False)
        self._status: Optional[str] = None

    def _send(self, *lines: str) -> None:
        if self._sd is not None:  # one assignment a line: a newline in a status would add another (READY=1)
            self._sd.notify("\n".join(printable(line) for line in lines))

    def ready(self, status: str) -> None:
        self._status = status
        self._send("READY=1", f"STATUS={status}")

    def status(self, line: str) -> None:
        """Send STATUS= only when the line changed."""
        if line != self._status:
            self._status = line
            self._send(f"STATUS={line}")

    def reloading(self) -> None:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}", "STATUS=reloading configuration")
        self._status = None

    def stopping(self) -> None:
        self._send("STOPPING=1", "STATUS=stopping")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def watchdog_interval(self) -> Optional[float]:
        """Half of WATCHDOG_USEC when systemd watches this process, else None."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        microseconds = decimal(usec or "")
        if not self.enabled or not microseconds or (pid and pid != str(os.getpid())):
            return None
        return microseconds / 2 / 1_000_000
