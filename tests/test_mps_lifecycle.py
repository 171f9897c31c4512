"""The MPS control daemon's state machine (gpu_agent.mps.lifecycle, issue 33): `decide` over every one of
its inputs (6 phases x 4 wants x 3 daemons x 4 settings x 2 backoffs), each named transition as a table,
and runs of it against a small model of the node, which must settle where the invariants say."""
from __future__ import annotations

import itertools
from typing import Optional

import pytest

from gpu_agent.mps.lifecycle import Action, Facts, Phase, Seen, Settings, Step, Want, decide

EVERY = [(phase, Facts(want, seen, settings, due)) for phase, want, seen, settings, due in
         itertools.product(Phase, Want, Seen, Settings, (True, False))]
A, P = Action, Phase

# (phase, want, daemon, settings, due) -> (action, next phase): the transitions the issue names, and each
# way out of each phase.
TABLE: list[tuple[Phase, Want, Seen, Settings, bool, Action, Optional[Phase]]] = [
    # an agent that starts without an inventory touches nothing
    (P.UNKNOWN, Want.UNDECIDED, Seen.ANSWERS, Settings.UNREAD, True, A.NONE, P.UNKNOWN),
    (P.UNKNOWN, Want.UNDECIDED, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.UNKNOWN),
    (P.RUNNING, Want.UNDECIDED, Seen.ANSWERS, Settings.UNREAD, True, A.NONE, P.RUNNING),
    (P.RUNNING, Want.UNDECIDED, Seen.SILENT, Settings.UNREAD, True, A.NONE, P.ADOPTED),
    (P.RUNNING, Want.UNDECIDED, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.DOWN, Want.UNDECIDED, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.STOPPING, Want.UNDECIDED, Seen.ANSWERS, Settings.UNREAD, True, A.NONE, P.ADOPTED),
    # a daemon the driver reload quit (or is about to) is the reload's: left as it is, started by it
    (P.RUNNING, Want.HELD, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.DOWN, Want.HELD, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.UNKNOWN, Want.HELD, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.UNKNOWN),
    (P.RUNNING, Want.HELD, Seen.ANSWERS, Settings.UNREAD, True, A.NONE, P.RUNNING),
    (P.DOWN, Want.HELD, Seen.ANSWERS, Settings.UNREAD, True, A.NONE, P.ADOPTED),  # the reload started it: read back
    # ... but what the config no longer asks for goes, inventory or not
    (P.UNKNOWN, Want.NO, Seen.ANSWERS, Settings.UNREAD, True, A.QUIT, P.STOPPING),
    (P.RUNNING, Want.NO, Seen.ANSWERS, Settings.SAME, True, A.QUIT, P.STOPPING),
    (P.STOPPING, Want.NO, Seen.ANSWERS, Settings.UNREAD, False, A.NONE, P.STOPPING),  # not dead yet: later
    (P.STOPPING, Want.NO, Seen.ANSWERS, Settings.UNREAD, True, A.QUIT, P.STOPPING),
    (P.STOPPING, Want.NO, Seen.ABSENT, Settings.UNREAD, True, A.REMOVE, None),
    (P.UNKNOWN, Want.NO, Seen.ABSENT, Settings.UNREAD, False, A.REMOVE, None),  # left-over directories
    # a daemon found running is adopted, read back, kept or restarted in place
    (P.UNKNOWN, Want.YES, Seen.ANSWERS, Settings.UNREAD, True, A.ADOPT, P.ADOPTED),
    (P.ADOPTED, Want.YES, Seen.ANSWERS, Settings.SAME, True, A.NONE, P.RUNNING),
    (P.ADOPTED, Want.YES, Seen.ANSWERS, Settings.DIFFERENT, False, A.QUIT, P.STOPPING),
    (P.ADOPTED, Want.YES, Seen.SILENT, Settings.UNREAD, False, A.QUIT, P.STOPPING),
    (P.ADOPTED, Want.YES, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.STOPPING, Want.YES, Seen.ABSENT, Settings.UNREAD, False, A.START, P.STARTING),  # in place, at once
    # starting: judged by what it shows
    (P.UNKNOWN, Want.YES, Seen.ABSENT, Settings.UNREAD, True, A.START, P.STARTING),
    (P.STARTING, Want.YES, Seen.ANSWERS, Settings.SAME, True, A.NONE, P.RUNNING),
    (P.STARTING, Want.YES, Seen.ANSWERS, Settings.DIFFERENT, True, A.NONE, P.DOWN),
    (P.STARTING, Want.YES, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.STARTING, Want.YES, Seen.SILENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    # running: watched; a config change restarts it in place
    (P.RUNNING, Want.YES, Seen.ANSWERS, Settings.SAME, False, A.NONE, P.RUNNING),
    (P.RUNNING, Want.YES, Seen.ANSWERS, Settings.DIFFERENT, False, A.QUIT, P.STOPPING),
    (P.RUNNING, Want.YES, Seen.ABSENT, Settings.UNREAD, True, A.NONE, P.DOWN),
    (P.RUNNING, Want.YES, Seen.SILENT, Settings.SAME, True, A.NONE, P.DOWN),
    # down: its backoff first
    (P.DOWN, Want.YES, Seen.ABSENT, Settings.UNREAD, False, A.NONE, P.DOWN),
    (P.DOWN, Want.YES, Seen.ABSENT, Settings.UNREAD, True, A.START, P.STARTING),
    (P.DOWN, Want.YES, Seen.ANSWERS, Settings.DIFFERENT, False, A.NONE, P.DOWN),
    (P.DOWN, Want.YES, Seen.ANSWERS, Settings.DIFFERENT, True, A.QUIT, P.STOPPING),
    (P.DOWN, Want.YES, Seen.SILENT, Settings.UNREAD, True, A.QUIT, P.STOPPING),
    (P.DOWN, Want.YES, Seen.ANSWERS, Settings.SAME, False, A.NONE, P.RUNNING),  # it answers again, as asked
    # its GPUs' compute mode reset under it (a module reload, by hand): set again in place, its clients kept
    (P.RUNNING, Want.YES, Seen.ANSWERS, Settings.MODES, False, A.EXCLUSIVE, P.RUNNING),
    (P.ADOPTED, Want.YES, Seen.ANSWERS, Settings.MODES, True, A.EXCLUSIVE, P.RUNNING),
    (P.DOWN, Want.YES, Seen.ANSWERS, Settings.MODES, False, A.NONE, P.DOWN),  # could not set them: the backoff
    (P.DOWN, Want.YES, Seen.ANSWERS, Settings.MODES, True, A.EXCLUSIVE, P.RUNNING),
    (P.STOPPING, Want.YES, Seen.ANSWERS, Settings.MODES, True, A.QUIT, P.STOPPING),  # a restart goes on
]


@pytest.mark.parametrize("phase, want, seen, settings, due, action, after", TABLE)
def test_each_named_transition(phase: Phase, want: Want, seen: Seen, settings: Settings, due: bool, action: Action,
                               after: Optional[Phase]) -> None:
    assert decide(phase, Facts(want, seen, settings, due)) == Step(action, after)


def test_the_table_covers_every_phase_and_action() -> None:
    assert {row[0] for row in TABLE} == set(Phase) and {row[5] for row in TABLE} == set(Action)
    assert {row[6] for row in TABLE} == set(Phase) | {None}


def test_without_an_inventory_or_while_the_reload_holds_it_nothing_is_started_stopped_or_removed() -> None:
    for phase, facts in EVERY:
        if facts.want in (Want.UNDECIDED, Want.HELD):
            step = decide(phase, facts)
            assert step.action is Action.NONE and step.phase is not None, (phase, facts)
            assert step.phase is not Phase.RUNNING or phase is Phase.RUNNING, (phase, facts)  # never trusted anew


def test_a_daemon_goes_for_good_only_when_the_config_no_longer_asks_for_it() -> None:
    for phase, facts in EVERY:
        step = decide(phase, facts)
        gone = step.action is Action.REMOVE or step.phase is None
        assert gone == (facts.want is Want.NO and facts.daemon is Seen.ABSENT), (phase, facts, step)
        if facts.want is Want.NO and facts.daemon is not Seen.ABSENT:
            assert step.phase is Phase.STOPPING, (phase, facts, step)  # quit now, or again after the backoff


def test_only_a_daemon_that_answers_as_asked_runs() -> None:
    for phase, facts in EVERY:
        step = decide(phase, facts)
        if step.phase is Phase.RUNNING:
            assert facts.daemon is Seen.ANSWERS and facts.settings is not Settings.DIFFERENT, (phase, facts)
            assert facts.settings is Settings.SAME or phase is Phase.RUNNING or (
                facts.settings is Settings.MODES and step.action is Action.EXCLUSIVE), (phase, facts)
            # its GPUs in EXCLUSIVE_PROCESS: as read back, or set again by this step
            assert facts.settings is not Settings.MODES or step.action is Action.EXCLUSIVE or facts.want is not \
                Want.YES, (phase, facts)


def test_each_action_fits_what_runs() -> None:
    for phase, facts in EVERY:
        step = decide(phase, facts)
        runs = facts.daemon is not Seen.ABSENT
        if step.action is Action.START:  # none runs, it is wanted, and its backoff passed (or it was quit for it)
            assert not runs and facts.want is Want.YES and (facts.due or phase is Phase.STOPPING), (phase, facts)
            assert step.phase is Phase.STARTING
        if step.action is Action.QUIT:
            assert runs and step.phase is Phase.STOPPING, (phase, facts)
        if step.action is Action.ADOPT:
            assert phase is Phase.UNKNOWN and runs and facts.want is Want.YES and step.phase is Phase.ADOPTED
        if step.action is Action.EXCLUSIVE:  # only a daemon that answers as asked but for the compute modes
            assert facts.daemon is Seen.ANSWERS and facts.settings is Settings.MODES and facts.want is Want.YES
            assert step.phase is Phase.RUNNING and phase is not Phase.STOPPING


def test_a_wanted_daemon_that_shows_other_settings_is_restarted_in_place() -> None:
    """Never stopped for good (its directories go only with REMOVE): quit, and started again once gone."""
    for phase in (Phase.ADOPTED, Phase.RUNNING):
        for due in (True, False):
            assert decide(phase, Facts(Want.YES, Seen.ANSWERS, Settings.DIFFERENT, due)) == Step(Action.QUIT,
                                                                                                 Phase.STOPPING)
    assert decide(Phase.STOPPING, Facts(Want.YES, Seen.ABSENT)).action is Action.START


def _settle(phase: Optional[Phase], want: Want, seen: Seen, settings: Settings,
            steps: int = 12) -> tuple[Optional[Phase], list[Action]]:
    """decide run against a node that does what it is told: a start leaves a daemon that answers as asked, a
    quit none; the backoff always passed. Returns where it settles and the actions taken on the way."""
    done: list[Action] = []
    for _ in range(steps):
        if phase is None:
            return None, done
        step = decide(phase, Facts(want, seen, settings, True))
        if step.action is Action.NONE and step.phase is phase:
            return phase, done
        if step.action is not Action.NONE:
            done.append(step.action)
        if step.action in (Action.START, Action.EXCLUSIVE):
            seen, settings = Seen.ANSWERS, Settings.SAME
        elif step.action is Action.QUIT:
            seen, settings = Seen.ABSENT, Settings.UNREAD
        phase = step.phase
    raise AssertionError(f"no rest after {steps} steps: {done}")


# What a node may show: no daemon, or one that answers with the settings asked for or others, or none at all.
NODES = [(Seen.ABSENT, Settings.UNREAD), (Seen.ANSWERS, Settings.SAME), (Seen.ANSWERS, Settings.DIFFERENT),
         (Seen.ANSWERS, Settings.MODES), (Seen.SILENT, Settings.UNREAD)]


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("seen, settings", NODES)
def test_from_every_phase_it_settles_where_the_invariants_say(phase: Phase, seen: Seen, settings: Settings) -> None:
    where, done = _settle(phase, Want.YES, seen, settings)
    assert where is Phase.RUNNING and Action.REMOVE not in done, done
    if (seen, settings) == (Seen.ANSWERS, Settings.SAME) and phase is not Phase.STOPPING:  # (a stop goes on)
        assert Action.QUIT not in done and Action.START not in done  # as asked: its clients keep their server
    if (seen, settings) == (Seen.ANSWERS, Settings.MODES) and phase is not Phase.STOPPING:
        assert Action.EXCLUSIVE in done and Action.QUIT not in done, done  # set in place, never restarted
    where, done = _settle(phase, Want.NO, seen, settings)
    assert where is None and done[-1] is Action.REMOVE, done
    for held in (Want.UNDECIDED, Want.HELD):
        where, done = _settle(phase, held, seen, settings)
        assert done == [] and where is not None, done
