"""Issue 33: the driver reload's next move is a pure function of its record, what the node shows now, what was
asked and the config (gpu_agent/stages/reload_transitions.py). A table of the transitions, one row a branch,
and the invariants of docs/driver-upgrades.md checked over every combination of the facts that decide them."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Optional

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.stages import reload_transitions as rt
from gpu_agent.stages.reload_transitions import Facts, Move, Progress, Request, Rules, decide, label

OLD, NEW, NEWER = "550.90.07", "570.124.06", "575.51.03"
BOOT, REBOOTED = "boot-1", "boot-2"
UNIT = "nvidia-persistenced.service"
MPS, OTHER_MPS = "nvidia.com/gpu", "nvidia.com/gpu-shared"
RULES = Rules("when-idle", 3600.0, (UNIT,))
CORE = frozenset({"nvidia", "nvidia_uvm"})


def record(step: str, reason: str = rt.VERSION, **fields: object) -> Progress:
    target = NEW if reason == rt.VERSION else OLD
    base = Progress(step, target, OLD, modules=["nvidia", "nvidia_uvm"], boot_id=BOOT, reason=reason)
    return replace(base, **fields)  # type: ignore[arg-type]


def facts(loaded: Optional[str] = OLD, installed: Optional[str] = NEW, **fields: object) -> Facts:
    base = Facts(loaded, installed, BOOT, CORE if loaded else frozenset(), now=100.0)
    return replace(base, **fields)  # type: ignore[arg-type]


ASKED, FORCE, ABORT = Request(reload=True), Request(reload=True, force=True), Request(abort="alice")
NOTHING = Request()

# (why, record, facts, request, rules, the move)
TABLE: list[tuple[str, Optional[Progress], Facts, Request, Rules, Move]] = [
    # --- no reload under way --------------------------------------------------------------------------------
    ("nothing to reload", None, facts(OLD, OLD), NOTHING, RULES, Move(rt.IDLE, rt.IDLE_NOTHING)),
    ("no driver loaded: the driver stage loads it", None, facts(None, NEW), NOTHING, RULES,
     Move(rt.IDLE, rt.IDLE_NOT_LOADED)),
    ("a mismatch, when-idle", None, facts(), NOTHING, RULES, Move(rt.START, rt.VERSION)),
    ("a mismatch, never", None, facts(), NOTHING, Rules("never"), Move(rt.IDLE, rt.IDLE_NEVER)),
    ("a mismatch, never, asked", None, facts(), ASKED, Rules("never"), Move(rt.START, rt.VERSION)),
    ("a mismatch, the skip label", None, facts(skip="label"), NOTHING, RULES, Move(rt.IDLE, rt.IDLE_SKIP)),
    ("a mismatch, the skip label, asked", None, facts(skip="label"), ASKED, RULES, Move(rt.START, rt.VERSION)),
    ("a rollback to an older version is a mismatch too", None, facts(OLD, "535.183.01"), NOTHING, RULES,
     Move(rt.START, rt.VERSION)),
    ("a changed option is reported, not applied", None, facts(OLD, OLD, drift=("nvidia x is 0, configured 1",)),
     NOTHING, RULES, Move(rt.IDLE, rt.IDLE_OPTIONS)),
    ("a changed option applied when asked", None, facts(OLD, OLD, drift=("nvidia x is 0, configured 1",)), ASKED,
     RULES, Move(rt.START, rt.OPTIONS)),
    ("--force reloads a driver that needs nothing", None, facts(OLD, OLD), FORCE, RULES, Move(rt.START, rt.FORCED)),
    ("--abort with nothing under way", None, facts(), ABORT, RULES, Move(rt.IDLE, rt.IDLE_NO_ABORT)),
    ("done: a new mismatch starts anew", record(rt.DONE), facts(NEW, NEWER), NOTHING, RULES,
     Move(rt.START, rt.VERSION)),
    ("abandoned: not started again by itself", record(rt.ABANDONED), facts(), NOTHING, RULES,
     Move(rt.IDLE, rt.IDLE_ABANDONED)),
    ("abandoned: started again when asked", record(rt.ABANDONED), facts(), ASKED, RULES, Move(rt.START, rt.VERSION)),
    ("abandoned: another target starts", record(rt.ABANDONED), facts(OLD, NEWER), NOTHING, RULES,
     Move(rt.START, rt.VERSION)),
    ("an end whose uncordon failed", record(rt.ABANDONED, cordoned=True), facts(OLD, OLD), NOTHING, RULES,
     Move(rt.RELEASE)),
    # --- what the node shows first -----------------------------------------------------------------------------
    ("--abort at any step", record(rt.POD_RESTART, unloaded=["nvidia_uvm"]), facts(), ABORT, RULES,
     Move(rt.ABORT, "alice")),
    ("--abort of a failed reload", record(rt.FAILED, failed_step=rt.WAIT_FOR_JOBS), facts(), ABORT, RULES,
     Move(rt.ABORT, "alice")),
    ("a reboot", record(rt.FAILED, failed_step=rt.POD_RESTART), facts(boot_id=REBOOTED), NOTHING, RULES,
     Move(rt.NEW_BOOT, REBOOTED)),
    ("issue 33: the installed driver loaded (a reboot done), failed at pod-restart",
     record(rt.FAILED, failed_step=rt.POD_RESTART, boot_id=REBOOTED), facts(NEW, NEW, boot_id=REBOOTED), NOTHING,
     RULES, Move(rt.FINISH, f"{NEW} is loaded (by a reboot, or by hand)")),
    ("loaded by hand while waiting", record(rt.WAIT_FOR_JOBS), facts(NEW, NEW, busy=("process 1",)), NOTHING, RULES,
     Move(rt.FINISH, f"{NEW} is loaded (by a reboot, or by hand)")),
    ("a rollback while the reload failed", record(rt.FAILED, failed_step=rt.POD_RESTART), facts(OLD, OLD), NOTHING,
     RULES, Move(rt.MOOT, f"the installed driver is {OLD} again, the one loaded")),
    ("a rollback after nvidia was unloaded: the old one is loaded back",
     record(rt.FAILED, failed_step=rt.POD_RESTART, unloaded=["nvidia_uvm", "nvidia"]), facts(None, OLD), NOTHING,
     RULES, Move(rt.RETARGET, OLD)),
    ("a second upgrade while waiting", record(rt.WAIT_FOR_JOBS, cordoned=True), facts(OLD, NEWER), NOTHING, RULES,
     Move(rt.RETARGET, NEWER)),
    ("a second upgrade after the unload", record(rt.POD_RESTART, unloaded=["nvidia"]), facts(None, NEWER), NOTHING,
     RULES, Move(rt.RETARGET, NEWER)),
    ("an upgrade during an options reload", record(rt.WAIT_FOR_JOBS, rt.OPTIONS), facts(OLD, NEW), NOTHING, RULES,
     Move(rt.RETARGET, NEW)),
    ("options reverted before anything was unloaded", record(rt.WAIT_FOR_JOBS, rt.OPTIONS), facts(OLD, OLD),
     NOTHING, RULES, Move(rt.MOOT, "the loaded modules have the configured options")),
    ("the installed version unknown: the record's target stands", record(rt.WAIT_FOR_JOBS), facts(OLD, None),
     NOTHING, RULES, Move(rt.ADVANCE, rt.POD_DELETION)),
    # --- the steps ---------------------------------------------------------------------------------------------
    ("failed: tried again", record(rt.FAILED, failed_step=rt.WAIT_FOR_JOBS), facts(), NOTHING, RULES,
     Move(rt.RETRY, rt.WAIT_FOR_JOBS)),
    ("failed at an unknown step: from the cordon", record(rt.FAILED), facts(), NOTHING, RULES,
     Move(rt.RETRY, rt.CORDON_REQUIRED)),
    ("cordon", record(rt.CORDON_REQUIRED), facts(), NOTHING, RULES, Move(rt.CORDON)),
    ("killed between the two records of a start", record(rt.UPGRADE_REQUIRED), facts(), NOTHING, RULES,
     Move(rt.CORDON)),
    ("GPUs busy", record(rt.WAIT_FOR_JOBS), facts(busy=("process 1",)), NOTHING, RULES, Move(rt.WAIT)),
    ("GPUs busy too long", record(rt.WAIT_FOR_JOBS, waiting_since=0.0), facts(busy=("process 1",), now=3601.0),
     NOTHING, RULES, Move(rt.GIVE_UP)),
    ("GPUs busy, --force", record(rt.WAIT_FOR_JOBS, forced=True), facts(busy=("process 1",)), NOTHING, RULES,
     Move(rt.ADVANCE, rt.POD_DELETION)),
    ("GPUs idle", record(rt.WAIT_FOR_JOBS), facts(), NOTHING, RULES, Move(rt.ADVANCE, rt.POD_DELETION)),
    ("no pod deletion", record(rt.POD_DELETION), facts(), NOTHING, RULES, Move(rt.ADVANCE, rt.DRAIN)),
    ("no drain", record(rt.DRAIN), facts(), NOTHING, RULES, Move(rt.ADVANCE, rt.POD_RESTART)),
    ("a display", record(rt.POD_RESTART), facts(display="1400 (Xorg) has an NVIDIA DRM device open"), NOTHING,
     RULES, Move(rt.REFUSE, rt.REFUSE_DISPLAY)),
    ("the plugin first", record(rt.POD_RESTART), facts(), NOTHING, RULES, Move(rt.HOLD_PLUGIN)),
    ("then the units that run", record(rt.POD_RESTART, plugin_stopped=True), facts(active_units=frozenset({UNIT})),
     NOTHING, RULES, Move(rt.STOP_UNIT, UNIT)),
    ("a GPU in use again", record(rt.POD_RESTART, plugin_stopped=True), facts(busy=("process 1",)), NOTHING, RULES,
     Move(rt.REFUSE, rt.REFUSE_BUSY)),
    ("a GPU in use again, an MPS daemon too: refused before it is quit", record(rt.POD_RESTART, plugin_stopped=True),
     facts(busy=("process 1",), mps=(MPS,)), NOTHING, RULES, Move(rt.REFUSE, rt.REFUSE_BUSY)),
    ("issue 33: the agent's MPS daemons quit (their servers hold the GPUs)",
     record(rt.POD_RESTART, plugin_stopped=True), facts(mps=(MPS, OTHER_MPS)), NOTHING, RULES,
     Move(rt.QUIT_MPS, MPS)),
    ("one quit already, the other next", record(rt.POD_RESTART, plugin_stopped=True, stopped_mps=[MPS]),
     facts(mps=(OTHER_MPS,)), NOTHING, RULES, Move(rt.QUIT_MPS, OTHER_MPS)),
    ("one recorded quit still runs: quit again", record(rt.POD_RESTART, plugin_stopped=True, stopped_mps=[MPS]),
     facts(mps=(MPS,)), NOTHING, RULES, Move(rt.QUIT_MPS, MPS)),
    ("after the units", record(rt.POD_RESTART, plugin_stopped=True),
     facts(mps=(MPS,), active_units=frozenset({UNIT})), NOTHING, RULES, Move(rt.STOP_UNIT, UNIT)),
    ("the daemons quit: unload", record(rt.POD_RESTART, plugin_stopped=True, stopped_mps=[MPS]), facts(), NOTHING,
     RULES, Move(rt.UNLOAD, "nvidia_uvm")),
    ("the console unbound before nvidia_drm goes",
     record(rt.POD_RESTART, plugin_stopped=True),
     facts(modules=CORE | {"nvidia_drm", "nvidia_modeset"}, consoles=("vtcon1",)), NOTHING, RULES,
     Move(rt.UNBIND_CONSOLE, "vtcon1")),
    ("unload in order", record(rt.POD_RESTART, plugin_stopped=True), facts(), NOTHING, RULES,
     Move(rt.UNLOAD, "nvidia_uvm")),
    ("unload nvidia last", record(rt.POD_RESTART, plugin_stopped=True, unloaded=["nvidia_uvm"]),
     facts(modules=frozenset({"nvidia"})), NOTHING, RULES, Move(rt.UNLOAD, "nvidia")),
    ("load nvidia", record(rt.POD_RESTART, plugin_stopped=True, unloaded=["nvidia_uvm", "nvidia"]), facts(None),
     NOTHING, RULES, Move(rt.LOAD, "nvidia")),
    ("load the rest", record(rt.POD_RESTART, reloaded=True), facts(NEW, NEW, modules=frozenset({"nvidia"})),
     NOTHING, RULES, Move(rt.LOAD, "nvidia_uvm")),
    ("a stale module loaded", record(rt.POD_RESTART, reloaded=True), facts(OLD, NEW), NOTHING, RULES,
     Move(rt.MISLOADED, OLD)),
    ("the console back", record(rt.POD_RESTART, reloaded=True, consoles=["vtcon1"]), facts(NEW, NEW), NOTHING,
     RULES, Move(rt.BIND_CONSOLE, "vtcon1")),
    ("verify", record(rt.POD_RESTART, reloaded=True), facts(NEW, NEW), NOTHING, RULES, Move(rt.VERIFY)),
    ("options: unload the same version", record(rt.POD_RESTART, rt.OPTIONS, plugin_stopped=True),
     facts(OLD, OLD, drift=("d",)), NOTHING, RULES, Move(rt.UNLOAD, "nvidia_uvm")),
    ("forced: reloaded, verify", record(rt.POD_RESTART, rt.FORCED, reloaded=True), facts(OLD, OLD), NOTHING, RULES,
     Move(rt.VERIFY)),
    ("validation: the driver-upgrade stage's", record(rt.VALIDATION, reloaded=True), facts(NEW, NEW), NOTHING, RULES,
     Move(rt.LATER)),
    ("validation failed", record(rt.VALIDATION, reloaded=True), facts(NEW, NEW, validation=("mig: x",)), NOTHING,
     RULES, Move(rt.INVALID, "mig: x")),
    ("validated", record(rt.VALIDATION, reloaded=True), facts(NEW, NEW, validation=()), NOTHING, RULES,
     Move(rt.UNCORDON_NODE)),
    ("validated: the MPS daemons it quit started first", record(rt.VALIDATION, reloaded=True,
                                                               stopped_mps=[MPS, OTHER_MPS]),
     facts(NEW, NEW, validation=()), NOTHING, RULES, Move(rt.START_MPS, MPS)),
    ("not before validation", record(rt.VALIDATION, reloaded=True, stopped_mps=[MPS]),
     facts(NEW, NEW, validation=("mig: x",)), NOTHING, RULES, Move(rt.INVALID, "mig: x")),
    ("killed after the uncordon's record: started before it is made", record(rt.UNCORDON, reloaded=True,
                                                                           stopped_mps=[MPS]),
     facts(NEW, NEW, validation=()), NOTHING, RULES, Move(rt.START_MPS, MPS)),
    ("the uncordon again", record(rt.UNCORDON, reloaded=True), facts(NEW, NEW, validation=()), NOTHING, RULES,
     Move(rt.UNCORDON_NODE)),
]


@pytest.mark.parametrize("why, progress, seen, asked, rules, expected", TABLE, ids=[row[0] for row in TABLE])
def test_the_transition_table(why: str, progress: Optional[Progress], seen: Facts, asked: Request, rules: Rules,
                              expected: Move) -> None:
    assert decide(progress, seen, asked, rules) == expected


def test_every_move_and_step_is_in_the_table() -> None:
    moves = {row[5].kind for row in TABLE}
    assert moves == set(rt.MOVES)
    steps = {row[1].step for row in TABLE if row[1] is not None}
    assert steps == set(rt.STEPS)


# --- every combination -------------------------------------------------------------------------------------------

VERSIONS = (None, OLD, NEW, NEWER)


def records(light: bool) -> Iterator[Optional[Progress]]:
    """Every state with every combination of what the record holds (light: the units, the cordon and the plugin
    together)."""
    yield None
    held = [(False, False, False), (False, False, True), (True, True, True)] if light else \
        list(itertools.product((False, True), repeat=3))
    for step, reason, reloaded, unloaded, (stopped, cordoned, plugin), quit_mps in itertools.product(
            rt.STEPS, rt.REASONS, (False, True), ([], ["nvidia_uvm"]), held, ([], [MPS])):
        if quit_mps and step in rt.FINAL:
            continue  # every end starts the daemons it quit (or leaves them to the MPS watch): none is held
        for failed in (rt.RELOADING + rt.FINISHING if step == rt.FAILED else (None,)):
            for waiting in ((None, 0.0) if step == rt.WAIT_FOR_JOBS else (None,)):
                yield record(step, reason, reloaded=reloaded, unloaded=list(unloaded), cordoned=cordoned,
                             stopped_units=[UNIT] if stopped else [], plugin_stopped=plugin, failed_step=failed,
                             consoles=["vtcon1"] if unloaded else [], waiting_since=waiting,
                             stopped_mps=list(quit_mps))


OTHERS: dict[str, tuple[object, ...]] = {
    "busy": ((), ("process 1",)), "display": (None, "1400 (Xorg)"),
    "active_units": (frozenset(), frozenset({UNIT})), "drift": ((), ("d",)), "skip": (None, "label"),
    "validation": (None, (), ("mig: x",)), "now": (100.0, 1e9),
    "modules": ("core", "with nvidia_drm", "with nvidia_drm and its console"), "mps": ((), (MPS,))}
# The facts each state reads beyond the versions and the boot (every state reads the drift: an options reload
# whose options were reverted is over).
READ_AT = {rt.WAIT_FOR_JOBS: ("busy", "now"),
           rt.POD_RESTART: ("busy", "display", "active_units", "modules", "mps"),
           rt.VALIDATION: ("validation",), rt.UNCORDON: ("validation",), None: ("skip",)}


def observations(progress: Optional[Progress], light: bool) -> Iterator[Facts]:
    """Every combination of the versions and the boot, each with every combination of the other facts the
    record's state reads (or, light, with each of them alone)."""
    step = progress.step if progress is not None and progress.step not in rt.FINAL else None
    names = ("drift", *READ_AT.get(step, ()))
    if light:
        variants = [{}] + [{name: value} for name in names for value in OTHERS[name][1:]]
    else:
        variants = [dict(zip(names, values)) for values in itertools.product(*[OTHERS[name] for name in names])]
    for loaded, installed, boot in itertools.product(VERSIONS, VERSIONS, (BOOT, REBOOTED)):
        for extra in variants:
            given = {name: value for name, value in extra.items() if name != "modules"}
            drm = extra.get("modules", "core") != "core" and loaded is not None
            modules = CORE | {"nvidia_drm", "nvidia_modeset"} if drm else (CORE if loaded is not None else frozenset())
            consoles = ("vtcon1",) if drm and extra["modules"] == "with nvidia_drm and its console" else ()
            yield Facts(loaded, installed, boot, modules, consoles=consoles, **given)  # type: ignore[arg-type]


REQUESTS = (NOTHING, ASKED, FORCE, ABORT)
RULE_SETS = (RULES, Rules("never", 3600.0, (UNIT,)))


def check(progress: Optional[Progress], seen: Facts, request: Request, rules: Rules) -> None:
    """The invariants of one decision."""
    move = decide(progress, seen, request, rules)
    assert move.kind in rt.MOVES
    under_way = progress is not None and progress.step not in rt.FINAL
    target = seen.installed or (progress.target if progress else None)
    if not under_way:
        assert move.kind in (rt.IDLE, rt.START, rt.RELEASE)
        if progress is not None and progress.cordoned:
            assert move.kind == rt.RELEASE  # an agent's cordon outlives no end
        if move.kind == rt.START:
            assert seen.loaded is not None
            if move.arg == rt.VERSION:
                assert seen.mismatch and (request.reload or (rules.mode == "when-idle" and seen.skip is None))
                if not request.reload and progress is not None and progress.step == rt.ABANDONED:
                    assert progress.target != seen.installed  # an abandoned target is started again only on request
            else:
                assert not seen.mismatch and request.reload and (request.force or move.arg == rt.OPTIONS)
                assert move.arg != rt.OPTIONS or seen.drift
        return
    assert progress is not None
    if request.abort is not None:
        assert move == Move(rt.ABORT, request.abort)
        return
    assert move.kind not in (rt.START, rt.IDLE, rt.RELEASE)  # a record under way is never replaced nor dropped
    if seen.boot_id != progress.boot_id:
        assert move.kind == rt.NEW_BOOT
        return
    if move.kind == rt.UNLOAD:
        # Never the installed driver loaded, unless asked (--force, the options asked for).
        assert progress.reason != rt.VERSION or seen.loaded != target
        assert not progress.reloaded and seen.display is None and progress.plugin_stopped
        assert not any(unit in seen.active_units and unit not in progress.stopped_units for unit in rules.units)
        assert not (seen.busy and not (progress.forced or request.force) and not progress.unloaded)
        assert move.arg == "nvidia" or move.arg in seen.modules
        assert not ("nvidia_drm" in seen.modules and seen.consoles)  # the console is unbound first
        assert not seen.mps  # issue 33: the agent's MPS daemons (their servers hold the GPUs) are quit first
    if move.kind == rt.QUIT_MPS:
        assert move.arg in seen.mps and progress.step == rt.POD_RESTART and not progress.reloaded
        assert progress.plugin_stopped and seen.display is None
        assert not (seen.busy and not (progress.forced or request.force) and not progress.unloaded)
    if move.kind == rt.START_MPS:  # only once validated, each the record holds, before the end
        assert progress.step in rt.FINISHING and seen.validation == () and move.arg in progress.stopped_mps
    if move.kind == rt.UNCORDON_NODE:
        assert not progress.stopped_mps  # the end never leaves a daemon it quit held
    if move.kind in (rt.HOLD_PLUGIN, rt.STOP_UNIT, rt.UNBIND_CONSOLE):
        assert seen.display is None and progress.step == rt.POD_RESTART and not progress.reloaded
    if move.kind == rt.STOP_UNIT:
        assert move.arg in rules.units and move.arg in seen.active_units and move.arg not in progress.stopped_units
    if move.kind == rt.REFUSE and move.arg == rt.REFUSE_BUSY:
        assert seen.busy and not progress.unloaded
    if move.kind == rt.LOAD:
        assert move.arg not in seen.modules and (seen.loaded is None or seen.loaded == target
                                                 or progress.reason != rt.VERSION)
    if move.kind in (rt.LATER, rt.INVALID, rt.UNCORDON_NODE):
        assert progress.step in rt.FINISHING and (move.kind == rt.LATER) == (seen.validation is None)
    if move.kind == rt.RETRY:
        assert progress.step == rt.FAILED and move.arg in rt.RELOADING + rt.FINISHING
    if progress.step == rt.FAILED:
        assert move.kind in (rt.RETRY, rt.FINISH, rt.MOOT, rt.RETARGET)
    if seen.installed is not None and seen.installed != progress.target:
        # The target moved: the same record goes on toward it (its cordon and its stopped units kept), or ends.
        assert move.kind in (rt.RETARGET, rt.MOOT)
    if (progress.reason == rt.VERSION and seen.loaded is not None and seen.loaded == seen.installed == progress.target
            and not progress.reloaded and progress.step not in rt.FINISHING):
        assert move.kind == rt.FINISH  # issue 33: loaded by a reboot, never unloaded again
    if move.kind == rt.MOOT:
        assert seen.loaded is not None and (seen.loaded == seen.installed == progress.loaded
                                            or (progress.reason == rt.OPTIONS and not seen.drift))


def sweep(light: bool) -> set[str]:
    moves = set()
    for progress in records(light):
        for seen, asked in itertools.product(observations(progress, light), REQUESTS):
            under_way = progress is not None and progress.step not in rt.FINAL
            for rules in RULE_SETS[:1] if light or under_way else RULE_SETS:
                check(progress, seen, asked, rules)
                moves.add(decide(progress, seen, asked, rules).kind)
    return moves


def test_the_invariants_hold_for_every_record_with_the_versions_and_boots_and_each_other_fact() -> None:
    assert set(rt.MOVES) - sweep(light=True) == {rt.GIVE_UP}  # busy and waited too long: two facts at once


@pytest.mark.slow
def test_the_invariants_hold_for_every_combination_of_the_facts() -> None:
    assert sweep(light=False) == set(rt.MOVES)


def test_the_label_says_the_step_or_the_end() -> None:
    assert label(None, False, OLD) is None and label(None, True, NEW) == rt.UPGRADE_REQUIRED
    assert label(record(rt.WAIT_FOR_JOBS), True, NEW) == rt.WAIT_FOR_JOBS
    assert label(record(rt.DONE), False, NEW) == rt.DONE and label(record(rt.DONE), True, NEWER) == rt.UPGRADE_REQUIRED
    abandoned = record(rt.ABANDONED)
    assert label(abandoned, True, NEW) == rt.ABANDONED  # aborted, the mismatch still there
    assert label(abandoned, True, NEWER) == rt.UPGRADE_REQUIRED and label(abandoned, False, OLD) == rt.DONE


@pytest.mark.parametrize("entry, key", [
    ({"step": "cordon-required", "target": NEW, "loaded": OLD, "cordoned": "yes"}, "cordoned"),
    ({"step": "cordon-required", "target": NEW, "loaded": OLD, "stopped_units": "dcgm.service"}, "stopped_units"),
    ({"step": "cordon-required", "target": NEW, "loaded": OLD, "waiting_since": "now"}, "waiting_since"),
    ({"step": "pod-restart-required", "target": NEW, "loaded": OLD, "stopped_mps": [1]}, "stopped_mps"),
    ({"step": "cordon-required", "target": None, "loaded": OLD}, "target"),
    ({"step": "cordon-required", "loaded": OLD}, "no target"),
    ({"step": "reboot-required", "target": NEW, "loaded": OLD}, "step"),
    ({"step": "cordon-required", "target": NEW, "loaded": OLD, "reason": "whim"}, "reason"),
])
def test_a_record_of_the_wrong_shape_is_named(entry: dict[str, object], key: str) -> None:
    with pytest.raises(AgentError, match=key):
        Progress.from_json(entry)


def test_a_record_of_an_older_agent_reads() -> None:
    """The fields this issue added have defaults: a record written before them goes on."""
    old = {"step": "pod-restart-required", "target": NEW, "loaded": OLD, "started": 1.0, "modules": ["nvidia"],
           "cordoned": True, "notes": [], "stopped_units": [UNIT], "waiting_since": None, "failed_step": None,
           "failure": None, "forced": False, "plugin_stopped": True}
    progress = Progress.from_json(old)
    assert progress.reason == rt.VERSION and progress.boot_id is None and progress.unloaded == []
    assert progress.stopped_mps == []  # an agent from before quit no MPS daemon
    # No boot id recorded: no reboot is seen from it, the versions still speak.
    assert decide(progress, facts(NEW, NEW, boot_id=REBOOTED), NOTHING, RULES).kind == rt.FINISH
