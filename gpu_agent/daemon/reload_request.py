"""`gpu-agent driver reload` handed to the running daemon: the command writes a request file of its own and
sends SIGHUP; the daemon takes every request waiting at its next pass, runs the reload sequence whatever
driver.reload says, and writes each request's outcome to a result file of its own, which its command waits
for. Both live in /run (gone at a reboot, as the lock is), one file per command, named by its request's id:
two commands never write the same file. Nothing that changes the host is reachable over the HTTP endpoint.

The requests taken form a queue (ReloadQueue). A request while a reload of its kind is under way joins it:
a reload joins the reload under way (its --force forces it, its --timeout can shorten the wait for idle
GPUs, never lengthen it), an abort joins the abort under way; each of them gets the outcome of the one it
joined. An abort while a reload is under way ends it: the reload's commands get its end (abandoned), the
abort's its own. A reload asked for while an abort is under way begins once the abort is over.

A request not taken within REQUEST_TTL_S is void: the command withdraws it and says the agent did not
answer, and an agent that finds one older (left by a command killed before it could withdraw it) drops it,
so a reload nobody waits for any more never starts. A result left unread for RESULT_TTL_S (its command
killed) is removed when the agent writes another.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from gpu_agent.daemon.engine import StageRun
from gpu_agent.errors import AgentError
from gpu_agent.host import jsontext
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.printable import printable
from gpu_agent.stages.driver_reload import ABANDONED, AGENT, DONE, FAILED, Reload, abandoned

log = logging.getLogger(__name__)

RUN_DIR = "/run/gpu-agent"
REQUEST_NAME = "driver-reload.request."  # + the request's id
RESULT_NAME = "driver-reload.result."  # + the id of the request it answers
REQUEST = f"{RUN_DIR}/{REQUEST_NAME}ID"  # as messages and the docs name them
RESULT = f"{RUN_DIR}/{RESULT_NAME}ID"
REQUEST_TTL_S = 120.0  # a reconcile pass (a MIG change with GPU resets) takes less; the agent takes it after one
RESULT_TTL_S = 3600.0  # a command reads its result within a second of its writing; one older has no reader
MAX_FILE_BYTES = 64 << 10  # a request is 200 bytes, a result a message of a few hundred
MAX_TAKEN = 64  # requests taken in one pass: more wait for the next
_ID = re.compile("[0-9a-f]{32}")


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


def request_path(request_id: str) -> str:
    return f"{RUN_DIR}/{REQUEST_NAME}{request_id}"


def result_path(request_id: str) -> str:
    return f"{RUN_DIR}/{RESULT_NAME}{request_id}"


# --- the command's side ---------------------------------------------------------------------------------


def write_request(root: Root, request: ReloadRequest) -> None:
    atomic_write(root(request_path(request.id)), json.dumps(asdict(request)) + "\n", 0o600)


def waiting(root: Root, request_id: str) -> bool:
    """Whether this request still waits for the agent to take it."""
    return os.path.lexists(root(request_path(request_id)))


def withdraw_request(root: Root, request_id: str) -> bool:
    """Remove this request if the agent has not taken it; True when it was still waiting."""
    try:
        root(request_path(request_id)).unlink()
    except FileNotFoundError:
        return False  # the agent took it
    return True


def read_result(root: Root, request_id: str) -> Optional[Outcome]:
    """The daemon's outcome for this request, removed once read; None while it has none. A result file that
    cannot be read is an outcome too (a failed one, saying why), not something to wait on for ever."""
    shown = result_path(request_id)
    path = root(shown)
    try:
        data = read_bounded(path, MAX_FILE_BYTES, follow=False)
    except NotRegular as exc:
        return Outcome(False, f"{shown}: the agent's outcome cannot be read: it is {exc.kind}", request_id)
    except TooLarge:
        return Outcome(False, f"{shown}: the agent's outcome cannot be read: more than {MAX_FILE_BYTES} bytes",
                       request_id)
    except OSError as exc:
        return Outcome(False, f"{shown}: the agent's outcome cannot be read: {exc.strerror or exc}", request_id)
    if data is None:
        return None
    path.unlink(missing_ok=True)
    try:
        document = jsontext.loads(data.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError) as exc:
        return Outcome(False, f"{shown}: the agent's outcome is not JSON ({exc})", request_id)
    if not isinstance(document, dict) or document.get("id") != request_id or not isinstance(document.get("ok"), bool):
        return Outcome(False, f"{shown}: not the agent's outcome of this request", request_id)
    return Outcome(document["ok"], str(document.get("message", "")), request_id)


# --- the agent's side -----------------------------------------------------------------------------------


def take_requests(root: Root) -> list[ReloadRequest]:
    """The requests waiting, removed, oldest first; what is not a request or is stale is dropped (said in
    the log; a stale one's result says so too)."""
    try:
        names = sorted(name for name in os.listdir(root(RUN_DIR)) if name.startswith(REQUEST_NAME))
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.error("driver reload requests: cannot list %s: %s", RUN_DIR, exc.strerror or exc)
        return []
    taken = [request for request in map(lambda name: _take(root, name), names[:MAX_TAKEN]) if request is not None]
    return sorted(taken, key=lambda request: (request.at, request.id))


def _take(root: Root, name: str) -> Optional[ReloadRequest]:
    shown = printable(f"{RUN_DIR}/{name}")
    path = root(f"{RUN_DIR}/{name}")
    try:
        data = read_bounded(path, MAX_FILE_BYTES, follow=False)
    except (NotRegular, TooLarge, OSError) as exc:
        why = f"it is {exc.kind}" if isinstance(exc, NotRegular) else (
            f"more than {MAX_FILE_BYTES} bytes" if isinstance(exc, TooLarge) else exc.strerror or str(exc))
        _drop(path, shown, why)
        return None
    if data is None:
        return None  # withdrawn just now
    try:
        path.unlink()  # whoever removes it has it: the agent, or the command withdrawing it
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("driver reload request %s ignored: cannot remove it: %s", shown, exc.strerror or exc)
        return None
    request_id = name[len(REQUEST_NAME):]
    try:
        request = _parse(data, request_id)
    except ValueError as exc:
        log.error("driver reload request %s ignored: not a request (%s)", shown, printable(str(exc)))
        return None
    if not 0 <= request.age() <= REQUEST_TTL_S:
        log.error("driver reload request %s ignored: written %.0f s ago, the command that wrote it gave up "
                  "after %g s", shown, request.age(), REQUEST_TTL_S)
        write_result(root, Outcome(False, f"the request was stale ({request.age():.0f} s old): ignored", request.id))
        return None
    return request


_dropped: dict[str, str] = {}  # what could not be removed, and why: said once


def _drop(path: Path, shown: str, why: str) -> None:
    """A request file that cannot be read: removed, said in the log; one that cannot be removed either (a
    directory with something in it) is said once, not at every pass."""
    try:
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        if _dropped.get(shown) != why:
            log.error("driver reload request %s ignored: %s, and it cannot be removed: %s", shown, why,
                      exc.strerror or exc)
            if len(_dropped) > 100:
                _dropped.clear()
            _dropped[shown] = why
        return
    log.error("driver reload request %s ignored and removed: %s", shown, why)


def _parse(data: bytes, request_id: str) -> ReloadRequest:
    try:
        document = jsontext.loads(data.decode("utf-8"), max_digits=jsontext.OWN_DIGITS)
        request = ReloadRequest(force=document["force"], timeout=document["timeout"], id=document["id"],
                                at=document["at"], abort=document.get("abort"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(request.force, bool) and isinstance(request.id, str) and _seconds(request.at)
            and (request.timeout is None or (_seconds(request.timeout) and request.timeout >= 0))
            and (request.abort is None or isinstance(request.abort, str))):
        raise ValueError("a field of the wrong type")
    if request.id != request_id or not _ID.fullmatch(request_id):
        raise ValueError("its id is not its file's")
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
    """The outcome in its request's result file (one that cannot be written is said in the log: its command
    then says the agent gave none); results older than RESULT_TTL_S (nobody reads them) removed."""
    if not _ID.fullmatch(outcome.id):
        return
    _remove_unread(root)
    try:
        atomic_write(root(result_path(outcome.id)), json.dumps(asdict(outcome)) + "\n", 0o600)
    except OSError as exc:
        log.error("driver reload: cannot write %s (%s): %s", result_path(outcome.id), printable(outcome.message),
                  exc.strerror or exc)


def _remove_unread(root: Root) -> None:
    try:
        names = [name for name in os.listdir(root(RUN_DIR)) if name.startswith(RESULT_NAME)]
    except OSError:
        return
    for name in names:
        path = root(f"{RUN_DIR}/{name}")
        try:
            if time.time() - path.lstat().st_mtime > RESULT_TTL_S:
                path.unlink()
        except OSError:
            pass  # read and removed by its command meanwhile, or not ours to remove


@dataclass
class _Waiters:
    """Requests answered with one outcome: those of a reload, or of an abort, since `before` (the record
    when the first of them came: a reload that ended earlier is not theirs)."""

    abort: bool
    before: Optional[dict[str, Any]]
    requests: list[ReloadRequest]


class ReloadQueue:
    """The requests the agent has taken: the reload (or abort) under way, with the requests that joined it,
    and those that wait for its end. `begin` makes the running stages take a request (the driver stage's
    Reload, told to reload or to abort); `end` puts them back when nothing is under way any more."""

    def __init__(self, root: Root, begin: Callable[[ReloadRequest], Reload], end: Callable[[Reload], None]) -> None:
        self.root = root
        self._begin = begin
        self._end = end
        self.reload: Optional[Reload] = None
        self._groups: list[_Waiters] = []
        self._queued: list[ReloadRequest] = []

    @property
    def under_way(self) -> bool:
        return self.reload is not None

    def take(self) -> bool:
        """The requests waiting taken; True when what is under way began or changed (the next pass is forced)."""
        self._queued += take_requests(self.root)
        return self._advance()

    def conclude(self, runs: Sequence[StageRun]) -> bool:
        """After a pass: each group of requests whose reload or abort is over answered; True when a request
        that waited for it began (a forced pass is due)."""
        if self.reload is None:
            return False
        for group in list(self._groups):
            over = outcome(self.reload, runs, group.before, abort=group.abort)
            if over is not None:
                self._answer(group, over)
        if self._groups:
            return False
        self._end(self.reload)
        self.reload = None
        return self._advance()

    def _advance(self) -> bool:
        """The requests taken, in their order, begun or joined to what is under way, up to one that must wait
        for its end (a reload behind an abort)."""
        changed = False
        while self._queued:
            request = self._queued[0]
            if not self._place(request):
                break
            self._queued.pop(0)
            changed = True
        return changed

    def _place(self, request: ReloadRequest) -> bool:
        aborting = request.abort is not None
        what = f"abort requested by {request.abort}" if aborting else "requested"
        same = next((group for group in self._groups if group.abort == aborting), None)
        if self.reload is None:
            log.info("driver reload %s (force: %s)", what, request.force)
            try:
                self.reload = self._begin(request)
            except AgentError as exc:
                write_result(self.root, Outcome(False, str(exc), request.id))
                return True
            self._groups = [_Waiters(aborting, progress_of(self.reload), [request])]
        elif same is not None and (aborting or not any(group.abort for group in self._groups)):
            log.info("driver reload %s (force: %s): it joins the %s under way", what, request.force,
                     "abort" if aborting else "reload")
            same.requests.append(request)
            if not aborting:
                self.reload.force = self.reload.force or request.force
                if request.timeout is not None:
                    self.reload.wait_seconds = min(self.reload.wait_seconds, request.timeout)
        elif aborting:
            log.info("driver reload %s: the reload under way ends", what)
            try:
                self.reload = self._begin(request)
            except AgentError as exc:
                write_result(self.root, Outcome(False, str(exc), request.id))
                return True
            before = progress_of(self.reload)
            if before is None:  # the reload has not begun: it never will
                for group in list(self._groups):
                    self._answer(group, Outcome(False, f"the driver reload was aborted before it began, by "
                                                       f"{request.abort}"))
            self._groups.append(_Waiters(True, before, [request]))
        else:
            return False  # a reload behind an abort: it begins once the abort is over
        return True

    def _answer(self, group: _Waiters, over: Outcome) -> None:
        for request in group.requests:
            write_result(self.root, Outcome(over.ok, over.message, request.id))
        if group in self._groups:
            self._groups.remove(group)


def progress_of(reload: Reload) -> Optional[dict[str, Any]]:
    progress = reload.progress()
    return asdict(progress) if progress is not None else None


def outcome(reload: Reload, runs: Sequence[StageRun], before: Optional[dict[str, Any]],
            abort: bool = False) -> Optional[Outcome]:
    """Whether the requested reload (or abort) is over after this pass, and how; None while it goes on (a
    reload under way, whoever began it, is waited for to its end). `before`: the ledger's record when the
    request came (a reload that ended earlier is not this one's)."""
    progress = reload.progress()
    record = asdict(progress) if progress is not None else None
    if progress is not None and progress.step not in (DONE, ABANDONED, FAILED):
        return None
    if progress is not None and record != before or progress is not None and progress.step == FAILED and not abort:
        if progress.step == DONE:
            notes = f" ({'; '.join(progress.notes)})" if progress.notes else ""
            return Outcome(True, f"driver reloaded {progress.loaded} -> {progress.target}{notes}")
        if progress.step == ABANDONED:  # a success for its abort, or where nothing needed it; not for a reload
            ok = not progress.cordoned and (abort or progress.ended_by == AGENT)
            return Outcome(ok, abandoned(progress) + ("; the node stays cordoned: its uncordon failed"
                                                      if progress.cordoned else ""))
        if progress.step == FAILED:
            cordoned = "; the node stays cordoned" if progress.cordoned else ""
            return Outcome(False, f"driver {progress.what()} failed at {progress.failed_step}: "
                                  f"{progress.failure}{cordoned}")
    driver = next((run for run in runs if run.stage == "driver"), None)
    if driver is None:
        return Outcome(False, "the driver stage did not run")
    if abort:
        return Outcome(True, "no driver reload is under way: nothing to abort")
    if driver.state == "ok":
        return Outcome(True, f"nothing to reload: {driver.message}")
    return Outcome(False, f"no reload: {driver.message}")
