"""How the node's Kubernetes API requests are going, whichever client sends them.

Like the request budget it belongs to the agent, not to a client: the composition root makes one, so
a reload that builds new clients keeps the schedule (a Retry-After is honoured by every caller) and
the counts /metrics shows. Each failed request is logged here once, with its status and what happens
next, and so is the recovery; /status shows the state it publishes:

- ok: the last request was answered;
- recovering: requests fail in a way that passes (5xx, 429, timeouts, resets) and are retried on the
  API's own schedule (kube/retry.py), the next one not before `next_attempt`;
- failing: the API refused what only a person can fix (403, 404, a kubeconfig problem); the stage's
  own backoff retries it.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpu_agent.kube import retry
from gpu_agent.kube.budget import RequestBudget

log = logging.getLogger(__name__)

OK, RECOVERING, FAILING = "ok", "recovering", "failing"
REQUESTS_TO_CONVERGE = 3  # a pass that finds the API answering again: GET, the labels' PATCH, the condition's


@dataclass(frozen=True)
class Next:
    """What follows a failed request: retry.REREAD, retry.WAIT until `at` (on the shared clock), or
    retry.GIVE_UP (the stage's own backoff)."""

    action: str
    at: Optional[float] = None


class ApiState:
    def __init__(self, budget: RequestBudget, publish: Optional[Callable[[Optional[dict[str, Any]]], Any]] = None,
                 clock: Optional[Callable[[], float]] = None, jitter: Callable[[], float] = random.random) -> None:
        """`publish`: takes the /status section whenever it changes (AgentState.publish_kube_api);
        `clock`: the unix time (time.time unless a test controls it); `jitter`: a number in [0, 1)."""
        self.budget = budget
        self._publish = publish
        self._clock = clock or time.time
        self._jitter = jitter
        self._lock = threading.Lock()
        self.state: Optional[str] = None  # None: no request answered or failed yet
        self.since: Optional[float] = None  # when `state` began
        self.failed_requests = 0  # in a row
        self.last_error: Optional[str] = None  # while recovering or failing
        self.next_attempt: Optional[float] = None  # while recovering: no request before it
        self.last_outage: Optional[dict[str, Any]] = None  # the last one that ended: how long, how many failed
        self.conflicts = 0
        self.retries: dict[str, int] = {}  # by retry.reason
        self._writes_failing = False  # the outage is of writes: a read's answer does not end it

    def now(self) -> float:
        return self._clock()

    def held(self) -> Optional[tuple[float, str]]:
        """(when the next request may go, the error that set it) while a retry is not due; else None."""
        with self._lock:
            if self.next_attempt is None or self._clock() >= self.next_attempt:
                return None
            return self.next_attempt, self.last_error or ""

    def answered(self, where: str, write: bool) -> None:
        """A request was answered (any 2xx): the API is ok again, unless writes fail and this was a read
        (an admission webhook down: reads answered, every write refused)."""
        with self._lock:
            if self.state == OK or (self._writes_failing and not write):
                return
            now = self._clock()
            if self.state is not None and self.since is not None:
                self.last_outage = {"ended": now, "seconds": round(now - self.since, 3),
                                    "failed_requests": self.failed_requests}
                log.info("Kubernetes API answers again (%s) after %d failed request(s) in %.0f s", where,
                         self.failed_requests, now - self.since)
            self.state, self.since = OK, now
            self.failed_requests, self.last_error, self.next_attempt = 0, None, None
            self._published()

    def failed(self, failure: retry.Failure, message: str, write: bool, conflicts: int = 0) -> Next:
        """A request failed (`message` says how, nothing secret in it); `conflicts`: the 409s the same write
        met before. Counts and logs it once, and says what comes next."""
        with self._lock:
            now = self._clock()
            in_a_row = self.failed_requests + (failure.cause != retry.BUDGET)
            step = retry.next_step(failure, in_a_row, conflicts, self._jitter())
            if step.action == retry.REREAD:
                self.conflicts += 1
                log.info("%s: the Node changed since it was read; reading it again and writing at once "
                         "(conflict %d of at most %d in this write)", message, conflicts + 1, retry.CONFLICT_RETRIES)
                self._published()
                return Next(retry.REREAD)
            if step.action == retry.GIVE_UP:  # the stage that asked logs it, with its own backoff
                self._failing(FAILING, message, write, now)
                self.next_attempt = None
                self._published()
                return Next(retry.GIVE_UP)
            at = now + max(step.delay, self.budget.wait(spare=REQUESTS_TO_CONVERGE - 1))
            self.retries[step.reason] = self.retries.get(step.reason, 0) + 1
            if step.reason != retry.BUDGET:  # the agent's own limit says nothing of the API server
                self._failing(RECOVERING, message, write, now)
                self.next_attempt = at
            log.warning("%s; next attempt in %.1f s (%s, %d failed request(s) in a row)", message, at - now,
                        step.reason, self.failed_requests)
            self._published()
            return Next(retry.WAIT, at)

    def _failing(self, state: str, message: str, write: bool, now: float) -> None:
        if self.state in (None, OK):
            self.since = now
        self.state, self.last_error, self._writes_failing = state, message, write
        self.failed_requests += 1

    def to_json(self) -> Optional[dict[str, Any]]:
        """The /status section; None before the first request."""
        with self._lock:
            return self._json()

    def _json(self) -> Optional[dict[str, Any]]:
        if self.state is None and not self.retries:
            return None
        return {"state": self.state, "since": self.since, "failed_requests": self.failed_requests,
                "last_error": self.last_error, "next_attempt": self.next_attempt, "last_outage": self.last_outage,
                "conflicts": self.conflicts, "retries": dict(sorted(self.retries.items()))}

    def _published(self) -> None:
        if self._publish is not None:
            self._publish(self._json())
