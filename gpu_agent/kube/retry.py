"""What the agent does after a Kubernetes API request fails: the retry policy, as one table.

The API server is shared and its faults pass by themselves (a control-plane upgrade, a leader change,
a busy server shedding load), so they are retried on a schedule of their own: short, capped and
jittered, as the server asks where it says when (Retry-After), and always inside the node's request
budget (kube/budget.py). A conflict is no fault at all: the Node changed since it was read, so it is
read again and written at once. What only a person can fix (credentials, RBAC, the node's name, an
answer that is no Node) is left to the stage's own backoff, which is for faults on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

REREAD = "re-read"  # read the Node again and write at once, in the same pass
WAIT = "wait"  # try again after `delay`, on the API's own schedule
GIVE_UP = "give up"  # the stage's own backoff: a fault a person must fix

# Why a request went wrong without an answer (Failure.cause); with an answer, the status says it.
TIMEOUT = "timeout"  # the request's deadline passed
CONNECTION = "connection"  # refused, reset, unreachable, closed mid-answer
BUDGET = "budget"  # not sent: the node's request budget was spent (the agent's own limit)

CONFLICT_RETRIES = 3  # re-reads after a 409 in one write (client-go's RetryOnConflict makes 5 tries)
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)  # after the 1st, 2nd, 3rd, and every later failed request in a row
JITTER = 0.2  # each delay is shortened by up to a fifth, so that nodes do not retry in step
RETRY_AFTER_MAX_S = 60.0  # a Retry-After beyond this is taken as this

# By HTTP status: the reason a failed request is retried (the retries metric's label), and whether the
# server's Retry-After says when. Every other 5xx is a "server-error"; every other status gives up.
_STATUSES: dict[int, tuple[str, bool]] = {
    408: (TIMEOUT, False),
    409: ("conflict", False),
    429: ("throttled", True),
    500: ("server-error", False),
    502: ("server-error", False),
    503: ("unavailable", True),
    504: (TIMEOUT, False),
}
_CAUSES = {TIMEOUT: TIMEOUT, CONNECTION: CONNECTION, BUDGET: BUDGET}


@dataclass(frozen=True)
class Failure:
    """A failed request: the HTTP status (0: no answer), why there was no answer, and the seconds the
    server's Retry-After asked for."""

    status: int
    cause: str = ""
    retry_after: Optional[float] = None


@dataclass(frozen=True)
class Step:
    """What to do next: `action`, after `delay` seconds (WAIT), counted under `reason`."""

    action: str
    reason: str = ""
    delay: float = 0.0


def reason(failure: Failure) -> str:
    """The retries metric's label for a failure the API schedule retries; "" for one that gives up."""
    if failure.status:
        known = _STATUSES.get(failure.status)
        return known[0] if known else ("server-error" if 500 <= failure.status < 600 else "")
    return _CAUSES.get(failure.cause, "")


def backoff(in_a_row: int, jitter: float) -> float:
    """The delay after the `in_a_row`-th failed request in a row; `jitter` in [0, 1) shortens it."""
    return BACKOFF_S[min(max(in_a_row, 1), len(BACKOFF_S)) - 1] * (1 - JITTER * jitter)


def next_step(failure: Failure, in_a_row: int, conflicts: int, jitter: float) -> Step:
    """The policy. `in_a_row`: the failed requests in a row, this one included; `conflicts`: the 409s
    this write met before this one; `jitter`: a random number in [0, 1).

    - 409 Conflict: re-read at once, CONFLICT_RETRIES times in one write; then a first backoff's pause.
    - 429 and 503 with Retry-After: wait as the server says (at most RETRY_AFTER_MAX_S).
    - 429 and 503 without it, 500, 502, 504 and every other 5xx, 408, a timeout, a refused or reset
      connection: wait BACKOFF_S, jittered.
    - Not sent, the node's budget spent: wait for the budget (the caller knows how long).
    - Anything else (4xx, TLS verification, an answer that is no Node): give up to the stage's backoff.

    The caller also waits for the budget after every failure: no wait ends before the budget has room
    for the requests a converging pass needs."""
    why = reason(failure)
    if not why:
        return Step(GIVE_UP)
    if failure.status == 409:
        if conflicts < CONFLICT_RETRIES:
            return Step(REREAD, why)
        return Step(WAIT, why, backoff(1, jitter))  # another writer keeps changing the Node: a short pause
    if why == BUDGET:
        return Step(WAIT, why)
    honours = _STATUSES.get(failure.status, ("", False))[1]
    if honours and failure.retry_after is not None:
        return Step(WAIT, why, min(max(failure.retry_after, 0.0), RETRY_AFTER_MAX_S))
    return Step(WAIT, why, backoff(in_a_row, jitter))


def retry_after_seconds(value: Optional[str]) -> Optional[float]:
    """Retry-After's delay-seconds (RFC 9110 10.2.3), as kube-apiserver sends it; None for a date or
    anything else (the backoff applies then)."""
    text = (value or "").strip()
    if not text.isascii() or not text.isdigit():
        return None
    return RETRY_AFTER_MAX_S if len(text) > 6 else min(float(text), RETRY_AFTER_MAX_S)
