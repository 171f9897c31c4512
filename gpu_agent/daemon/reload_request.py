"""`gpu-agent driver reload` handed to the running daemon: the command writes a request file and sends
SIGHUP; the daemon takes the request at its next pass, runs the reload sequence whatever driver.reload
says, and writes the outcome to a result file the command waits for. Both files live under /run (gone at
a reboot, as the lock is); nothing that changes the host is reachable over the HTTP endpoint.

A request not taken within REQUEST_TTL_S is void: the command withdraws it and says the agent did not
answer, and an agent that finds one older (left by a command killed before it could withdraw it) drops it,
so a reload nobody waits for any more never starts.
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from gpu_agent.daemon.engine import StageRun
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.stages.driver_reload import ABANDONED, DONE, FAILED, Reload, abandoned

log = logging.getLogger(__name__)

REQUEST = "/run/gpu-agent/driver-reload.request"
RESULT = "/run/gpu-agent/driver-reload.result"
REQUEST_TTL_S = 120.0  # a reconcile pass (a MIG change with GPU resets) takes less; the agent takes it after one


@dataclass
class ReloadRequest:
    force: bool = False
    timeout: Optional[float] = None  # how long to wait for the GPUs to be idle; None: driver.reload_wait_seconds
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    at: float = field(default_factory=time.time)  # when it was written
    abort: Optional[str] = None  # `--abort`: who asked; the reload under way ends

    def age(self) -> float:
        return time.time() - self.at


@dataclass
class Outcome:
    ok: bool
    message: str
    id: str = ""


def write_request(root: Root, request: ReloadRequest) -> None:
    atomic_write(root(REQUEST), json.dumps(asdict(request)) + "\n", 0o600)


def take_request(root: Root) -> Optional[ReloadRequest]:
    """The request waiting, removed; None when there is none, it is not one or it is stale (said in the log;
    a stale one's result says so too)."""
    path = root(REQUEST)
    try:
        text = path.read_text()
        path.unlink()  # whoever removes it has it: the agent, or the command withdrawing it
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.error("driver reload request %s unreadable: %s", REQUEST, exc)
        return None
    try:
        request = _parse(text)
    except ValueError as exc:
        log.error("driver reload request %s ignored: not a request (%s)", REQUEST, exc)
        return None
    if not 0 <= request.age() <= REQUEST_TTL_S:
        log.error("driver reload request %s ignored: written %.0f s ago, the command that wrote it gave up "
                  "after %g s", REQUEST, request.age(), REQUEST_TTL_S)
        write_result(root, Outcome(False, f"the request was stale ({request.age():.0f} s old): ignored", request.id))
        return None
    return request


def pending_request(root: Root) -> Optional[ReloadRequest]:
    """The request waiting for the agent, left where it is; None when there is none or it is not one."""
    try:
        return _parse(root(REQUEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def withdraw_request(root: Root, request_id: str) -> bool:
    """Remove this request if the agent has not taken it; True when it was still waiting."""
    pending = pending_request(root)
    if pending is None or pending.id != request_id:
        return False
    try:
        root(REQUEST).unlink()
    except FileNotFoundError:
        return False  # the agent took it just now
    return True


def _parse(text: str) -> ReloadRequest:
    try:
        data = json.loads(text)
        request = ReloadRequest(force=data["force"], timeout=data["timeout"], id=data["id"], at=data["at"],
                                abort=data.get("abort"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(request.force, bool) and isinstance(request.id, str) and _seconds(request.at)
            and (request.timeout is None or (_seconds(request.timeout) and request.timeout >= 0))
            and (request.abort is None or isinstance(request.abort, str))):
        raise ValueError("a field of the wrong type")
    return request


def _seconds(value: Any) -> bool:
    """A number of seconds that arithmetic on floats takes: not inf or NaN, nor an integer too big for a
    float (its age, or a wait's deadline, would raise OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def write_result(root: Root, outcome: Outcome) -> None:
    atomic_write(root(RESULT), json.dumps(asdict(outcome)) + "\n", 0o600)


def read_result(root: Root, request_id: str) -> Optional[Outcome]:
    """The daemon's outcome for this request, removed once read; None while it has none."""
    path = root(RESULT)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("id") != request_id:
        return None
    path.unlink(missing_ok=True)
    return Outcome(bool(data.get("ok")), str(data.get("message", "")), request_id)


def progress_of(reload: Reload) -> Optional[dict[str, Any]]:
    progress = reload.progress()
    return asdict(progress) if progress is not None else None


def outcome(reload: Reload, runs: Sequence[StageRun], before: Optional[dict[str, Any]],
            abort: bool = False) -> Optional[Outcome]:
    """Whether the requested reload (or abort) is over after this pass, and how; None while it goes on.
    `before`: the ledger's record when the request came (a reload that ended earlier is not this one's)."""
    progress = reload.progress()
    record = asdict(progress) if progress is not None else None
    if progress is not None and record != before or progress is not None and progress.step == FAILED and not abort:
        if progress.step == DONE:
            notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
            return Outcome(True, f"driver reloaded {progress.loaded} -> {progress.target}{notes}")
        if progress.step == ABANDONED:
            return Outcome(not progress.cordoned, abandoned(progress) + ("; the node stays cordoned: its uncordon "
                                                                       "failed" if progress.cordoned else ""))
        if progress.step == FAILED:
            cordoned = "; the node stays cordoned" if progress.cordoned else ""
            return Outcome(False, f"driver {progress.what()} failed at {progress.failed_step}: "
                                  f"{progress.failure}{cordoned}")
        return None
    driver = next((run for run in runs if run.stage == "driver"), None)
    if driver is None:
        return Outcome(False, "the driver stage did not run")
    if abort:
        return Outcome(True, "no driver reload is under way: nothing to abort")
    if driver.state == "ok":
        return Outcome(True, f"nothing to reload: {driver.message}")
    return Outcome(False, f"no reload: {driver.message}")
