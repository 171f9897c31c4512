"""`gpu-agent driver reload` handed to the running daemon: the command writes a request file and sends
SIGHUP; the daemon takes the request at its next pass, runs the reload sequence whatever driver.reload
says, and writes the outcome to a result file the command waits for. Both files live under /run (gone at
a reboot, as the lock is); nothing that changes the host is reachable over the HTTP endpoint.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from gpu_agent.daemon.engine import StageRun
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.stages.driver_reload import DONE, FAILED, Reload

log = logging.getLogger(__name__)

REQUEST = "/run/gpu-agent/driver-reload.request"
RESULT = "/run/gpu-agent/driver-reload.result"


@dataclass
class ReloadRequest:
    force: bool = False
    timeout: Optional[float] = None  # how long to wait for the GPUs to be idle; None: driver.reload_wait_seconds
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Outcome:
    ok: bool
    message: str
    id: str = ""


def write_request(root: Root, request: ReloadRequest) -> None:
    atomic_write(root(REQUEST), json.dumps(asdict(request)) + "\n", 0o600)


def take_request(root: Root) -> Optional[ReloadRequest]:
    """The request waiting, removed; None when there is none or it is not one (said in the log)."""
    path = root(REQUEST)
    try:
        text = path.read_text()
        path.unlink()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.error("driver reload request %s unreadable: %s", REQUEST, exc)
        return None
    try:
        data = json.loads(text)
        request = ReloadRequest(force=data["force"], timeout=data["timeout"], id=data["id"])
        if not (isinstance(request.force, bool) and isinstance(request.id, str)
                and (request.timeout is None or (isinstance(request.timeout, (int, float)) and request.timeout >= 0))):
            raise TypeError("a field of the wrong type")
    except (ValueError, KeyError, TypeError) as exc:
        log.error("driver reload request %s ignored: not a request (%s)", REQUEST, exc)
        return None
    return request


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


def outcome(reload: Reload, runs: Sequence[StageRun], before: Optional[dict[str, Any]]) -> Optional[Outcome]:
    """Whether the requested reload is over after this pass, and how; None while it goes on. `before`: the
    ledger's record when the request came (a reload that ended earlier is not this one's)."""
    progress = reload.progress()
    record = asdict(progress) if progress is not None else None
    if progress is not None and record != before or progress is not None and progress.step == FAILED:
        if progress.step == DONE:
            notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
            return Outcome(True, f"driver reloaded {progress.loaded} -> {progress.target}{notes}")
        if progress.step == FAILED:
            cordoned = "; the node stays cordoned" if progress.cordoned else ""
            return Outcome(False, f"driver reload to {progress.target} failed at {progress.failed_step}: "
                                  f"{progress.failure}{cordoned}")
        return None
    driver = next((run for run in runs if run.stage == "driver"), None)
    if driver is None:
        return Outcome(False, "the driver stage did not run")
    if driver.state == "ok":
        return Outcome(True, f"nothing to reload: {driver.message}")
    return Outcome(False, f"no reload: {driver.message}")
