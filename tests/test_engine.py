"""gpu_agent.daemon.engine.Engine with small fake stages: order, failures, backoff, dry-run, idempotence."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import pytest

from gpu_agent.config import load_config
from gpu_agent.config.schema import ReconcileConfig
from gpu_agent.daemon.engine import Engine, StageRun
from gpu_agent.errors import StageError, TransientError
from gpu_agent.plan import Change
from gpu_agent.stages.base import Action, Stage
from gpu_agent.state import FAILED, OK, PENDING, WAITING, AgentState

@dataclass(frozen=True)
class SetValue(Change):
    kind: ClassVar[str] = "SetValue"
    stage: str
    value: int

    def describe(self) -> str:
        return f"set {self.stage} to {self.value}"


SETTINGS = ReconcileConfig(backoff_initial_seconds=5, backoff_max_seconds=30)


class FakeStage(Stage):
    """Manages one value in `host`: plans a change when it differs from `want`, verifies it matches."""

    def __init__(self, name: str, log: list[str], want: int = 0, requires: Sequence[str] = (),
                 fail: Optional[BaseException] = None) -> None:
        self.name, self.log, self.want, self.requires, self.fail = name, log, want, tuple(requires), fail
        self.host = {"value": 0}
        self.executed = 0
        self.verified: list[Any] = []

    def observe(self) -> Any:
        self.log.append(self.name)
        if self.fail is not None:
            raise self.fail
        return dict(self.host)

    def plan(self, observed: Any) -> list[Action]:
        if observed["value"] == self.want:
            return []
        return [Action.of(SetValue(self.name, self.want), self._set)]

    def _set(self) -> None:
        self.executed += 1
        self.host["value"] = self.want

    def verify(self, observed: Any) -> str:
        self.verified.append(observed)
        if observed["value"] != self.want:
            raise StageError(f"{self.name} is {observed['value']}, wanted {self.want}")
        return f"{self.name} is {self.want}"


@pytest.fixture
def state(tmp_path: Path) -> AgentState:
    return AgentState(load_config(tmp_path / "missing.yaml", required=False))


def reconcile(engine: Engine, **kwargs: Any) -> list[StageRun]:
    return asyncio.run(engine.reconcile(**kwargs))


def test_stages_run_in_order(state: AgentState) -> None:
    log: list[str] = []
    engine = Engine([FakeStage(n, log) for n in ("c", "a", "b")], state, SETTINGS)
    runs = reconcile(engine)
    assert log == ["c", "a", "b"]
    assert [(r.stage, r.state) for r in runs] == [("c", OK), ("a", OK), ("b", OK)]
    assert state.stages["a"].message == "a is 0"
    assert state.reconciles == 1


def test_stage_error_is_recorded_and_does_not_stop_later_stages(state: AgentState) -> None:
    log: list[str] = []
    bad = FakeStage("bad", log, fail=StageError("driver not loaded: run modprobe nvidia"))
    engine = Engine([bad, FakeStage("next", log)], state, SETTINGS)
    before = time.time()
    runs = reconcile(engine)
    assert [(r.stage, r.state) for r in runs] == [("bad", FAILED), ("next", OK)]
    status = state.stages["bad"]
    assert (status.state, status.message) == (FAILED, "driver not loaded: run modprobe nvidia")
    assert status.last_error == "driver not loaded: run modprobe nvidia"
    assert status.failures == 1
    assert status.next_retry is not None and before + 4.5 <= status.next_retry <= time.time() + 5


def test_unexpected_exception_is_an_internal_error(state: AgentState) -> None:
    engine = Engine([FakeStage("buggy", [], fail=KeyError("gpus"))], state, SETTINGS)
    (run,) = reconcile(engine)
    assert run.state == FAILED
    assert run.message.startswith("internal error: KeyError")
    assert "gpus" in run.message
    assert state.stages["buggy"].state == FAILED


@pytest.mark.parametrize("failures, low, high", [(1, 4.5, 5), (2, 9, 10), (3, 18, 20), (4, 27, 30), (50, 27, 30)])
def test_backoff_doubles_and_caps(state: AgentState, failures: int, low: float, high: float) -> None:
    engine = Engine([], state, SETTINGS)
    for _ in range(20):
        assert low <= engine.backoff(failures) <= high


def test_recorded_retry_delay_grows_with_consecutive_failures(state: AgentState) -> None:
    engine = Engine([FakeStage("bad", [], fail=StageError("no"))], state, SETTINGS)
    delays = []
    for _ in range(4):
        reconcile(engine, force=True)
        status = state.stages["bad"]
        delays.append(status.next_retry - status.last_run)
    assert state.stages["bad"].failures == 4
    assert 4.5 <= delays[0] <= 5 and 9 <= delays[1] <= 10 and 18 <= delays[2] <= 20 and 27 <= delays[3] <= 30
    assert engine.next_retry() == state.stages["bad"].next_retry


def test_a_transient_failure_runs_again_on_its_own_schedule_and_leaves_the_backoff_alone(
        state: AgentState, caplog: pytest.LogCaptureFixture) -> None:
    """The Kubernetes API's faults (kube/retry.py) are retried when their schedule says: they neither wait
    for the stage's backoff nor grow it, and the engine does not log them again."""
    now = [1_700_000_000.0]
    stage = FakeStage("labels", [])
    engine = Engine([stage], state, SETTINGS, clock=lambda: now[0])
    status = state.stages["labels"]
    caplog.set_level("DEBUG")
    for attempt in range(1, 6):
        stage.fail = TransientError("GET /api/v1/nodes/n: 500 InternalError: boom", retry_at=now[0] + 2)
        (run,) = reconcile(engine)
        assert (run.state, run.retry_at) == (FAILED, now[0] + 2)
        assert (status.failures, status.backoff_failures, status.next_retry) == (attempt, 0, now[0] + 2)
        assert status.last_run == now[0] and engine.next_retry() == now[0] + 2
        assert reconcile(engine)[0].skipped  # not due yet
        now[0] += 2
    assert [record for record in caplog.records if "boom" in record.getMessage()] == []
    stage.fail = StageError("cannot write the NFD features file")  # a fault on the host: the first backoff
    reconcile(engine)
    assert (status.failures, status.backoff_failures) == (6, 1)
    assert 4.5 <= status.next_retry - now[0] <= 5
    assert "labels failed: cannot write the NFD features file (retry 1 in" in caplog.text
    now[0] = status.next_retry
    stage.fail = None
    reconcile(engine)
    assert (status.state, status.failures, status.backoff_failures, status.next_retry) == (OK, 0, 0, None)


def test_stage_in_backoff_is_skipped_unless_forced(state: AgentState) -> None:
    log: list[str] = []
    stage = FakeStage("bad", log, fail=StageError("still broken"))
    engine = Engine([stage], state, SETTINGS)
    reconcile(engine)
    (run,) = reconcile(engine)
    assert run.skipped and run.state == FAILED and run.message == "still broken"
    assert log == ["bad"]
    assert state.stages["bad"].failures == 1

    stage.fail = None
    (run,) = reconcile(engine, force=True)
    assert not run.skipped and run.state == OK
    assert log == ["bad", "bad"]
    status = state.stages["bad"]
    assert (status.state, status.failures, status.next_retry) == (OK, 0, None)
    assert status.last_error == "still broken"


def test_stage_whose_requirement_is_not_ok_waits(state: AgentState) -> None:
    log: list[str] = []
    driver = FakeStage("driver", log, fail=StageError("no driver"))
    toolkit = FakeStage("toolkit", log, requires=["driver"])
    engine = Engine([driver, toolkit], state, SETTINGS)
    runs = reconcile(engine)
    assert (runs[1].state, runs[1].message) == (WAITING, "waiting for driver")
    assert log == ["driver"]
    assert (state.stages["toolkit"].state, state.stages["toolkit"].failures) == (WAITING, 0)

    driver.fail = None
    runs = reconcile(engine, force=True)
    assert [r.state for r in runs] == [OK, OK]
    assert log == ["driver", "driver", "toolkit"]


def test_dry_run_plans_without_executing_or_recording(state: AgentState) -> None:
    log: list[str] = []
    change, same = FakeStage("change", log, want=1), FakeStage("same", log)
    engine = Engine([change, same], state, SETTINGS)
    runs = reconcile(engine, dry_run=True)
    assert [a.summary for a in runs[0].planned] == ["set change to 1"]
    assert (runs[0].state, runs[0].message, runs[0].applied) == (
        "pending", "would make 1 change(s); now: change is 0, wanted 1", False)
    assert (runs[1].state, runs[1].planned) == (OK, [])
    assert change.executed == 0 and change.host == {"value": 0}
    assert all(s.state == PENDING and s.message == "not run yet" and s.last_run is None
               for s in state.stages.values())
    assert state.reconciles == 0


def test_apply_runs_actions_once_and_verifies_the_reobserved_state(state: AgentState) -> None:
    stage = FakeStage("mig", [], want=3)
    engine = Engine([stage], state, SETTINGS)
    (run,) = reconcile(engine)
    assert run.state == OK and run.applied
    assert [a.summary for a in run.planned] == ["set mig to 3"]
    assert stage.executed == 1
    assert stage.verified == [{"value": 3}]
    status = state.stages["mig"]
    assert (status.state, status.message, status.changes_applied) == (OK, "mig is 3", 1)
    assert status.last_change is not None


def test_second_reconcile_with_nothing_to_change_runs_no_action(state: AgentState) -> None:
    stage = FakeStage("mig", [], want=3)
    engine = Engine([stage], state, SETTINGS)
    reconcile(engine)
    (run,) = reconcile(engine)
    assert run.state == OK and not run.applied and run.planned == []
    assert stage.executed == 1
    assert state.stages["mig"].changes_applied == 1
    assert state.reconciles == 2


def test_failed_verify_after_apply_is_a_failure(state: AgentState) -> None:
    class Stubborn(FakeStage):
        def _set(self) -> None:
            self.executed += 1  # the change does not stick

    stage = Stubborn("labels", [], want=1)
    (run,) = reconcile(Engine([stage], state, SETTINGS))
    assert (run.state, run.message) == (FAILED, "labels is 0, wanted 1")
    assert stage.executed == 1
    assert state.stages["labels"].changes_applied == 0


def test_dry_run_records_nothing_for_a_waiting_stage(state: AgentState) -> None:
    log: list[str] = []
    engine = Engine([FakeStage("driver", log, fail=StageError("no driver")),
                     FakeStage("toolkit", log, requires=["driver"])], state, SETTINGS)
    runs = reconcile(engine, dry_run=True)
    assert runs[1].state == WAITING
    assert (state.stages["toolkit"].state, state.stages["toolkit"].last_run) == (PENDING, None)


def test_a_requirement_on_an_unknown_stage_is_refused_when_the_engine_is_built(state: AgentState) -> None:
    with pytest.raises(ValueError, match="toolkit requires unknown stage"):
        Engine([FakeStage("toolkit", [], requires=["drvier"])], state, SETTINGS)


def test_dry_run_judges_requirements_by_this_pass(state: AgentState) -> None:
    log: list[str] = []
    engine = Engine([FakeStage("driver", log), FakeStage("toolkit", log, requires=["driver"])], state, SETTINGS)
    runs = reconcile(engine, dry_run=True)
    assert [run.state for run in runs] == [OK, OK] and log == ["driver", "toolkit"]


class Producer(FakeStage):
    produces = ("inventory",)

    def outputs(self, observed: Any) -> dict[str, Any]:
        return {"inventory": f"seen {observed['value']}"}


class Consumer(FakeStage):
    consumes = ("inventory",)

    def observe(self) -> Any:
        self.log.append(f"{self.name} got {self.inputs.get('inventory')}")
        return dict(self.host)


def test_results_flow_from_producer_to_consumer_which_runs_after_it(state: AgentState) -> None:
    log: list[str] = []
    engine = Engine([Consumer("toolkit", log), Producer("discovery", log)], state, SETTINGS)
    assert [stage.name for stage in engine.stages] == ["discovery", "toolkit"]
    reconcile(engine, dry_run=True)
    assert log == ["discovery", "toolkit got seen 0"]
    assert state.inventory is None  # a dry run records nothing in the state model
    reconcile(engine)
    assert state.inventory == "seen 0" and state.last_inventory == "seen 0"


def test_a_failed_producer_hands_none_not_a_stale_result(state: AgentState) -> None:
    log: list[str] = []
    producer = Producer("discovery", log)
    engine = Engine([producer, Consumer("toolkit", log)], state, SETTINGS)
    reconcile(engine)
    producer.fail = StageError("NVML is gone")
    reconcile(engine, force=True)
    assert log[-1] == "toolkit got None" and state.inventory is None and state.last_inventory == "seen 0"


class Slow(FakeStage):
    """Observes only once the test lets it, and says when it started."""

    def __init__(self, name: str, log: list[str], started: threading.Event, go: threading.Event) -> None:
        super().__init__(name, log)
        self.started, self.go = started, go

    def observe(self) -> Any:
        self.started.set()
        assert self.go.wait(10)
        return super().observe()


def test_a_pass_runs_its_stages_on_one_thread_and_the_loop_sees_each_outcome_as_it_ends(state: AgentState) -> None:
    log: list[str] = []
    started, go = threading.Event(), threading.Event()
    engine = Engine([FakeStage("a", log), Slow("b", log, started, go)], state, SETTINGS)
    threads: set[str] = set()
    for stage in engine.stages:
        observe = stage.observe
        stage.observe = lambda observe=observe: threads.add(threading.current_thread().name) or observe()  # type: ignore

    async def watch() -> tuple[Optional[str], Optional[str]]:
        task = asyncio.create_task(engine.reconcile())
        while not started.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # "a" ended before "b" began: its outcome is on the loop by now
        seen = (state.stages["a"].state, state.stages["b"].state)
        go.set()
        await task
        return seen

    seen = asyncio.run(watch())
    assert seen == (OK, PENDING)
    assert state.stages["b"].state == OK and state.reconciles == 1
    assert len(threads) == 1 and threading.current_thread().name not in threads


def test_a_cancelled_pass_ends_with_the_stage_it_was_running(state: AgentState) -> None:
    log: list[str] = []
    started, go = threading.Event(), threading.Event()
    engine = Engine([Slow("a", log, started, go), FakeStage("b", log)], state, SETTINGS)

    async def cancel() -> None:
        task = asyncio.create_task(engine.reconcile())
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()

    asyncio.run(cancel())  # asyncio.run waits for the worker thread to finish the stage
    assert log == ["a"] and state.reconciles == 0
