"""One runtime's change as a transaction: record the restart it will owe, back up, write, restart once,
check, or restore it all. Each runtime is its own transaction: one failing leaves the others alone."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import owned
from gpu_agent.host.files import BACKUP_DIR, backup, unified_diff
from gpu_agent.host.ledger import Ledger, Owned
from gpu_agent.host.paths import Root
from gpu_agent.plan import Change, RestartService, WriteFile
from gpu_agent.toolkit.services import ORDERED_AFTER_AGENT, ServiceControl, UnitState

log = logging.getLogger(__name__)

RESTORED = "the previous files are restored"
OWNER = "toolkit"


@dataclass(frozen=True)
class FileChange:
    path: str  # host path
    current: Optional[str]  # None: the file does not exist
    desired: str
    foreign: bool  # someone else's file: keep a timestamped backup before replacing it
    mode: Optional[int] = None  # for a new file (an existing one keeps its own); None: 0644
    before: Optional[Owned] = None  # what the ledger held for it before this transaction wrote it

    @property
    def needed(self) -> bool:
        return self.current != self.desired

    def diff(self) -> str:
        return unified_diff(self.path, self.current, self.desired)


@dataclass
class RuntimeChange:
    runtime: str  # containerd, docker, crio
    unit: Optional[str]  # None: nothing to restart (e.g. nvidia-container-runtime's own config)
    socket: Optional[str]
    files: list[FileChange]
    check: Callable[[], Optional[str]] = lambda: None  # after the restart: None or the problem
    restarts: list[str] = field(default_factory=list)  # filled in as it happens
    unit_state: Optional[UnitState] = None  # as observed; None: no service manager runs it here
    restart_owed: bool = False  # the ledger holds a restart of the unit that an earlier pass did not finish
    answer: Optional[str] = None  # why an owed, running unit does not answer on its socket; None: it does

    @property
    def needed(self) -> list[FileChange]:
        return [change for change in self.files if change.needed]

    @property
    def restarts_unit(self) -> bool:
        """Whether the change restarts the unit: one that should be running (running, failed, in
        transition, or owed a restart). One an administrator stopped, and owed nothing, is left
        stopped: it reads the new files when it is started. A stopped unit ordered after the agent
        (k3s, RKE2) is left too, owed or not: at boot its start job waits for the agent's first pass, and
        a restart from that pass would wait for itself (services.restart_argv)."""
        state = self.unit_state
        if self.unit is None or state is None or not state.exists:
            return False
        if state.stopped:
            return self.restart_owed and self.unit not in ORDERED_AFTER_AGENT
        return True

    @property
    def pending(self) -> bool:
        """Files to write, or a restart owed that can be done now (one owed to a unit that is gone, or
        on a root no service manager runs, stays in the ledger until it can)."""
        return bool(self.needed) or (self.restart_owed and self.restarts_unit)

    @property
    def was_up(self) -> bool:
        """Running and answering before this pass touched it: a failed change restarts it on the restored files."""
        state = self.unit_state
        return state is not None and state.running and self.answer is None

    def down(self) -> Optional[str]:
        """Why a unit that should be running is not: failed, stuck in transition, or owed a restart and
        stopped or silent."""
        state = self.unit_state
        if state is None or not self.restarts_unit:
            return None
        if not state.running:
            return f"{state.describe()}; see journalctl -u {self.unit}"
        if self.answer is not None:
            return f"{state.describe()} but {self.answer}"
        return None

    def planned(self) -> tuple[Change, ...]:
        """The files to write and the restart, as one transaction."""
        writes = tuple(WriteFile.of(item.path, item.desired, item.current, item.mode) for item in self.needed)
        return writes + ((RestartService(self.unit),) if self.unit is not None and self.restarts_unit else ())

    def summary(self) -> str:
        return f"{self.runtime}: " + "; ".join(change.describe() for change in self.planned())


def apply(root: Root, change: RuntimeChange, services: ServiceControl, ledger: Ledger, wait_timeout: float,
          progress: Callable[[str], None] = lambda doing: None) -> None:
    """Make the change or leave the runtime as it was; raises StageError with the reason. `progress`
    hears what a restart waits for, from the moment it starts: the runtime is not ready meanwhile.

    A restart is owed from before the first byte is written until the runtime answered after it, and
    the ledger says so durably: a pass that starts after a crash performs it."""
    restart = change.restarts_unit
    unit = change.unit
    if restart:
        assert unit is not None
        try:
            ledger.add_pending_restart(unit)
        except AgentError as exc:
            raise StageError(f"{change.runtime}: {exc}") from None
    written, created = _write(root, change, ledger)
    if not restart:
        problem = change.check()
        if problem is not None:
            raise StageError(f"{change.runtime}: {problem}; {_restore(root, ledger, written, created)}")
        return
    assert unit is not None
    problem = _restart(change, services, wait_timeout, progress) or change.check()
    if problem is None:
        _forget(ledger, unit)
        return
    log.error("%s: %s; restoring the previous files", change.runtime, problem)
    restored = _restore(root, ledger, written, created)
    note = ""
    if written and change.was_up:  # back to the files it ran with before this pass
        again = _restart(change, services, wait_timeout, progress)
        if again is None:
            _forget(ledger, unit)
        note = f"; restarted {unit} on the restored files" + (f", but: {again}" if again else "")
    raise StageError(f"{change.runtime}: {problem}; {restored}{note}")


def _write(root: Root, change: RuntimeChange, ledger: Ledger) -> tuple[list[FileChange], list[Path]]:
    """Back up and write every needed file, each owned in the ledger; on failure restore what was written
    and raise. Returns what was written and the directories created for it."""
    needed = change.needed
    created = [d for d in {root(item.path).parent for item in needed} if not d.exists()]
    written: list[FileChange] = []
    try:
        for item in needed:
            if item.current is not None and item.foreign:
                backup(root, item.path)
        for item in needed:
            before = ledger.owned().get(item.path)
            owned.write(root, ledger, OWNER, item.path, item.desired, item.mode, restart=change.unit)
            written.append(replace(item, before=before))
    except (OSError, AgentError) as exc:
        restored = _restore(root, ledger, written, created)
        if change.unit is not None and change.restarts_unit and not change.restart_owed and restored == RESTORED:
            _forget(ledger, change.unit)  # the runtime runs the files that are back
        if isinstance(exc, OSError):
            problem = f"cannot write {exc.filename or 'a file'}: {exc.strerror or exc}"
        else:
            problem = f"cannot record the write in the ledger: {exc}"
        raise StageError(f"{change.runtime}: {problem}; {restored}") from None
    return written, created


def _restore(root: Root, ledger: Ledger, written: list[FileChange], created: list[Path]) -> str:
    """Put back what was written, and what the ledger said of it; returns "the previous files are
    restored", or what could not be."""
    failed = []
    for item in written:
        try:
            owned.put_back(root, ledger, item.path, item.before, item.current)
        except (OSError, AgentError) as exc:
            failed.append(f"{item.path} ({getattr(exc, 'strerror', None) or exc})")
    for directory in sorted(created, key=lambda d: len(str(d)), reverse=True):
        try:
            directory.rmdir()  # only if it is still empty
        except OSError:
            pass
    if failed:
        log.error("could not restore %s", ", ".join(failed))
        return f"restoring the previous files failed for {', '.join(failed)}: restore them from {BACKUP_DIR}"
    return RESTORED


def _forget(ledger: Ledger, unit: str) -> None:
    try:
        ledger.clear_pending_restart(unit)
    except AgentError as exc:  # an extra restart later is the worst that follows
        log.warning("%s", exc)


def _restart(change: RuntimeChange, services: ServiceControl, wait_timeout: float,
             progress: Callable[[str], None]) -> Optional[str]:
    unit = change.unit
    assert unit is not None
    change.restarts.append(unit)
    doing = f"restarting {change.runtime} ({unit})"
    progress(f"{doing}: waiting for `systemctl restart {unit}`, started {time.strftime('%H:%M:%S')}")
    try:
        services.restart(unit)
    except AgentError as exc:
        return str(exc)
    if change.socket is None:
        return None
    progress(f"{doing}: waiting for it to answer on {change.socket}")
    return services.wait_ready(unit, change.socket, wait_timeout, lambda waiting: progress(f"{doing}: {waiting}"))
