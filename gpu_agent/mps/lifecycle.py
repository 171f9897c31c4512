"""An MPS control daemon's lifecycle as a state machine: the next step is a pure function of the phase
its record is in and of what the node shows now (Facts), which the config and the inventory decide in
part (Want). The manager (mps.daemons) gathers the facts, takes the step, and records the new phase.

The phases:
- unknown: not looked at yet by this agent process, or nothing can be decided (no inventory says which
  GPUs the config's resource has, or a driver reload holds the daemon): whatever runs is left as it is.
- adopted: a daemon runs that this process did not start and has not checked (from an earlier agent
  process, or one that may have changed): its settings are read back before it is trusted.
- starting: the start was made; what the daemon shows decides whether it runs as asked.
- running: it runs with the settings asked for and answers: the only phase whose replicas are healthy.
- down: it does not run as asked (it exited, does not answer, shows other settings, or could not be
  started): started again once its backoff has passed.
- stopping: it was sent `quit` (SIGTERM after): to be started again in place, its directories kept
  (pods have its pipe directory mounted), or removed for good when the config no longer asks for it.

Four invariants the exhaustive test of `decide` holds: without an inventory, and while a driver reload holds
the daemon (it quit it for the unload, and starts it again itself), nothing is started, stopped or removed; a
daemon is stopped for good only when the config no longer asks for its resource; only a daemon that answers
with the settings asked for is running; and one whose GPUs are no longer in EXCLUSIVE_PROCESS (a driver reload,
a reboot or someone else reset them) has them set again in place, its clients kept.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Phase(str, enum.Enum):
    UNKNOWN = "unknown"
    ADOPTED = "adopted"
    STARTING = "starting"
    RUNNING = "running"
    DOWN = "down"
    STOPPING = "stopping"


class Want(enum.Enum):
    YES = "wanted"  # the config asks for the resource and the inventory says which GPUs: a spec
    NO = "not wanted"  # the config does not ask for it (or the inventory has no device it may share)
    UNDECIDED = "undecided"  # the config asks for it, but there is no inventory to say for which GPUs
    HELD = "held by the driver reload"  # the config asks for it; the reload quit it for the unload, starts it again


class Seen(enum.Enum):
    ABSENT = "absent"  # no control daemon runs (no pid file, or its process is gone)
    ANSWERS = "answers"  # it runs (and answered, when asked)
    SILENT = "silent"  # it runs but did not answer


class Settings(enum.Enum):
    SAME = "same"  # what runs is what is wanted (read back, or as this process started and checked it)
    MODES = "modes"  # what runs is what is wanted, but a GPU of its is not in EXCLUSIVE_PROCESS compute mode
    DIFFERENT = "different"
    UNREAD = "unread"  # not known: nothing is wanted to compare with, or nothing was read


class Action(enum.Enum):
    NONE = "none"  # keep watching
    ADOPT = "adopt"  # take a running daemon on: its tmpfs, its GPUs' recorded compute modes; read back next
    START = "start"  # directories, record, tmpfs, compute modes, the daemon and its limits; what is there stays
    QUIT = "quit"  # `quit`, then SIGTERM: for a restart in place, or before the removal
    EXCLUSIVE = "exclusive"  # its GPUs set to EXCLUSIVE_PROCESS again, the daemon and its clients left running
    REMOVE = "remove"  # gone and not wanted: compute modes put back, directories removed, the record dropped


@dataclass(frozen=True)
class Facts:
    want: Want
    daemon: Seen
    settings: Settings = Settings.UNREAD
    due: bool = True  # the backoff after the last failure has passed


@dataclass(frozen=True)
class Step:
    action: Action
    phase: Optional[Phase]  # None: the record is dropped


def decide(phase: Phase, facts: Facts) -> Step:
    """The next step of a daemon whose record is in `phase`, given what the node shows now."""
    runs = facts.daemon is not Seen.ABSENT
    if facts.want is Want.NO:
        if not runs:
            return Step(Action.REMOVE, None)
        if phase is Phase.STOPPING and not facts.due:
            return Step(Action.NONE, Phase.STOPPING)  # quit and SIGTERM did not end it: tried again later
        return Step(Action.QUIT, Phase.STOPPING)
    if facts.want in (Want.UNDECIDED, Want.HELD):  # nothing to decide with, or the reload's: left as it is
        if phase is Phase.UNKNOWN:
            return Step(Action.NONE, Phase.UNKNOWN)
        if not runs:
            return Step(Action.NONE, Phase.DOWN)
        trusted = phase is Phase.RUNNING and facts.daemon is Seen.ANSWERS and facts.settings in (Settings.SAME,
                                                                                             Settings.UNREAD)
        return Step(Action.NONE, Phase.RUNNING if trusted else Phase.ADOPTED)
    return _wanted(phase, facts, runs)


def _wanted(phase: Phase, facts: Facts, runs: bool) -> Step:
    as_asked = facts.daemon is Seen.ANSWERS and facts.settings is Settings.SAME
    if facts.daemon is Seen.ANSWERS and facts.settings is Settings.MODES and phase is not Phase.STOPPING:
        if phase is Phase.DOWN and not facts.due:
            return Step(Action.NONE, Phase.DOWN)
        return Step(Action.EXCLUSIVE, Phase.RUNNING)  # its clients keep their server
    if phase is Phase.UNKNOWN:
        if runs:
            return Step(Action.ADOPT, Phase.ADOPTED)
        return Step(Action.START, Phase.STARTING) if facts.due else Step(Action.NONE, Phase.UNKNOWN)
    if phase in (Phase.ADOPTED, Phase.STARTING):
        if as_asked:
            return Step(Action.NONE, Phase.RUNNING)
        if not runs:
            return Step(Action.NONE, Phase.DOWN)
        if facts.daemon is Seen.ANSWERS and facts.settings is Settings.UNREAD:
            return Step(Action.NONE, phase)  # read back on the next look
        # another daemon's settings (or one that does not answer) are replaced at once; one this process
        # started and could not set is down, restarted after its backoff
        return Step(Action.QUIT, Phase.STOPPING) if phase is Phase.ADOPTED else Step(Action.NONE, Phase.DOWN)
    if phase is Phase.RUNNING:
        if not runs or facts.daemon is Seen.SILENT:
            return Step(Action.NONE, Phase.DOWN)
        if facts.settings is Settings.DIFFERENT:  # the config asks for other settings: restarted in place
            return Step(Action.QUIT, Phase.STOPPING)
        return Step(Action.NONE, Phase.RUNNING)
    if phase is Phase.DOWN:
        if as_asked:
            return Step(Action.NONE, Phase.RUNNING)  # it answers again, as asked
        if not facts.due:
            return Step(Action.NONE, Phase.DOWN)
        return Step(Action.QUIT, Phase.STOPPING) if runs else Step(Action.START, Phase.STARTING)
    # stopping, and still wanted: a restart in place
    if not runs:
        return Step(Action.START, Phase.STARTING)
    return Step(Action.QUIT, Phase.STOPPING) if facts.due else Step(Action.NONE, Phase.STOPPING)
