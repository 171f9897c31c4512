"""The node's budget of Kubernetes API requests: at most 12 a minute, whatever happens.

It belongs to the agent, not to a client: the composition root makes one and hands it to every
client it builds, so a reload that builds a new client does not start a fresh minute. Kept in the
agent's state directory, it also outlives the process: a daemon that restarts in a loop, or a one-shot
command beside it, spends the same minute.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write

log = logging.getLogger(__name__)

RATE = 12  # requests per minute
WINDOW_S = 60.0
PATH = "/var/lib/gpu-agent/kube-requests.json"  # under --root: {"sent": [unix times of the last minute]}
_MOST_BYTES = 4096  # what RATE times fill, with room; a larger file is not ours


class RequestBudget:
    def __init__(self, per_minute: int = RATE, path: Optional[Path] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
        """`path`: where the last minute's requests are kept across restarts; None: in this process only.
        `clock`: the unix time (time.time unless a test controls it)."""
        self.per_minute = per_minute
        self.path = path
        self._clock = clock
        self._sent: list[float] = []
        self._lock = threading.Lock()
        self._unwritable = False

    def take(self) -> bool:
        """Spend one request now; False, and nothing spent, when the last minute used them all."""
        with self._lock:
            now = self._recent()
            if len(self._sent) >= self.per_minute:
                return False
            self._sent.append(now)
            if self.path is not None:
                self._write(self.path)
            return True

    def wait(self, spare: int = 0) -> float:
        """Seconds until a request may go with `spare` more left in the same minute; 0 when it may now."""
        with self._lock:
            now = self._recent()
            room = max(self.per_minute - 1 - spare, 0)  # requests that may be in the window as this one goes
            if len(self._sent) <= room:
                return 0.0
            return max(sorted(self._sent)[len(self._sent) - room - 1] + WINDOW_S - now, 0.0)

    def _recent(self) -> float:
        """Now, with the requests of the last minute in self._sent (the file's, where there is one)."""
        now = self._clock() if self._clock is not None else time.time()
        if self.path is not None and not self._unwritable:  # else what this process spent is all there is
            self._sent = self._read(self.path, self._sent)
        # A time ahead of now is a clock set back: it no longer says when a request went.
        self._sent = [sent for sent in self._sent if now - WINDOW_S < sent <= now][-self.per_minute:]
        return now

    @staticmethod
    def _read(path: Path, known: list[float]) -> list[float]:
        """The file's times; `known` (this process's) while there is no file; none, with a log line, for a
        file that is not what this class writes."""
        try:
            data = read_bounded(path, _MOST_BYTES, follow=False)
            if data is None:
                return known
            sent = json.loads(data)["sent"]
            if not isinstance(sent, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                                     for t in sent):
                raise ValueError("not a list of times")
            return [float(t) for t in sent]
        except (OSError, NotRegular, TooLarge, ValueError, KeyError, TypeError) as exc:
            log.warning("%s is not a request budget (%s); starting it again", path, exc)
            return []

    def _write(self, path: Path) -> None:
        try:
            atomic_write(path, json.dumps({"sent": self._sent}) + "\n", mode=0o600)
            self._unwritable = False
        except OSError as exc:
            if not self._unwritable:  # once, not per request: the budget still holds in this process
                log.warning("cannot keep the API request budget in %s: %s", path, exc.strerror or exc)
            self._unwritable = True
