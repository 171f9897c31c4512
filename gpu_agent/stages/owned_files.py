"""Owned files: what the config no longer asks for is undone. Every file the agent wrote is in the
ledger with its owner; one whose stage is off, or no longer claims it, is removed (the agent created
it) or its original put back, and the runtime that reads it restarted once. The links the agent
created (/dev/char) are removed when their stage is off, and the units it took over (the toolkit's
nvidia-cdi-refresh) are put back as they were once their stage no longer claims them. `gpu-agent
uninstall` is this stage with nothing claimed. A ledger entry for what no stage writes, or whose
original is not the agent's own copy, is refused by name and left alone (host.owned.refusal).

It runs after every other stage and gates nothing: a file it cannot undo degrades the agent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from gpu_agent.dra import claim_cdi, timeslice
from gpu_agent.dra.timeslice import TimeSlices
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import ledger as ledger_file, owned
from gpu_agent.host.ledger import Ledger, TimeSlice
from gpu_agent.host.paths import Root
from gpu_agent.mps.control import ComputeModes, DaemonSpec, MpsControl
from gpu_agent.host.ledger import OwnedUnit
from gpu_agent.mig.hooks import UnitControl
from gpu_agent.plan import (Change, GiveBackUnit, RemoveFile, RemoveLink, RestartService, RestoreFile, SetComputeMode,
                            SetTimeSlice, StopMpsDaemon, Unmount)
from gpu_agent.toolkit import cdi_refresh
from gpu_agent.stages.base import Action, Stage
from gpu_agent.toolkit.services import ServiceControl

log = logging.getLogger(__name__)


@dataclass
class OwnedState:
    undo: list[owned.Undo] = field(default_factory=list)
    links: list[owned.LinkUndo] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)  # units that read an undone file and run
    kept: int = 0  # files still wanted
    mps_daemons: dict[str, int] = field(default_factory=dict)  # uninstall: the MPS control daemons running, pids
    units: list[OwnedUnit] = field(default_factory=list)  # units taken over, to put back


class OwnedFiles(Stage):
    name = "owned-files"
    consumes = ("claims",)
    gates_readiness = False

    def __init__(self, root: Root, services: ServiceControl, enabled: set[str], uninstall: bool = False,
                 mps: Optional[tuple[MpsControl, ComputeModes]] = None, units: Optional[UnitControl] = None,
                 timeslices: Optional[TimeSlices] = None) -> None:
        """`mps`: at uninstall, what stops the MPS control daemons the ledger knows and puts their GPUs'
        compute modes back. `units`: what unmasks, enables and starts the units taken over. `timeslices`: at
        uninstall, with `mps`'s compute modes, what puts back the time-slices set for DRA claims."""
        self.root = root
        self.services = services
        self.units = units
        self.mps = mps
        self.timeslices = timeslices
        self.enabled = enabled  # the stages that run: a file owned by any other is no longer wanted
        self.uninstall = uninstall
        self.ledger = Ledger(root)
        self._failures: list[str] = []
        self._left: list[str] = []  # this pass: files someone changed since the agent wrote them

    def start_pass(self) -> None:
        self._failures, self._left = [], []

    def observe(self) -> OwnedState:
        claims: dict[str, Optional[set[str]]] = dict(self.inputs.get("claims") or {})
        state = OwnedState()
        for entry in self.ledger.owned().values():
            wanted = claims.get(entry.owner)
            if not self.uninstall and entry.owner in self.enabled and (wanted is None or entry.path in wanted):
                state.kept += 1  # still asked for, or its stage cannot tell now
                continue
            state.undo.append(owned.undo_of(self.root, entry))
        for taken in sorted(self.ledger.units().values(), key=lambda t: cdi_refresh.give_back_order(t.unit)):
            wanted = claims.get(taken.owner)
            if self.uninstall or taken.owner not in self.enabled or (wanted is not None and taken.unit not in wanted):
                state.units.append(taken)
        for link in self.ledger.links().values():  # a link stays while its stage runs: nothing claims links
            if self.uninstall or link.owner not in self.enabled:
                state.links.append(owned.link_undo_of(self.root, link))
        units = {u.entry.restart for u in state.undo if u.entry.restart and u.how in (owned.REMOVE, owned.RESTORE)}
        for unit in sorted(units):
            try:
                unit_state = self.services.state(unit)
            except AgentError as exc:
                raise StageError(f"cannot tell whether {unit} runs: {exc}") from None
            if unit_state is not None and unit_state.exists and not unit_state.stopped:
                state.restarts.append(unit)
        if self.uninstall and self.mps is not None:
            from gpu_agent.mps.daemons import left_over

            for resource in left_over(self.ledger):
                pid = self.mps[0].pid(DaemonSpec.left(resource))
                if pid is not None:
                    state.mps_daemons[resource] = pid
        return state

    def plan(self, state: OwnedState) -> list[Action]:
        changes: list[Change] = []
        for undo in state.undo:
            if undo.how == owned.REMOVE:
                changes.append(RemoveFile(undo.entry.path))
            elif undo.how == owned.RESTORE and undo.entry.original is not None:
                changes.append(RestoreFile(undo.entry.path, undo.entry.original))
        changes += [RemoveLink(u.entry.path, u.entry.target) for u in state.links if u.how == owned.REMOVE]
        changes += [GiveBackUnit(u.unit, u.file_state, u.active) for u in state.units]
        changes += [RestartService(unit) for unit in state.restarts]
        if self.uninstall:
            changes += [StopMpsDaemon(resource, pid) for resource, pid in sorted(state.mps_daemons.items())]
            changes += [SetComputeMode(uuid, mode) for uuid, (mode, _) in sorted(self.ledger.compute_modes().items())]
            changes += [Unmount(path) for path in sorted(self.ledger.mounts())]
            changes += [RemoveFile(directory) for directory in sorted(self.ledger.mps_directories())]
            changes += [RemoveFile(path) for path in sorted(self.ledger.claim_specs())]
            changes += _timeslices_back(self.ledger.timeslices(), timeslice.boot_id(self.root))
        if not state.undo and not state.links and not state.units and not (self.uninstall and (
                self.ledger.mps_directories() or self.ledger.compute_modes() or self.ledger.mounts()
                or self.ledger.claim_specs() or self.ledger.timeslices())):
            return []
        return [Action(tuple(changes), lambda: self._undo(state))]

    def _undo(self, state: OwnedState) -> None:
        for unit in state.restarts:  # owed from before the first byte changes, as any runtime restart
            self.ledger.add_pending_restart(unit)
        self._failures += _refused(state)
        for undo in state.undo:
            try:
                owned.carry_out(self.root, self.ledger, undo)
            except (OSError, AgentError) as exc:
                self._failures.append(f"cannot undo {undo.entry.path}: {getattr(exc, 'strerror', None) or exc}")
            else:
                if undo.how == owned.CHANGED:
                    self._left.append(undo.entry.path)
                log.info("%s: %s (gpu-agent no longer manages it)", undo.entry.path, undo.how)
        for link in state.links:
            try:
                owned.carry_out_link(self.root, self.ledger, link)
            except (OSError, AgentError) as exc:
                self._failures.append(f"cannot remove the link {link.entry.path}: "
                                      f"{getattr(exc, 'strerror', None) or exc}")
            else:
                if link.how == owned.CHANGED:
                    self._left.append(link.entry.path)
        for taken in state.units:  # after the files: the spec it writes is back as it was before it starts
            if taken.unit not in cdi_refresh.UNITS:
                self._failures.append(f"{ledger_file.PATH}: unit {taken.unit}: not a unit gpu-agent takes over "
                                      f"({', '.join(cdi_refresh.UNITS)}); left alone")
                self.ledger.disown_unit(taken.unit)
                continue
            if self.units is None:
                self._failures.append(f"cannot give back {taken.unit}: no service manager runs this root's units")
                continue
            try:
                cdi_refresh.give_back(self.ledger, self.units, taken)
            except AgentError as exc:
                self._failures.append(f"cannot give back {taken.unit}: {exc}")
        if self.uninstall:  # the MPS control daemons, then their shared memory and directories
            from gpu_agent.mps.daemons import remove_mps_directories, stop_left_over

            try:
                if self.mps is not None:
                    self._failures += stop_left_over(self.root, self.ledger, *self.mps)
                else:
                    for directory in remove_mps_directories(self.root, self.ledger):
                        log.info("%s: removed (gpu-agent no longer manages it)", directory)
            except (OSError, AgentError) as exc:
                self._failures.append(f"cannot remove the MPS directories: {getattr(exc, 'strerror', None) or exc}")
            try:  # the DRA claims' specs, which give their containers those daemons
                for path in claim_cdi.remove_left(self.root, self.ledger):
                    log.info("%s: removed (a DRA claim's CDI spec, never unprepared)", path)
            except (OSError, AgentError) as exc:
                self._failures.append(f"cannot remove a DRA claim's CDI spec: {getattr(exc, 'strerror', None) or exc}")
            try:
                if self.mps is not None and self.timeslices is not None:
                    self._failures += timeslice.put_back(self.ledger, self.mps[1], self.timeslices,
                                                         timeslice.boot_id(self.root))
                elif self.ledger.timeslices():
                    self._failures.append("cannot put back the time-slices set for DRA claims: no NVML here")
            except (OSError, AgentError) as exc:
                self._failures.append(f"cannot put back the time-slices set for DRA claims: "
                                      f"{getattr(exc, 'strerror', None) or exc}")
        for unit in state.restarts:
            try:
                self.services.restart(unit)
            except AgentError as exc:
                self._failures.append(str(exc))
            else:
                self.ledger.clear_pending_restart(unit)

    def verify(self, state: OwnedState) -> str:
        problems = self._failures or _refused(state)  # after the undo, what it refused; in a dry run, what it would
        if problems:
            raise StageError("; ".join(problems))
        changed = (self._left + [u.entry.path for u in state.undo if u.how == owned.CHANGED]
                   + [u.entry.path for u in state.links if u.how == owned.CHANGED])
        note = f"; left as they are, changed since gpu-agent wrote them: {', '.join(changed)}" if changed else ""
        if self.uninstall:
            return f"nothing of gpu-agent's is left to undo{note}"
        return f"{state.kept} file{'s' if state.kept != 1 else ''} owned and wanted{note}"


def _timeslices_back(recorded: dict[str, TimeSlice], boot: str) -> list[Change]:
    """What putting back the time-slices set for DRA claims changes (nothing for one set in an earlier boot)."""
    changes: list[Change] = []
    for uuid, entry in sorted(recorded.items()):
        if entry.boot == boot:
            changes += [SetTimeSlice(uuid, 0)] if entry.level else []
            changes += [SetComputeMode(uuid, entry.mode_before)] if entry.mode_before else []
    return changes


def _refused(state: OwnedState) -> list[str]:
    """The ledger's entries for what the agent never owns, each named with why."""
    return ([f"{ledger_file.PATH}: owned {u.entry.path}: {u.reason}; left alone"
             for u in state.undo if u.how == owned.REFUSED]
            + [f"{ledger_file.PATH}: link {u.entry.path}: {u.reason}; left alone"
               for u in state.links if u.how == owned.REFUSED])
