"""The reconcile engine: runs stages in order, records each outcome, and backs off failing stages."""
from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gpu_agent.config.schema import ReconcileConfig
from gpu_agent.errors import AgentError, TransientError
from gpu_agent.plan import Change
from gpu_agent.printable import printable
from gpu_agent.stages.base import OUTCOMES, Action, Stage
from gpu_agent.state import FAILED, OK, PENDING, WAITING, AgentState, Outcome, StageStatus

log = logging.getLogger(__name__)

_APPLY_ROUNDS = 3
CLAIMS = "claims"  # what the owned-files stage consumes: every stage's claims (Stage.claims)


@dataclass
class StageRun:
    """What one stage did in one reconcile."""

    stage: str
    state: str
    message: str
    planned: list[Action] = field(default_factory=list)
    applied: bool = False
    skipped: bool = False  # still backing off from an earlier failure
    facts: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)  # for the names in the stage's `produces`
    claims: Optional[set[str]] = None  # the files the stage wants; None: it could not tell
    restarts: dict[str, int] = field(default_factory=dict)  # the container runtimes it restarted, how often
    attempted: list[Action] = field(default_factory=list)  # a failed run's changes, made or undone
    retry_at: Optional[float] = None  # a TransientError's: when to run again, instead of the stage's backoff

    def __post_init__(self) -> None:
        self.message = printable(self.message)  # it quotes what the driver and files say; shown everywhere


class Engine:
    def __init__(self, stages: Sequence[Stage], state: AgentState, settings: ReconcileConfig,
                 begin_pass: Callable[[], None] = lambda: None, clock: Optional[Callable[[], float]] = None) -> None:
        """`begin_pass`: called as each pass starts (what a pass may reuse from earlier in it is forgotten);
        `clock`: the unix time the outcomes and retries are recorded in (a test's own, to skip the waits)."""
        self.state = state
        self.settings = settings
        self.begin_pass = begin_pass
        self.clock = clock or (lambda: time.time())  # looked up at each call: a test may replace the module's time
        self.stages: list[Stage] = []
        self.running: Optional[tuple[str, float]] = None  # the stage a pass is in, since when (monotonic)
        # By stage: the changes of its last run, when it failed after restarting a runtime. A forced pass
        # (a changed config) retries such a stage in its backoff only for a different change.
        self._failed_restarts: dict[str, frozenset[Change]] = {}
        self.set_stages(stages)

    def set_stages(self, stages: Sequence[Stage]) -> None:
        """Run these from now on, each after the stages it requires or consumes results of; a stage no
        longer enabled leaves /status and /readyz."""
        known = {stage.name for stage in stages}
        for stage in stages:
            unknown = set(stage.requires) - known
            if unknown:
                raise ValueError(f"stage {stage.name} requires unknown stage(s) {sorted(unknown)}")
        self.stages = _ordered(stages)
        statuses = self.state.stages
        self.state.stages = {s.name: statuses.get(s.name) or StageStatus(s.name) for s in self.stages}
        for stage in self.stages:
            self.state.stages[stage.name].gates_readiness = stage.gates_readiness

    async def reconcile(self, force: bool = False, dry_run: bool = False) -> list[StageRun]:
        """One pass over every stage. `force` ignores backoff, except for a stage whose last run failed
        after restarting a runtime and that would make the same change again; `dry_run` plans without
        changing anything.

        The stages run in order on one worker thread (a thread hop each cost a no-op pass more CPU than
        most stages' own work), and each outcome is recorded on the event loop as its stage ends, so
        /status follows a long pass. A stage later in the pass never reads those records: what it
        consumes of the pass so far (results, claims, outcomes) is handed to it from the pass itself.
        Cancelled (the daemon stopping), the pass ends with the stage running."""
        self.begin_pass()
        stop = threading.Event()
        try:
            runs = await asyncio.to_thread(self._pass, force, dry_run, asyncio.get_running_loop(), stop)
        except asyncio.CancelledError:
            stop.set()
            raise
        if not dry_run:
            self.state.reconciles += 1
        return runs

    def _pass(self, force: bool, dry_run: bool, loop: asyncio.AbstractEventLoop,
              stop: threading.Event) -> list[StageRun]:
        runs: list[StageRun] = []
        results = {name: self.state.output(name) for stage in self.stages for name in stage.consumes
                   if name not in (CLAIMS, OUTCOMES)}
        claims = dict(self.state.claims)  # by stage: this pass's, else the last known
        recorded = {name: status.outcome for name, status in self.state.stages.items()}

        def on_loop(record: Callable[..., None], *args: Any) -> None:
            if dry_run or stop.is_set():
                return
            try:
                loop.call_soon_threadsafe(record, *args)
            except RuntimeError:  # the loop closed: the daemon is stopping, and its state with it
                stop.set()

        for stage in self.stages:
            if stop.is_set():
                break
            stage.inputs = {name: self._input(name, results, claims, recorded, runs) for name in stage.consumes}
            status = self.state.stages[stage.name]
            now = self.clock()
            backing_off = not dry_run and status.next_retry is not None and now < status.next_retry
            if backing_off and (not force or self._same_failed_restart(stage)):
                runs.append(StageRun(stage.name, status.state, status.message, skipped=True))
                continue
            this_pass = {run.stage: run.state for run in runs}
            blocked = [name for name in stage.requires if this_pass.get(name, recorded[name].state) != OK]
            if blocked:
                message = f"waiting for {', '.join(blocked)}"
                on_loop(_waiting, status, message, now)
                runs.append(StageRun(stage.name, WAITING, message))
                continue
            stage.progress = functools.partial(on_loop, self._progress, status)
            previous = status.state
            self.running = (stage.name, time.monotonic())
            try:
                run = self._run_stage(stage, dry_run)
            finally:
                stage.progress = None
                self.running = None
            if not dry_run:
                self._remember_restarts(stage.name, run)
            results.update(run.outputs)
            if run.outputs.get("inventory") is not None:  # as the state model records it
                results["last_inventory"] = run.outputs["inventory"]
            if run.claims is not None:
                claims[stage.name] = run.claims
            on_loop(self._record, stage, status, run, now, previous)
            runs.append(run)
        return runs

    def _progress(self, status: StageStatus, doing: str) -> None:
        """A stage's step in progress (a runtime restart it waits for): not ready until its outcome."""
        status.record(PENDING, printable(doing), None, self.clock())
        self.state.published += 1  # /status renders again

    def _remember_restarts(self, name: str, run: StageRun) -> None:
        if run.state == FAILED and run.restarts:
            self._failed_restarts[name] = _changes(run.attempted)
        else:
            self._failed_restarts.pop(name, None)

    def _same_failed_restart(self, stage: Stage) -> bool:
        """Whether a stage that failed after restarting a runtime would make the very same change now
        (observed and planned again, nothing applied); an error doing so lets the stage run and say it."""
        failed = self._failed_restarts.get(stage.name)
        if failed is None:
            return False
        try:
            stage.start_pass()
            return _changes(stage.plan(stage.observe())) == failed
        except Exception:  # the stage's own run reports it
            log.debug("planning %s again", stage.name, exc_info=True)
            return False

    @staticmethod
    def _input(name: str, results: dict[str, Any], claims: dict[str, set[str]], recorded: dict[str, Outcome],
               runs: list[StageRun]) -> Any:
        """What a stage consuming `name` is handed: a result, every stage's claims, or every stage's
        outcome (this pass's where the stage ran in it, else as recorded when the pass began)."""
        if name == CLAIMS:
            return claims
        if name == OUTCOMES:
            ran = {run.stage: run for run in runs if not run.skipped}
            return {stage: Outcome(ran[stage].state, ran[stage].message, outcome.gates_readiness) if stage in ran
                    else outcome for stage, outcome in recorded.items()}
        return results.get(name)

    def record_dry_run(self, runs: Sequence[StageRun]) -> None:
        """Take a dry run's findings into the state model, as a one-shot command's view of the node
        (`gpu-agent labels`): outcomes and results, no backoff, nothing applied."""
        now = self.clock()
        for run in runs:
            self.state.stages[run.stage].record(run.state, run.message, None, now)
            for name, value in run.outputs.items():
                self.state.record_output(name, value)

    def _run_stage(self, stage: Stage, dry_run: bool) -> StageRun:
        run = self._run(stage, dry_run)
        try:
            run.restarts = stage.restarts()
        except Exception:  # a count for /metrics: never let it hide the stage's outcome
            log.exception("restarts of %s; this is a gpu-agent bug", stage.name)
        return run

    def _run(self, stage: Stage, dry_run: bool) -> StageRun:
        observed: Any = None
        applied: list[Action] = []
        try:
            stage.start_pass()
            observed = stage.observe()
            actions = stage.plan(observed)
            if dry_run:
                outputs, claims = _outputs(stage, observed), stage.claims(observed)
                if actions:
                    return StageRun(stage.name, "pending", self._pending(stage, observed, actions), planned=actions,
                                    outputs=outputs, claims=claims)
                return StageRun(stage.name, OK, stage.verify(observed), outputs=outputs, claims=claims)
            # A change can reveal the next one (device nodes exist only once their module is loaded),
            # so apply and observe again while new changes appear, a few rounds at most. A change that
            # did not take is never repeated in the same reconcile: verify() reports it.
            for _ in range(_APPLY_ROUNDS):
                done = {action.changes for action in applied}
                actions = [action for action in actions if action.changes not in done]
                if not actions:
                    break
                for action in actions:
                    log.info("%s: %s", stage.name, action.summary)
                stage.apply(actions)
                applied += actions
                observed = stage.observe()
                actions = stage.plan(observed)
            facts, outputs, claims = stage.facts(observed), stage.outputs(observed), stage.claims(observed)
            return StageRun(stage.name, OK, stage.verify(observed), planned=applied, applied=bool(applied), facts=facts,
                            outputs=outputs, claims=claims)
        except AgentError as exc:
            return StageRun(stage.name, FAILED, str(exc), attempted=applied, facts=_facts(stage, observed),
                            outputs=_outputs(stage, observed), claims=_claims(stage, observed),
                            retry_at=exc.retry_at if isinstance(exc, TransientError) else None)
        except Exception as exc:  # a bug: keep the daemon alive, say where it is
            log.exception("stage %s crashed; this is a gpu-agent bug", stage.name)
            return StageRun(stage.name, FAILED, f"internal error: {type(exc).__name__}: {exc}",
                            outputs=dict.fromkeys(stage.produces))

    @staticmethod
    def _pending(stage: Stage, observed: object, actions: list[Action]) -> str:
        """What a dry run says: the changes, and what is wrong now that they would not fix by themselves."""
        changes = sum(len(action.changes) for action in actions)
        message = f"would make {changes} change(s)" if changes else "would change nothing on the host"
        try:
            stage.verify(observed)
        except AgentError as exc:
            message += f"; now: {exc}"
        return message

    def _record(self, stage: Stage, status: StageStatus, run: StageRun, started: float, previous: str) -> None:
        """`previous`: the outcome before the run (not the progress it reported during it)."""
        now = self.clock()
        status.duration_seconds = now - started
        status.facts = run.facts
        if run.claims is not None:
            self.state.claims = {**self.state.claims, stage.name: run.claims}
        self.state.record_runtime_restarts(run.restarts)
        for name, value in run.outputs.items():
            self.state.record_output(name, value)
        if run.state == OK:
            status.record(OK, run.message, None, now)
            status.failures, status.backoff_failures, status.next_retry = 0, 0, None
            if run.applied:
                status.changes_applied += len(run.planned)
                status.last_change = now
                status.last_plan = [change for action in run.planned for change in action.to_json()]
                status.last_plan_at = now
            if previous != OK:
                log.info("%s: ok: %s", stage.name, run.message)
            return
        status.failures += 1
        status.record(FAILED, run.message, run.message, now)
        if run.retry_at is not None:  # what failed has its own schedule, and logged the failure
            status.next_retry = run.retry_at
            return
        status.backoff_failures += 1
        delay = self.backoff(status.backoff_failures)
        status.next_retry = now + delay
        if previous != FAILED or status.backoff_failures in (1, 2) or status.backoff_failures % 10 == 0:
            log.error("%s failed: %s (retry %d in %.0f s)", stage.name, run.message, status.backoff_failures, delay)

    def backoff(self, failures: int) -> float:
        base = self.settings.backoff_initial_seconds * 2 ** min(failures - 1, 30)
        return min(base, self.settings.backoff_max_seconds) * random.uniform(0.9, 1.0)

    def next_retry(self) -> Optional[float]:
        retries = [s.next_retry for s in self.state.stages.values() if s.next_retry is not None]
        return min(retries) if retries else None


def _changes(actions: Sequence[Action]) -> frozenset[Change]:
    return frozenset(change for action in actions for change in action.changes)


def _waiting(status: StageStatus, message: str, now: float) -> None:
    status.record(WAITING, message, None, now)
    status.next_retry = None


def _facts(stage: Stage, observed: Any) -> dict[str, Any]:
    """A failed stage's facts, when it got as far as observing."""
    if observed is None:
        return {}
    try:
        return stage.facts(observed)
    except Exception:  # facts are extra information: never let them hide the stage's own error
        log.debug("facts of %s", stage.name, exc_info=True)
        return {}


def _claims(stage: Stage, observed: Any) -> Optional[set[str]]:
    """A failed stage's claims, when it observed; None (nothing undone) when it could not."""
    return stage.claims(observed) if observed is not None else None


def _outputs(stage: Stage, observed: Any) -> dict[str, Any]:
    """A stage's results; None for each where it could not observe, so consumers never see stale ones."""
    results: dict[str, Any] = dict.fromkeys(stage.produces)
    if observed is not None:
        results.update(stage.outputs(observed))
    return results


def _ordered(stages: Sequence[Stage]) -> list[Stage]:
    """The stages in their given order, moved only as far as needed to run each after the stages it
    requires and the producers of what it consumes."""
    producers = {name: stage.name for stage in stages for name in stage.produces}
    before = {stage.name: set(stage.requires) | {producers[n] for n in stage.consumes if n in producers}
              for stage in stages}
    ordered: list[Stage] = []
    pending = list(stages)
    while pending:
        ready = next((s for s in pending if before[s.name] <= {done.name for done in ordered}), None)
        if ready is None:
            raise ValueError(f"stages depend on each other in a cycle: {', '.join(s.name for s in pending)}")
        ordered.append(ready)
        pending.remove(ready)
    return ordered
