"""Fault injection for the container runtimes: restarts that fail, hang or never answer, and kill -9 at
every point of a pass. Each row states what must hold: not ready naming the unit, the files restored,
a bounded number of restarts, and convergence once the fault clears."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import types
from pathlib import Path
from typing import Any, Optional

import pytest
import tomlkit
import yaml
from conftest import cli
from harness import SimNode, run_cli

from gpu_agent.config import load_config
from gpu_agent.daemon import engine as engine_module
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.services import config_digests
from gpu_agent.toolkit.services import wait_for_socket

TOOLKIT = ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-ctk",
           "/usr/bin/nvidia-cdi-hook")
CONFIGS = {
    "containerd": ("/etc/containerd/config.toml",
                   'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x/pause:1"\n'),
    "docker": ("/etc/docker/daemon.json", '{"log-driver": "journald"}\n'),
    "crio": ("/etc/crio/crio.conf", '[crio.runtime]\ndefault_runtime = "runc"\n'),
}
UNITS = {"containerd": "containerd.service", "docker": "docker.service", "crio": "crio.service"}
OURS = {"containerd": "/etc/containerd/conf.d/99-nvidia.toml", "docker": "/etc/docker/daemon.json",
        "crio": "/etc/crio/crio.conf.d/99-nvidia.conf"}
# What each runtime's change writes, and how to read it back whole.
MANAGED = {
    "/etc/containerd/config.toml": tomlkit.parse, "/etc/containerd/conf.d/99-nvidia.toml": tomlkit.parse,
    "/etc/docker/daemon.json": json.loads, "/etc/crio/crio.conf.d/99-nvidia.conf": tomlkit.parse,
    "/var/run/cdi/nvidia.yaml": yaml.safe_load, "/var/lib/gpu-agent/ledger.json": json.loads,
}
DOWN = {  # what /readyz says of a runtime whose restart never works
    "failed": "{unit} is failed (since ",
    "not-ready": "{unit} is active (running, since ",
    "hangs": "{unit} is activating (start, since ",
}
LEDGER = "/var/lib/gpu-agent/ledger.json"
# The stage checks containerd configs with the containerd installed here (`containerd config dump`).
RUNS_CONTAINERD = pytest.mark.subprocess
RUNTIMES = [pytest.param("containerd", marks=RUNS_CONTAINERD), "docker", "crio"]
LONG = bool(os.environ.get("GPU_AGENT_TEST_ALL"))  # `make test-all`
TRIALS = 200 if LONG else 20


def install_toolkit(root: Path, runtimes: tuple[str, ...]) -> None:
    for binary in TOOLKIT:
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n")
    for name in runtimes:
        path, text = CONFIGS[name]
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)


class Node:
    """A simulated node driven in this process, pass by pass, as the daemon drives it."""

    def __init__(self, root: Path, tmp_path: Path, settings: dict[str, Any]) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"version": "v1", **settings}))
        self.root = root
        self.runtime = Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
        self.machine: MachineState = self.runtime.services.machine  # type: ignore[attr-defined]

    def reconcile(self, force: bool = True) -> None:
        """`force`: a pass once every stage's backoff ran out (a forced pass alone holds a failed restart's
        change, see test_a_forced_pass_retries_a_failed_restart_only_for_a_new_change); else a drift pass."""
        if force:
            for status in self.runtime.state.stages.values():
                if status.next_retry is not None:
                    status.next_retry = min(status.next_retry, time.time())
        asyncio.run(self.runtime.engine.reconcile(force=force))
        self.runtime.state.first_reconcile_done = True

    def fail(self, unit: str, error: str) -> None:
        with self.machine.edit() as state:
            state["faults"].append({"id": len(state["faults"]) + 1, "call": "restart", "unit": unit, "error": error,
                                    "times": None})

    def clear(self) -> None:
        with self.machine.edit() as state:
            state["faults"] = []

    def service(self, unit: str) -> dict[str, Any]:
        return self.machine.read()["services"][unit]

    def not_ready_because(self) -> str:
        ready, failing = self.runtime.state.readiness()
        assert not ready and failing is not None and failing.name == "toolkit", failing
        return failing.reason

    def text(self, path: str) -> Optional[str]:
        target = self.root / path.lstrip("/")
        return target.read_text() if target.exists() else None


def owed(root: Path) -> dict[str, Any]:
    ledger = root / "var/lib/gpu-agent/ledger.json"
    return json.loads(ledger.read_text())["pending_restarts"] if ledger.exists() else {}


@pytest.mark.parametrize("error", ["failed", "not-ready", "hangs"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_runtime_that_does_not_come_back(root: Path, tmp_path: Path, runtime: str, error: str) -> None:
    """Not ready naming the unit, files restored, one restart a pass after the first, converges after."""
    install_toolkit(root, (runtime,))
    unit = UNITS[runtime]
    node = Node(root, tmp_path, {"toolkit": {"restart_timeout_seconds": 0.2}})
    before = {path: node.text(path) for path in MANAGED if not path.startswith("/var/")}
    node.fail(unit, error)

    node.reconcile()
    reason = node.not_ready_because()
    assert DOWN[error].format(unit=unit) in reason, reason
    assert f"{runtime}: " in reason and "the previous files are restored" in reason
    assert {path: node.text(path) for path in before} == before
    assert node.service(unit)["restarts"] == 2  # the failed one, and one on the restored files
    assert list(owed(root)) == [unit]
    assert node.text("/var/run/cdi/nvidia.yaml") is not None  # the CDI spec is not held back

    node.reconcile()  # down before the pass: one attempt, no restart on restored files it did not run
    assert DOWN[error].format(unit=unit) in node.not_ready_because()
    assert {path: node.text(path) for path in before} == before
    assert node.service(unit)["restarts"] == 3

    node.clear()
    node.reconcile()
    assert node.runtime.state.ready, node.runtime.state.summary_line()
    assert node.service(unit)["restarts"] == 4 and node.service(unit)["active_state"] == "active"
    assert node.service(unit)["loaded"] == config_digests(Root(root), unit) != {}
    assert owed(root) == {} and "nvidia" in (node.text(OURS[runtime]) or "")


@pytest.mark.parametrize("runtime, error", [  # `make test` runs docker-failed; the others are slow
    pytest.param("containerd", "failed", marks=[RUNS_CONTAINERD, pytest.mark.slow]), ("docker", "failed"),
    pytest.param("crio", "failed", marks=pytest.mark.slow),
    pytest.param("docker", "not-ready", marks=pytest.mark.slow)])
def test_no_restart_storm_with_a_drift_trigger_every_second(root: Path, tmp_path: Path, monkeypatch,
                                                             runtime: str, error: str) -> None:
    """60 s of a runtime that never comes back, with the default backoff and a drift trigger every second
    (the daemon's drift passes respect backoff; only the first pass is forced): at most 5 restarts."""
    install_toolkit(root, (runtime,))
    unit = UNITS[runtime]
    node = Node(root, tmp_path, {})
    node.fail(unit, error)
    clock = types.SimpleNamespace(now=1_000_000.0)
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(time=lambda: clock.now, monotonic=time.monotonic))
    for second in range(61):
        clock.now = 1_000_000.0 + second
        node.reconcile(force=second == 0)
    assert 4 <= node.service(unit)["restarts"] <= 5
    assert DOWN[error].format(unit=unit) in node.not_ready_because()


@RUNS_CONTAINERD
def test_one_broken_runtime_blocks_neither_the_others_nor_the_cdi_spec(root: Path, tmp_path: Path) -> None:
    install_toolkit(root, ("containerd", "docker", "crio"))
    (root / "etc/docker/daemon.json").write_text('{"features": ["cdi"]}')  # someone else's odd JSON
    node = Node(root, tmp_path, {})
    node.reconcile()
    reason = node.not_ready_because()
    assert reason.startswith("/etc/docker/daemon.json: features: expected an object"), reason
    assert node.text("/etc/docker/daemon.json") == '{"features": ["cdi"]}'
    assert node.text("/etc/containerd/conf.d/99-nvidia.toml") is not None
    assert node.text("/etc/crio/crio.conf.d/99-nvidia.conf") is not None
    assert node.text("/var/run/cdi/nvidia.yaml") is not None
    assert (node.service("containerd.service")["restarts"], node.service("docker.service")["restarts"]) == (1, 0)


def test_a_restart_owed_by_a_crashed_pass_is_done_first(root: Path, tmp_path: Path) -> None:
    install_toolkit(root, ("crio", "docker"))
    node = Node(root, tmp_path, {})
    node.reconcile()
    assert owed(root) == {} and node.service("docker.service")["restarts"] == 1
    # A pass that wrote daemon.json and died before restarting docker left this behind:
    (root / "var/lib/gpu-agent/ledger.json").write_text(json.dumps(
        {"version": 1, "pending_restarts": {"docker.service": {"since": "2025-01-06T10:00:00Z"}}}))
    node.reconcile()
    assert node.service("docker.service")["restarts"] == 2 and node.service("crio.service")["restarts"] == 1
    assert owed(root) == {} and node.runtime.state.ready


def test_a_stopped_unit_is_left_stopped_and_owes_nothing(root: Path, tmp_path: Path) -> None:
    install_toolkit(root, ("docker",))
    node = Node(root, tmp_path, {})
    with node.machine.edit() as state:  # an administrator ran `systemctl stop docker`
        state["services"]["docker.service"].update(active_state="inactive", sub_state="dead")
    node.reconcile()
    assert node.runtime.state.ready and node.service("docker.service")["restarts"] == 0
    assert "nvidia" in json.loads(node.text("/etc/docker/daemon.json") or "{}")["runtimes"] and owed(root) == {}


def test_a_broken_ledger_is_a_clear_error_and_blocks_every_write(root: Path, tmp_path: Path) -> None:
    """Every file the agent writes is recorded in the ledger first: without a usable ledger it writes nothing."""
    install_toolkit(root, ("crio",))
    ledger = root / "var/lib/gpu-agent/ledger.json"
    ledger.parent.mkdir(parents=True)
    ledger.write_text('{"version": 1, "pending_restarts": ["crio.service"]}')
    node = Node(root, tmp_path, {})
    node.reconcile()
    # The driver records the /dev/char links it creates: it is the first to name the ledger.
    for stage in ("driver", "toolkit"):
        reason = node.runtime.state.stages[stage].message
        assert reason.startswith("/var/lib/gpu-agent/ledger.json: pending_restarts: expected an object"), reason
    assert node.text(OURS["crio"]) is None and node.text("/var/run/cdi/nvidia.yaml") is None
    assert node.service("crio.service")["restarts"] == 0


def test_stray_temp_files_of_a_crash_are_removed_and_backups_written_once(root: Path, tmp_path: Path) -> None:
    install_toolkit(root, ("docker",))
    strays = [root / "etc/docker/.daemon.json.a1b2c3d4.tmp", root / "var/lib/gpu-agent/backups/.x.tmp"]
    bystander = root / "etc/docker/.other.json.a1b2c3d4.tmp"  # not a file we write: not ours to remove
    for path in strays + [bystander]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half")
    node = Node(root, tmp_path, {"toolkit": {"restart_timeout_seconds": 0.2}})
    node.fail("docker.service", "failed")
    node.reconcile()
    node.reconcile()
    assert not any(path.exists() for path in strays) and bystander.exists()
    backups = list((root / "var/lib/gpu-agent/backups").iterdir())
    assert [path.read_text() for path in backups] == [CONFIGS["docker"][1]]  # once, though written twice


# --- kill -9 ---------------------------------------------------------------------------------------


def copy_root(source: Path, target: Path) -> None:
    """cp -a: the simulated kernel's device nodes included."""
    subprocess.run(["cp", "-a", str(source), str(target)], check=True, timeout=60)


def _converged_template(base: Path) -> dict[str, Path]:
    """Two sandbox roots, with the driver up and the runtimes' own configs: `fresh` has never seen the
    toolkit stage; `configured` has, and its next pass makes nvidia the default runtime everywhere."""
    roots = {}
    for name in ("fresh", "configured"):
        root = base / name
        root.mkdir()
        install_toolkit(root, ("containerd", "docker", "crio"))
        done = SimNode(root, "dgx-h100").apply({"toolkit": {"enabled": name == "configured"}})  # in this process
        assert done.ok, [(run.stage, run.message) for run in done.runs]
        roots[name] = root
    return roots


TRIAL_SETTINGS: dict[str, dict[str, Any]] = {"fresh": {}, "configured": {"toolkit": {"set_as_default": True}}}


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, tuple[Path, Path, int]]:
    """Per scenario: the template root, the root after an uninterrupted pass, its number of crash points."""
    base = tmp_path_factory.mktemp("kill9")
    found = {}
    for scenario, template in _converged_template(base).items():
        reference = base / f"{scenario}-reference"
        copy_root(template, reference)
        log = base / f"{scenario}.points"
        done = _apply(reference, base, scenario, {"GPU_AGENT_SIM_CRASH_LOG": str(log)})
        assert done.returncode == 0 and "[+] toolkit: ok" in done.stdout, done.stdout + done.stderr
        found[scenario] = (template, reference, len(log.read_text().splitlines()))
    return found


def _apply(root: Path, base: Path, scenario: str,
           env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    config = base / f"trial-{scenario}.yaml"
    if not config.exists():
        config.write_text(yaml.safe_dump({"version": "v1", **TRIAL_SETTINGS[scenario]}))
    return cli("--simulate", "dgx-h100", "apply", "--once", root=root, config=config, env=env)


def _contents(root: Path) -> dict[str, Optional[bytes]]:
    return {path: (root / path.lstrip("/")).read_bytes() if (root / path.lstrip("/")).exists() else None
            for path in MANAGED}


def _trials() -> list[Any]:
    """(scenario, how far through its crash points): one random point in each equal slice of a pass, so
    that the 100 trials a scenario gets under `make test-all` reach every one of its points. `make test`
    runs the first of each scenario; the others are marked slow (`make test-slow`, CI)."""
    rng = random.Random(9)
    slices = TRIALS // 2
    return [pytest.param(scenario, (n + rng.random()) / slices, marks=[pytest.mark.slow] if n else [])
            for n in range(slices) for scenario in ("fresh", "configured")]


@pytest.mark.subprocess
@pytest.mark.parametrize("scenario, where", _trials(), ids=lambda v: f"{v:.3f}" if isinstance(v, float) else v)
def test_kill_9_at_any_point_of_a_pass_loses_no_restart_and_tears_no_file(
        templates, tmp_path: Path, scenario: str, where: float) -> None:
    template, reference, points = templates[scenario]
    assert TRIALS < 200 or points <= TRIALS // 2, f"{points} crash points: 100 trials no longer reach them all"
    kill_at = 1 + int(where * points)
    root = tmp_path / "root"
    copy_root(template, root)
    before, after = _contents(root), _contents(reference)

    killed = _apply(root, tmp_path, scenario, {"GPU_AGENT_SIM_KILL_AT": str(kill_at)})
    assert killed.returncode == -signal.SIGKILL, f"point {kill_at} of {points} not reached:\n{killed.stdout}"
    for path, data in _contents(root).items():  # whole: the old bytes or the new, never a mix
        if path == LEDGER:
            assert data is None or isinstance(json.loads(data), dict)
        else:
            assert data in (before[path], after[path]), f"{path} torn at point {kill_at}"

    node = Node(root, tmp_path, TRIAL_SETTINGS[scenario])  # the next pass: a new agent, in this process
    node.reconcile()
    toolkit = node.runtime.state.stages["toolkit"]
    assert toolkit.state == "ok", f"killed at {kill_at}: {toolkit.message}"
    for path, data in _contents(root).items():
        assert path == LEDGER or data == after[path], path
        assert data is None or MANAGED[path](data.decode()) is not None
    assert owed(root) == {}
    machine = MachineState(Root(root)).read()
    for unit in UNITS.values():  # every runtime restarted after its config last changed
        service = machine["services"][unit]
        assert (service["active_state"], service["ready"]) == ("active", True), unit
        assert service["loaded"] == config_digests(Root(root), unit), f"{unit} runs an old config (killed at {kill_at})"
    simulator = root / "var/lib/gpu-agent/sim"  # the simulated machine's own state, not the host's
    strays = [p for p in root.rglob(".*.tmp") if simulator not in p.parents]
    assert strays == [], strays


@pytest.mark.subprocess
def test_the_daemon_ignores_its_own_restores_and_drift_waits_for_the_backoff(agent, root: Path,
                                                                            write_config) -> None:
    install_toolkit(root, ("docker",))
    run_cli("--simulate", "dgx-h100", "sim", "fail", "restart", "--unit", "docker.service", root=root)  # until cleared
    daemon = agent("dgx-h100", settings={"reconcile": {"backoff_initial_seconds": 60}})
    daemon.wait_ready()
    _, body = daemon.wait_http("/readyz?verbose", lambda code, _: code == 503)
    assert "docker.service is failed (since " in body, body

    def restarts() -> int:
        return MachineState(Root(root)).read()["services"]["docker.service"]["restarts"]

    def toolkit_failures() -> int:
        stages = json.loads(daemon.get("/status")[1])["stages"]
        return next(stage["failures"] for stage in stages if stage["name"] == "toolkit")

    deadline = time.monotonic() + 10
    while (restarts(), toolkit_failures()) != (2, 1):  # the failed restart, and one on the restored files
        assert time.monotonic() < deadline, (restarts(), toolkit_failures())
        time.sleep(0.1)
    time.sleep(2.5)  # the drift watcher polls every second: the restored daemon.json is the agent's own write
    assert (restarts(), toolkit_failures()) == (2, 1)
    (root / "etc/docker/daemon.json").write_text('{"log-driver": "local"}\n')  # someone else's edit: drift
    time.sleep(2.5)
    assert (restarts(), toolkit_failures()) == (2, 1)  # the drift pass waits for the toolkit's backoff
    daemon.signal(signal.SIGHUP)  # the same file: a pass that honours the backoff
    readies = iter(range(1, 100))
    daemon.wait_message(lambda message: message.startswith("READY=1") and next(readies) == 2)  # the reload's
    time.sleep(1)
    assert (restarts(), toolkit_failures()) == (2, 1)
    # A new config that changes docker's change is retried now, backoff or not.
    write_config({"reconcile": {"backoff_initial_seconds": 60}, "toolkit": {"set_as_default": True}})
    daemon.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while restarts() < 3:
        assert time.monotonic() < deadline, "a new config did not retry the restart"
        time.sleep(0.1)
    assert daemon.stop() == 0
    drift = [line for line in daemon.output().splitlines() if "changed on disk" in line]
    assert len(drift) == 1 and "/etc/docker/daemon.json changed on disk" in drift[0], drift


@pytest.mark.subprocess
@pytest.mark.parametrize("seconds, backoff, most", [(3, 60.0, 2), pytest.param(10, 5.0, 3, marks=pytest.mark.slow)])
def test_a_sighup_storm_never_bypasses_a_failing_restarts_backoff(agent, root: Path, seconds: int, backoff: float,
                                                                  most: int) -> None:
    """Class: signals as fast as an operator's script can send them. 20 SIGHUPs a second with an unchanged
    config and a runtime whose restart fails: the passes honour the toolkit's backoff."""
    install_toolkit(root, ("docker",))
    run_cli("--simulate", "dgx-h100", "sim", "fail", "restart", "--unit", "docker.service", root=root)
    daemon = agent("dgx-h100", settings={"reconcile": {"backoff_initial_seconds": backoff}})
    daemon.wait_ready()

    def restarts() -> int:
        return MachineState(Root(root)).read()["services"]["docker.service"]["restarts"]

    deadline = time.monotonic() + 10
    while restarts() < 2:  # the failed restart, and one on the restored files
        assert time.monotonic() < deadline, restarts()
        time.sleep(0.1)
    for _ in range(20 * seconds):
        daemon.signal(signal.SIGHUP)
        time.sleep(0.05)
    assert daemon.wait_http("/healthz", lambda code, _: code == 200)
    assert 2 <= restarts() <= most
    assert daemon.stop() == 0


def test_a_forced_pass_retries_a_failed_restart_only_for_a_new_change(root: Path, tmp_path: Path) -> None:
    """Class: anything that forces a pass (a new config on SIGHUP, a simulator event) within a stage's
    backoff. The change whose restart failed is held until the backoff runs out; a different one is not."""
    install_toolkit(root, ("docker",))
    node = Node(root, tmp_path, {"reconcile": {"backoff_initial_seconds": 60}})
    node.fail("docker.service", "failed")
    for _ in range(3):
        asyncio.run(node.runtime.engine.reconcile(force=True))
    assert node.service("docker.service")["restarts"] == 2  # the failed one, one on the restored files
    assert "docker.service is failed (since " in node.runtime.state.stages["toolkit"].message
    (root / "etc/docker/daemon.json").write_text('{"log-driver": "local"}\n')  # a different change now
    asyncio.run(node.runtime.engine.reconcile(force=True))
    assert node.service("docker.service")["restarts"] == 3
    asyncio.run(node.runtime.engine.reconcile(force=True))
    assert node.service("docker.service")["restarts"] == 3


async def _not_ready_while_restarting(node: Node, unit: str) -> tuple[str, float]:
    """Run a pass; return the reason /readyz gives once it is not ready, and when that began, while the pass
    still runs. Fails if the pass ends first."""
    state = node.runtime.state
    task = asyncio.ensure_future(node.runtime.engine.reconcile())
    deadline = time.monotonic() + 8
    while state.ready:
        assert not task.done() and time.monotonic() < deadline, state.summary_line()
        await asyncio.sleep(0.02)
    noticed = time.time()
    _, failing = state.readiness()
    assert failing is not None and not task.done(), state.summary_line()
    await task
    return failing.reason, noticed


@pytest.mark.parametrize("runtime", ["docker", pytest.param("crio", marks=pytest.mark.slow)])
def test_not_ready_from_the_moment_a_runtime_restart_starts_hanging(root: Path, tmp_path: Path, runtime: str) -> None:
    """Class: a restart in flight (systemctl restart that does not return, a runtime that does not answer):
    /readyz names the runtime and what it waits for as soon as the restart starts, not when the pass ends."""
    install_toolkit(root, (runtime,))
    unit = UNITS[runtime]
    node = Node(root, tmp_path, {"toolkit": {"restart_timeout_seconds": 3}})
    node.reconcile()
    assert node.runtime.state.ready, node.runtime.state.summary_line()
    node.fail(unit, "hangs")
    if runtime == "docker":  # someone removed the nvidia runtime: written again, then a restart
        (root / OURS[runtime].lstrip("/")).write_text(CONFIGS[runtime][1])
    else:
        (root / OURS[runtime].lstrip("/")).unlink()
    reason, noticed = asyncio.run(_not_ready_while_restarting(node, unit))
    assert reason.startswith(f"restarting {runtime} ({unit}): waiting for `systemctl restart {unit}`"), reason
    started = node.service(unit)["restart_times"][-2]  # the hung restart; the last: the one on restored files
    assert noticed - started < 2
    assert DOWN["hangs"].format(unit=unit) in node.not_ready_because()


def test_waiting_for_a_runtime_socket_reports_how_long_and_why(tmp_path: Path) -> None:
    heard: list[str] = []
    answer = wait_for_socket(str(tmp_path / "containerd.sock"), "/run/containerd/containerd.sock", 1.5, heard.append)
    assert answer is not None and "no answer on /run/containerd/containerd.sock within 1.5 s" in answer
    assert heard and heard[0].startswith("no answer on /run/containerd/containerd.sock for 1 s ("), heard


@RUNS_CONTAINERD
def test_not_ready_while_containerd_is_down_also_after_a_drift_pass_rewrote_the_drop_in(root: Path,
                                                                                         tmp_path: Path) -> None:
    install_toolkit(root, ("containerd",))
    node = Node(root, tmp_path, {"toolkit": {"restart_timeout_seconds": 0.2}})
    node.fail("containerd.service", "failed")
    node.reconcile()
    with node.machine.edit() as state:  # `systemctl reset-failed containerd`: inactive, not failed
        state["services"]["containerd.service"].update(active_state="inactive", sub_state="dead")
    config = root / "etc/containerd/config.toml"
    config.write_text(config.read_text() + "  enable_selinux = true\n")  # an edit the drop-in copies
    node.reconcile()
    assert "containerd.service is failed (since " in node.not_ready_because()
    assert node.service("containerd.service")["restarts"] == 3  # owed, so started again with the new files
    node.clear()
    node.reconcile()
    assert node.runtime.state.ready and "enable_selinux = true" in (node.text(OURS["containerd"]) or "")


@RUNS_CONTAINERD
def test_a_runtime_that_failed_on_its_own_is_reported_not_restarted(root: Path, tmp_path: Path) -> None:
    install_toolkit(root, ("containerd",))
    node = Node(root, tmp_path, {})
    node.reconcile()
    assert node.runtime.state.ready
    with node.machine.edit() as state:  # containerd crashed; systemd gave up on it
        state["services"]["containerd.service"].update(active_state="failed", sub_state="failed", since=1736157600)
    node.reconcile()
    reason = node.not_ready_because()
    assert reason == ("containerd.service is failed (since Mon 2025-01-06 10:00:00 UTC); "
                      "see journalctl -u containerd.service"), reason
    assert node.service("containerd.service")["restarts"] == 1  # the agent owes it nothing


# --- the ledger, systemctl show, backups -------------------------------------------------------------


@pytest.mark.parametrize("content, reason", [
    (b"{", "line 1 column 2: not valid JSON"),
    (b"[]", "expected a JSON object"),
    (b'{"version": 2, "pending_restarts": {}}', "version: 2 is not a ledger version this gpu-agent knows (1)"),
    (b'{"pending_restarts": {}}', "version: None is not a ledger version"),
    (b'{"version": 1, "pending_restarts": ["containerd.service"]}', "pending_restarts: expected an object"),
    (b'{"version": 1, "pending_restarts": {"containerd.service": 1}}', "pending_restarts: expected an object"),
    (b'{"version": 1, "pending_restarts": {}, "links": {"/dev/char/195:0": {"owner": "driver"}}}',
     "links: expected an object"),
    (b'{"version": 1, "pending_restarts": {}, "x": "\xff"}', "not UTF-8 text (byte 45)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b" " * (2 << 20), "larger than 1048576 bytes"),
    (None, "cannot read it (a directory, not a file)"),
])
def test_a_broken_ledger_is_refused_naming_the_file_and_left_alone(root: Path, content: Optional[bytes],
                                                                    reason: str) -> None:
    from gpu_agent.host.ledger import Ledger, LedgerError

    path = root / "var/lib/gpu-agent/ledger.json"
    path.parent.mkdir(parents=True)
    path.mkdir() if content is None else path.write_bytes(content)
    ledger = Ledger(Root(root))
    for call in (ledger.pending_restarts, lambda: ledger.add_pending_restart("docker.service")):
        with pytest.raises(LedgerError) as error:
            call()
        assert str(error.value).startswith(f"/var/lib/gpu-agent/ledger.json: {reason}"), str(error.value)
    assert path.is_dir() if content is None else path.read_bytes() == content


def test_the_ledger_records_durably_and_writes_only_on_change(root: Path) -> None:
    from gpu_agent.host.ledger import Ledger

    ledger = Ledger(Root(root))
    ledger.clear_pending_restart("docker.service")
    assert not (root / "var/lib/gpu-agent/ledger.json").exists()  # nothing owed, nothing written
    ledger.add_pending_restart("docker.service")
    path = root / "var/lib/gpu-agent/ledger.json"
    stamp = (path.stat().st_ino, path.stat().st_mtime_ns)
    ledger.add_pending_restart("docker.service")
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp and path.stat().st_mode & 0o777 == 0o600
    assert Ledger(Root(root)).pending_restarts() == {"docker.service"}
    ledger.clear_pending_restart("docker.service")
    assert json.loads(path.read_text()) == {"version": 1, "pending_restarts": {}, "owned": {}, "links": {}}


@pytest.mark.parametrize("output, described", [
    (("LoadState=loaded\nActiveState=failed\nSubState=failed\nStateChangeTimestamp=Mon 2025-01-06 10:00:00 UTC\n"
      "ActiveEnterTimestamp=Mon 2025-01-06 09:00:00 UTC\n"),
     "containerd.service is failed (since Mon 2025-01-06 10:00:00 UTC)"),
    ("ActiveState=activating\nSubState=auto-restart\nLoadState=loaded\nStateChangeTimestamp=\n",
     "containerd.service is activating (auto-restart)"),
    ("LoadState=loaded\nActiveState=active\nSubState=running\nActiveEnterTimestamp=Mon 2025-01-06 09:00:00 UTC\n",
     "containerd.service is active (running, since Mon 2025-01-06 09:00:00 UTC)"),
    ("LoadState=not-found\nActiveState=inactive\nSubState=dead\nStateChangeTimestamp=n/a\n",
     "containerd.service is inactive (dead)"),
    ("", "containerd.service is unknown"),
])
def test_systemctl_show_is_read_as_systemd_prints_it(output: str, described: str) -> None:
    from gpu_agent.toolkit.services import parse_show

    state = parse_show("containerd.service", output)
    assert state.describe() == described
    assert state.exists == ("LoadState=loaded" in output)


def test_backups_are_whole_keep_the_mode_and_are_not_repeated(root: Path) -> None:
    from gpu_agent.host.files import backup

    config = root / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("a = 1\n")
    config.chmod(0o600)
    first = backup(Root(root), "/etc/containerd/config.toml")
    assert backup(Root(root), "/etc/containerd/config.toml") == first  # same bytes: no second copy
    config.write_text("a = 2\n")
    second = backup(Root(root), "/etc/containerd/config.toml")  # within the same second, most likely
    assert first is not None and second is not None and second != first
    assert (first.read_text(), second.read_text()) == ("a = 1\n", "a = 2\n")
    assert first.stat().st_mode & 0o777 == 0o600
    assert backup(Root(root), "/etc/containerd/missing.toml") is None


def test_the_agents_own_writes_are_known_through_symlinks(root: Path) -> None:
    from gpu_agent.host.files import atomic_write, remove, stamp_of, written_by_us

    target = root / "srv/config/daemon.json"
    link = root / "etc/docker/daemon.json"
    link.parent.mkdir(parents=True)
    atomic_write(target, "{}\n")
    link.symlink_to(target)
    assert written_by_us(link, stamp_of(link)) and written_by_us(target, stamp_of(target))
    target.write_text('{"debug": true}\n')  # someone else's write
    assert not written_by_us(link, stamp_of(link))
    remove(target)
    assert written_by_us(link, stamp_of(link))  # gone, and the agent removed it
