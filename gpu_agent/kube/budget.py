"""The node's budget of Kubernetes API requests: at most 12 a minute, whatever happens.

It belongs to the agent, not to a client: the composition root makes one and hands it to every
client it builds, so a reload that builds a new client does not start a fresh minute.
"""
from __future__ import annotations

import threading
import time
from collections import deque

RATE = 12  # requests per minute
WINDOW_S = 60.0


class RequestBudget:
    def __init__(self, per_minute: int = RATE) -> None:
        self.per_minute = per_minute
        self._sent: deque[float] = deque()
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Spend one request now; False, and nothing spent, when the last minute used them all."""
        with self._lock:
            now = time.monotonic()
            while self._sent and now - self._sent[0] > WINDOW_S:
                self._sent.popleft()
            if len(self._sent) >= self.per_minute:
                return False
            self._sent.append(now)
            return True
