"""What a stage is: observe the host, plan changes as data, apply them, verify the result."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from gpu_agent.plan import Change

OUTCOMES = "outcomes"  # a name a stage may consume: this pass's outcomes so far (see Stage.inputs)


@dataclass(frozen=True)
class Action:
    """One step a stage would take: its changes as data, and how to carry them out. Several changes make
    one action where they succeed or fail together (a runtime's config files and its restart)."""

    changes: tuple[Change, ...]
    execute: Callable[[], None]
    diff: str = ""  # unified diff, for file changes

    @classmethod
    def of(cls, change: Change, execute: Callable[[], None], diff: str = "") -> Action:
        return cls((change,), execute, diff)

    @property
    def summary(self) -> str:
        return "; ".join(change.describe() for change in self.changes)

    def to_json(self) -> list[dict[str, Any]]:
        return [change.to_json() for change in self.changes]


class Stage(ABC):
    """Stages are idempotent: with nothing to change, plan() returns no action and nothing is touched.

    Every method runs on a worker thread, never on the event loop. A failure a user can fix is
    raised as StageError (or another AgentError) with a message that says what to do.

    A stage never writes the state model (and is never handed it): what it found goes back to the
    engine as its outputs, facts, claims and restarts, which the engine records.
    """

    name: str
    requires: Sequence[str] = ()  # stages that must be ok before this one runs
    produces: Sequence[str] = ()  # named results other stages consume (see outputs())
    consumes: Sequence[str] = ()  # named results of other stages, handed in as self.inputs
    gates_readiness = True  # False for sinks: their failure degrades the agent, the GPUs stay usable
    # Set by the engine before each run: this pass's results, else the last recorded; for OUTCOMES, each
    # stage's outcome (state.Outcome) by name: this pass's for the stages run before this one, the
    # recorded one for the others (not run yet in this pass, or still backing off).
    inputs: Mapping[str, Any] = {}
    # Set by the engine before each run: publishes what the stage is doing now as its outcome in progress
    # (not ready), before the pass ends. A stage calls it through report().
    progress: Optional[Callable[[str], None]] = None

    def report(self, doing: str) -> None:
        """Say what a long step waits for (a runtime's restart), for /readyz and /status while it waits."""
        if self.progress is not None:
            self.progress(doing)

    def outputs(self, observed: Any) -> dict[str, Any]:
        """This stage's results for the names in `produces`, from what it observed. The engine records
        them in the state model and hands them to the stages that consume them; a stage never writes
        the state model itself."""
        return {}

    @abstractmethod
    def observe(self) -> Any:
        """Read the current state of what this stage manages. Changes nothing."""

    def plan(self, observed: Any) -> list[Action]:
        """The changes needed to converge; empty when the host already is as configured."""
        return []

    def apply(self, actions: Sequence[Action]) -> None:
        for action in actions:
            action.execute()

    @abstractmethod
    def verify(self, observed: Any) -> str:
        """Check the converged state; return a one-line ok message or raise StageError."""

    def claims(self, observed: Any) -> Optional[set[str]]:
        """The host paths of the files this stage wants, as it observed: a file it owns (the ledger
        says so) that it no longer claims is undone by the owned-files stage. None: it cannot tell
        now (its input is broken), so nothing of it is undone."""
        return set()

    def restarts(self) -> dict[str, int]:
        """The container runtimes this stage restarted in this pass, by runtime: the engine adds them to
        the agent's counts (gpu_agent_runtime_restarts)."""
        return {}

    def facts(self, observed: Any) -> dict[str, Any]:
        """What the stage knows that /status should show beside its message (e.g. who loaded the driver)."""
        return {}

    def start_pass(self) -> None:  # noqa: B027 - an optional hook, not abstract: most stages need no setup
        """Called once at the start of each reconcile of this stage (before the first observe)."""

    def watched(self) -> list[str]:
        """Host paths whose change (another tool rewriting a file) should trigger a reconcile now."""
        return []
