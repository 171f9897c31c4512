"""The state model has one writer per part: the engine records the stages' outcomes and results, the
watchers publish through named methods, and no stage writes it. What a pass publishes (the node's
labels and GPUAgentReady condition) is what that pass computed, however late the event loop records
the outcomes: a converged node gets no API write, however loaded the machine."""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from conftest import cli
from kube_emulator import KubeEmulator
from package_source import nodes
from test_toolkit import node  # noqa: F401  (a fixture)

from gpu_agent.config import LoadedConfig, load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.daemon.engine import Engine, StageRun
from gpu_agent.host.paths import Root
from gpu_agent.kube.budget import PATH as BUDGET
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.state import AgentState

NODE = "gpu-node-1"
STAGES = Path(__file__).resolve().parent.parent / "gpu_agent" / "stages"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    yield emulator
    emulator.close()


@pytest.fixture
def loaded(root: Path, api: KubeEmulator, tmp_path: Path) -> LoadedConfig:
    """The config of a node whose kubelet.conf is its own identity, the labels stage on."""
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "kubernetes": {"node_name": NODE}}))
    return load_config(config, required=True)


def writes(api: KubeEmulator) -> list[str]:
    """The API writes the node got: each PATCH, with what it sent."""
    return [f"{request.path}: {json.dumps(request.json)}" for request in api.requests if request.method != "GET"]


class WatchedExecutor(concurrent.futures.ThreadPoolExecutor):
    """The event loop's default executor, keeping each job's future: the engine's pass runs in one."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.jobs: list[concurrent.futures.Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        job = super().submit(fn, *args, **kwargs)
        self.jobs.append(job)
        return job


def pass_with_a_busy_loop(engine: Engine) -> list[StageRun]:
    """One forced pass whose event loop stays busy until the pass's worker thread has run every stage:
    no outcome of the pass is recorded in the state model before its last stage ends (the slowest an
    event loop can be)."""
    async def main() -> list[StageRun]:
        executor = WatchedExecutor()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(executor)
        started = asyncio.ensure_future(engine.reconcile(force=True))
        while not executor.jobs:  # the pass goes to its worker thread
            await asyncio.sleep(0)
        done, _ = concurrent.futures.wait(executor.jobs, timeout=30)  # blocks the loop: nothing is recorded
        assert done, "the pass did not end"
        return await started

    return asyncio.run(main())


def test_a_late_recorder_changes_nothing_a_converged_node_is_sent(root: Path, api: KubeEmulator,
                                                                   loaded: LoadedConfig) -> None:
    first = Runtime.build(Root(root), loaded, "dgx-a100")
    try:
        assert all(run.state == "ok" for run in asyncio.run(first.engine.reconcile(force=True)))
    finally:
        first.nvml.close()
    assert api.labels()["nvidia.com/gpu-agent.ready"] == "true" and writes(api)
    api.clear_requests()

    again = Runtime.build(Root(root), loaded, "dgx-a100")  # `apply --once` again: a fresh state model
    try:
        runs = pass_with_a_busy_loop(again.engine)
    finally:
        again.nvml.close()
    assert [(run.stage, run.state) for run in runs if run.state != "ok"] == []
    assert writes(api) == []
    assert api.condition("GPUAgentReady")["status"] == "True"
    assert again.state.stages["discovery"].state == "ok"  # and the loop recorded the pass in the end


@contextlib.contextmanager
def cpu_load() -> Iterator[None]:
    """A process that spins on a CPU while the test runs: the load `apply --once` met beside other work."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait(timeout=10)


@pytest.mark.slow  # fast sibling: test_a_late_recorder_changes_nothing_a_converged_node_is_sent
@pytest.mark.subprocess  # the load: a real process beside the test's
def test_passes_on_a_converged_node_under_load_send_nothing(root: Path, api: KubeEmulator,
                                                            loaded: LoadedConfig) -> None:
    """`apply --once` 200 times (or as often as 6 s allow a loaded machine, at least 10; the code before
    this test lost the race in its first pass): each pass with a fresh state model, engine, stages and
    request budget, as each command's process has them (the simulated NVML is built once, to keep it quick)."""
    runtime = Runtime.build(Root(root), loaded, "dgx-a100")
    try:
        assert all(run.state == "ok" for run in asyncio.run(runtime.engine.reconcile(force=True)))
        api.clear_requests()
        passes, deadline = 0, time.monotonic() + 6
        with cpu_load():
            while passes < 200 and time.monotonic() < deadline:
                runtime.state = AgentState(loaded, hardware=runtime.state.hardware, machine=runtime.state.machine)
                runtime.kube_budget = RequestBudget()
                runtime.engine = Engine([], runtime.state, loaded.config.reconcile,
                                        begin_pass=runtime.nvml.inventory.begin_pass)
                runtime.engine.set_stages(runtime.stages(loaded.config))
                runs = asyncio.run(runtime.engine.reconcile(force=True))
                assert [(run.stage, run.message) for run in runs if run.state != "ok"] == [], passes
                assert writes(api) == [], f"pass {passes}"
                passes += 1
    finally:
        runtime.nvml.close()
    assert passes >= 10, f"only {passes} passes in 6 s"
    assert len(api.requests) == passes  # each pass read its node once, and wrote nothing


@pytest.mark.slow
@pytest.mark.subprocess
def test_200_apply_once_commands_on_a_converged_node_under_load_send_nothing(root: Path, api: KubeEmulator,
                                                                             tmp_path: Path) -> None:
    """The acceptance as a user meets it: `gpu-agent apply --once` run 200 times as processes, beside a
    process that keeps a CPU busy, on a node the first run converged: not one API write."""
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "kubernetes": {"node_name": NODE}}))
    argv = ("--simulate", "dgx-a100", "apply", "--once")
    first = cli(*argv, root=root, config=config, timeout=120)
    assert first.returncode == 0, first.stderr
    assert api.labels()["nvidia.com/gpu-agent.ready"] == "true"
    api.clear_requests()
    with cpu_load():
        for number in range(200):
            (root / BUDGET.lstrip("/")).unlink()  # the node's 12 requests a minute, kept across processes: fresh
            again = cli(*argv, root=root, config=config, timeout=120)
            assert again.returncode == 0, f"run {number}: {again.stderr}"
            assert writes(api) == [], f"run {number}"
    assert api.condition("GPUAgentReady")["status"] == "True"


def test_runtime_restarts_are_the_toolkit_stages_result_recorded_by_the_engine(node: Path) -> None:  # noqa: F811
    daemon_json = node / "etc/docker/daemon.json"
    daemon_json.parent.mkdir(parents=True)
    daemon_json.write_text("{}")
    config = node.parent / "config.yaml"
    config.write_text("version: v1\n")
    runtime = Runtime.build(Root(node), load_config(config, required=True), "dgx-h100")
    try:
        toolkit = next(stage for stage in runtime.engine.stages if stage.name == "toolkit")
        first = asyncio.run(runtime.engine.reconcile(force=True))
        assert next(run for run in first if run.stage == "toolkit").restarts == {"docker": 1}
        assert runtime.state.runtime_restarts == {"docker": 1}
        daemon_json.write_text("{}")  # someone else's rewrite: the runtime is changed and restarted again
        asyncio.run(runtime.engine.reconcile(force=True))
        asyncio.run(runtime.engine.reconcile(force=True))  # converged: restarts nothing
        assert toolkit.restarts() == {}
        assert runtime.state.runtime_restarts == {"docker": 2}
        metrics = render(make_registry(AgentCollector(runtime.state, lambda: 0, "node-1"))).decode()
    finally:
        runtime.nvml.close()
    assert 'gpu_agent_runtime_restarts_total{runtime="docker"} 2.0' in metrics


# --- no stage writes the state model -------------------------------------------------------------

def state_model_mentions(tree: ast.AST) -> list[str]:
    """Where a module names the state model's class, or imports from gpu_agent.state anything but
    the value types a stage may read (an outcome, a check)."""
    allowed = {"Outcome", "Check", "OK", "FAILED", "PENDING", "WAITING"}
    found = []
    for each in nodes(tree):
        if isinstance(each, ast.ImportFrom) and each.module == "gpu_agent.state":
            found += [f"line {each.lineno}: imports {alias.name}" for alias in each.names if alias.name not in allowed]
        elif isinstance(each, ast.Import):
            found += [f"line {each.lineno}: import {alias.name}" for alias in each.names
                      if alias.name == "gpu_agent.state"]
        elif isinstance(each, ast.Name) and each.id == "AgentState":
            found.append(f"line {each.lineno}: AgentState")
        elif isinstance(each, ast.Attribute) and each.attr == "AgentState":
            found.append(f"line {each.lineno}: .AgentState")
        elif isinstance(each, ast.Constant) and isinstance(each.value, str) and "AgentState" in each.value.split():
            found.append(f"line {each.lineno}: 'AgentState' in an annotation")
    return found


def test_no_stage_module_can_reach_the_state_model() -> None:
    """A stage is never handed AgentState, so none can assign to it: its findings go back to the
    engine as outputs, facts, claims and restarts."""
    offenders = {}
    for path in sorted(STAGES.glob("*.py")):
        mentions = state_model_mentions(ast.parse(path.read_text(), str(path)))
        if mentions:
            offenders[path.name] = mentions
    assert offenders == {}


def test_the_check_sees_a_stage_that_takes_the_state_model() -> None:
    tree = ast.parse("from gpu_agent.state import AgentState, OK\n"
                     "import gpu_agent.state\n"
                     "class S:\n"
                     "    def __init__(self, agent: 'AgentState') -> None:\n"
                     "        self.agent = agent\n"
                     "    def apply(self) -> None:\n"
                     "        self.agent.runtime_restarts['docker'] = 1\n"
                     "        gpu_agent.state.AgentState\n")
    assert len(state_model_mentions(tree)) == 4


WRITERS = ("publish_", "record_", "update_")


def test_no_stage_built_holds_the_state_model_or_a_writer_of_it(root: Path, api: KubeEmulator,
                                                                loaded: LoadedConfig) -> None:
    """Every stage the composition root builds (the sink, MIG, the toolkit and CDI on): none holds
    AgentState, nor one of its methods that write it."""
    config = root.parent / "everything.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "kubernetes": {"node_name": NODE},
                                      "mig": {"follow_node_label": True}}))
    runtime = Runtime.build(Root(root), load_config(config, required=True), "dgx-a100")
    try:
        stages = runtime.engine.stages
        held = {f"{stage.name}.{name}": value for stage in stages for name, value in vars(stage).items()}
    finally:
        runtime.nvml.close()
    assert {"labels", "mig", "toolkit", "cdi"} <= {stage.name for stage in stages}
    assert [name for name, value in held.items() if isinstance(value, AgentState)] == []
    assert [name for name, value in held.items() if inspect.ismethod(value) and isinstance(value.__self__, AgentState)
            and value.__name__.startswith(WRITERS)] == []
