"""Stage behaviour in-process: the composition root over a simulated node, one pass at a time, and
the `gpu-agent sim` commands called as the CLI would call them, without a subprocess."""
from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

from gpu_agent.cli import build_parser, main
from gpu_agent.cli import sim as sim_cli
from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.daemon.engine import StageRun
from gpu_agent.host.paths import Root
from gpu_agent.plan import Change
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import AgentState

KERNEL = "var/lib/gpu-agent/sim/kernel"


@dataclass
class CliResult:
    """What `gpu-agent ARGS` returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*argv: str, root: Path, config: Optional[Path] = None,
            env: Optional[dict[str, str]] = None) -> CliResult:
    """`gpu-agent --root ROOT [--config CONFIG] ARGV` in this process: the CLI's main() with its output
    captured, for the commands' output and exit codes without a Python start-up per call. The
    process contract (signals, notify, the daemon) keeps conftest's cli() and agent fixtures."""
    prefix = ["--root", str(root)] + (["--config", str(config)] if config is not None else [])
    out, err = io.StringIO(), io.StringIO()
    with _environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(prefix + list(argv))
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` set and the agent's own variables (GPU_AGENT_*, NOTIFY_SOCKET, WATCHDOG_*)
    cleared, as cli() runs the command; restored afterwards."""
    ours = [key for key in os.environ if key.startswith(("GPU_AGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))]
    saved = {key: os.environ.get(key) for key in [*ours, *env]}
    for key in ours:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Pass:
    """One reconcile pass: each stage's run, and the state model it left."""

    runs: list[StageRun]
    state: AgentState

    def stage(self, name: str) -> StageRun:
        return next(run for run in self.runs if run.stage == name)

    def changes(self, name: str) -> list[Change]:
        return [change for action in self.stage(name).planned for change in action.changes]

    @property
    def ok(self) -> bool:
        return all(run.state == "ok" for run in self.runs)


@dataclass
class SimNode:
    """A simulated machine under `root`; `apply()` and `check()` are `gpu-agent apply --once` and
    `gpu-agent check` in this process."""

    root: Path
    simulate: str
    settings: dict[str, Any] = field(default_factory=dict)

    def sim(self, *argv: str) -> None:
        args = build_parser().parse_args(["--root", str(self.root), "--simulate", self.simulate, "sim", *argv])
        sim_cli.main(args)

    @property
    def machine(self) -> MachineState:
        return MachineState(Root(self.root))

    def kernel(self, host_path: str) -> Path:
        """Where a /proc, /sys, /dev or /etc/modprobe.d path of the simulated kernel lives."""
        return self.root / KERNEL / host_path.lstrip("/")

    def loaded_modules(self) -> list[str]:
        return [module["name"] for module in self.machine.read()["kernel"]["loaded"]]

    def apply(self, settings: Optional[dict[str, Any]] = None, dry_run: bool = False,
              env: Optional[dict[str, str]] = None) -> Pass:
        return self._pass(self.settings if settings is None else settings, dry_run, env)

    def uninstall(self, dry_run: bool = False) -> Pass:
        """`gpu-agent uninstall [--dry-run]`: the owned-files stage with nothing claimed."""
        from gpu_agent.cli.uninstall import stages

        return self._pass({}, dry_run, stages=stages)

    def _pass(self, settings: dict[str, Any], dry_run: bool, env: Optional[dict[str, str]] = None,
              stages: Optional[Callable[[Runtime], list[Any]]] = None) -> Pass:
        config = self.root.parent / "config.yaml"
        config.write_text(yaml.safe_dump({"version": "v1", **settings}))
        with _environment(env or {}):
            runtime = Runtime.build(Root(self.root), load_config(config, required=True), self.simulate)
            try:
                if stages is not None:
                    runtime.engine.set_stages(stages(runtime))
                runs = asyncio.run(runtime.engine.reconcile(force=True, dry_run=dry_run))
            finally:
                runtime.nvml.close()
        return Pass(runs, runtime.state)

    def check(self, settings: Optional[dict[str, Any]] = None) -> Pass:
        return self.apply(settings, dry_run=True)


class FakeClock:
    """The agent's unix time in a test: it stands still while the agent works and moves on only when the
    test skips a wait (wait_until), so what a test measures on it is the agent's schedule, whatever the
    machine's load. Requests take their real time (a timeout is real), and none on this clock."""

    def __init__(self) -> None:
        self.now = self._start = time.time()
        self._skips: list[tuple[float, float]] = []  # (real unix time of a skip, this clock's time after it)

    def __call__(self) -> float:
        return self.now

    def wait_until(self, when: float) -> None:
        if when > self.now:
            self.now = when
            self._skips.append((time.time(), when))

    def at(self, real: float) -> float:
        """This clock's time at the real unix time `real` (when the API emulator logged a request)."""
        return max((now for moment, now in self._skips if moment <= real), default=self._start)


def daemon_passes(runtime: Runtime, clock: FakeClock, until: Callable[[], bool], seconds: float) -> float:
    """Reconcile passes as the daemon's loop runs them (the first forced, each next one at the reconcile
    interval or the earliest retry a stage is due), the waits between them skipped on `clock`. Stops after
    the pass that makes `until()` hold, and returns the clock's time then; fails after `seconds` of it."""
    deadline = clock() + seconds
    first = True
    while True:
        asyncio.run(runtime.engine.reconcile(force=first))
        first = False
        if until():
            return clock()
        retry = runtime.engine.next_retry()
        due = min(clock() + runtime.state.config.config.reconcile.interval_seconds,
                  retry if retry is not None else math.inf)
        assert due <= deadline, f"not done within {seconds} s of the agent's clock"
        clock.wait_until(due)
