"""One runtime's change as a transaction: back up, write, restart once, check, or restore it all."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from gpu_agent.errors import AgentError, StageError
from gpu_agent.host.files import atomic_write, backup, unified_diff
from gpu_agent.host.paths import Root
from gpu_agent.plan import Change, RestartService, WriteFile
from gpu_agent.toolkit.services import ServiceControl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileChange:
    path: str  # host path
    current: Optional[str]  # None: the file does not exist
    desired: str
    foreign: bool  # someone else's file: keep a timestamped backup before replacing it
    mode: Optional[int] = None  # for a new file (an existing one keeps its own); None: 0644

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

    @property
    def needed(self) -> list[FileChange]:
        return [change for change in self.files if change.needed]

    def planned(self) -> tuple[Change, ...]:
        """The files to write and the restart, as one transaction."""
        writes = tuple(WriteFile.of(item.path, item.desired, item.current, item.mode) for item in self.needed)
        return writes + ((RestartService(self.unit),) if self.unit else ())

    def summary(self) -> str:
        paths = ", ".join(change.path for change in self.needed)
        return f"{self.runtime}: write {paths}" + (f", restart {self.unit}" if self.unit else "")


def apply(root: Root, change: RuntimeChange, services: ServiceControl, wait_timeout: float) -> None:
    """Make the change or leave the runtime as it was; raises StageError with the reason."""
    needed = change.needed
    created = [d for d in {root(item.path).parent for item in needed} if not d.exists()]
    written: list[FileChange] = []
    try:
        for item in needed:
            if item.current is not None and item.foreign:
                backup(root, item.path)
        for item in needed:
            atomic_write(root(item.path), item.desired, item.mode)
            written.append(item)
    except OSError as exc:
        _restore(root, written, created)
        raise StageError(f"{change.runtime}: cannot write {getattr(exc, 'filename', '') or 'a file'}: "
                         f"{exc.strerror or exc}; the previous files are restored") from None
    restart = change.unit is not None and services.active(change.unit)
    problem = _restart(change, services, wait_timeout) if restart else None
    problem = problem or change.check()
    if problem is None:
        return
    log.error("%s: %s; restoring the previous files", change.runtime, problem)
    _restore(root, written, created)
    note = ""
    if restart:
        again = _restart(change, services, wait_timeout)
        note = f"; restarted {change.unit} on the restored files" + (f", but: {again}" if again else "")
    raise StageError(f"{change.runtime}: {problem}; the previous files are restored{note}")


def _restore(root: Root, written: list[FileChange], created: list) -> None:
    for item in written:
        if item.current is None:
            root(item.path).unlink(missing_ok=True)
        else:
            atomic_write(root(item.path), item.current)
    for directory in sorted(created, key=lambda d: len(str(d)), reverse=True):
        try:
            directory.rmdir()  # only if it is still empty
        except OSError:
            pass


def _restart(change: RuntimeChange, services: ServiceControl, wait_timeout: float) -> Optional[str]:
    assert change.unit is not None
    change.restarts.append(change.unit)
    try:
        services.restart(change.unit)
    except AgentError as exc:
        return str(exc)
    if change.socket is None:
        return None
    return services.wait_ready(change.unit, change.socket, wait_timeout)
