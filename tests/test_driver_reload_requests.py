"""Issue 35: `gpu-agent driver reload` requests are a queue. A second command while a reload is under way
joins it and gets the same outcome, each command in its own result file (the issue's reproduction: the
second was told "no reload" and exited 1, and the first waited 11 minutes for an outcome it had overwritten).
Then its variants: an abort while a reload waits, a reload asked for behind an abort, an abort before the
reload began, a joining --force and --timeout, a reload the agent itself had under way; and request or
result files that are not what they should be (a FIFO, a directory, a link, another id, bytes that are not
JSON), which are dropped or reported, never waited on or a traceback. In this process with the daemon's
own queue over a simulated T4, then the issue's reproduction with two commands against a daemon process."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from gpu_agent.config import load_config
from gpu_agent.daemon import reload_request as rr
from gpu_agent.daemon.app import Runtime
from gpu_agent.daemon.reload_request import Outcome, ReloadQueue, ReloadRequest
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import loaded_version
from harness import SimNode
from test_driver_reload import NEW, wait_until

OLD = "550.90.07"
WAITING = "wait-for-jobs-required"


class Node:
    """A simulated T4 whose NVIDIA driver was upgraded on disk, one process on GPU 0, and the daemon's request
    queue over the agent's stages: `take()` and `run()` are what a daemon's pass does with requests."""

    def __init__(self, tmp_path: Path) -> None:
        self.sim = SimNode(tmp_path / "root", "t4")
        self.root = Root(self.sim.root)
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"version": "v1", "toolkit": {"enabled": False}}))
        self.runtime = Runtime.build(self.root, load_config(config, required=True), "t4")
        self.queue = ReloadQueue(self.root, lambda request: self.runtime.request_reload(
            request.force, request.timeout, request.abort), self.runtime.undo_request)
        asyncio.run(self.runtime.engine.reconcile(force=True))  # the node as the agent's first pass leaves it
        self.sim.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
        self.sim.sim("install-driver", NEW)

    def ask(self, force: bool = False, timeout: Any = None, abort: Any = None) -> ReloadRequest:
        """A command's request written, as `gpu-agent driver reload` writes it."""
        request = ReloadRequest(force, timeout, abort=abort)
        rr.write_request(self.root, request)
        return request

    def run(self) -> bool:
        """One pass, as the daemon runs it: requests taken (a forced pass), then concluded."""
        self.queue.take()
        runs = asyncio.run(self.runtime.engine.reconcile(force=True))
        return self.queue.conclude(runs)

    def step(self) -> str:
        return str((Ledger(self.root).driver_reload() or {}).get("step"))

    def result(self, request: ReloadRequest) -> Any:
        return rr.read_result(self.root, request.id)

    def loaded(self) -> str:
        return str(loaded_version(self.sim.machine.read(), "nvidia"))

    def close(self) -> None:
        self.runtime.nvml.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_a_second_request_joins_the_reload_under_way_and_each_gets_its_outcome(node: Node) -> None:
    first = node.ask()
    node.run()
    assert node.step() == WAITING and node.result(first) is None and node.queue.under_way
    second = node.ask()
    node.run()  # the issue: "no reload: ...", and the first one's result overwritten
    assert node.result(second) is None and node.result(first) is None and node.step() == WAITING
    node.sim.sim("clear")  # the process ends
    node.run()
    node.run()
    done = f"driver reloaded {OLD} -> {NEW}"
    one, two = node.result(first), node.result(second)
    assert one is not None and two is not None, node.step()
    assert (one.ok, two.ok) == (True, True) and one.message.startswith(done) and two.message == one.message
    assert node.loaded() == NEW and not node.queue.under_way
    assert not list((node.sim.root / "run/gpu-agent").glob("driver-reload.*"))  # each read once, then gone


def test_a_request_while_the_agent_reloads_of_itself_waits_for_that_reload(node: Node) -> None:
    """A reload under way that no command asked for (when-idle's, or one from before a restart): a request
    then is one more waiting for it, not "no reload"."""
    reload = node.runtime.request_reload(False, None)  # begun as a command's would be, then that command gone
    asyncio.run(node.runtime.engine.reconcile(force=True))
    node.runtime.undo_request(reload)
    assert node.step() == WAITING
    request = node.ask()
    node.run()
    node.run()
    assert node.result(request) is None and node.step() == WAITING
    node.sim.sim("clear")
    node.run()
    node.run()
    outcome = node.result(request)
    assert outcome is not None and outcome.ok and outcome.message.startswith(f"driver reloaded {OLD} -> {NEW}")


def test_an_abort_ends_the_reload_each_of_its_commands_told(node: Node) -> None:
    first, second = node.ask(), node.ask()
    node.run()
    assert node.step() == WAITING
    abort = node.ask(abort="alice")
    later = node.ask(abort="bob")  # joins the abort
    node.run()
    node.run()
    ended = [node.result(request) for request in (first, second, abort, later)]
    assert all(outcome is not None for outcome in ended), node.step()
    assert [outcome.ok for outcome in ended] == [False, False, True, True]  # aborted: a failure for the reload
    assert len({outcome.message for outcome in ended}) == 1 and "abandoned by alice" in ended[0].message
    assert node.loaded() == OLD and not node.queue.under_way


def test_a_reload_asked_for_during_an_abort_begins_after_it(node: Node) -> None:
    first = node.ask()
    node.run()
    abort, again = node.ask(abort="alice"), node.ask()
    began = node.run()  # the abort ends the reload; the reload asked for after it then begins
    assert node.result(first) is not None and node.result(abort) is not None
    assert began and node.queue.under_way and node.result(again) is None
    node.run()
    assert node.step() == WAITING and node.result(again) is None
    node.sim.sim("clear")
    node.run()
    node.run()
    outcome = node.result(again)
    assert outcome is not None and outcome.ok and node.loaded() == NEW


def test_an_abort_taken_with_the_reload_it_ends_before_it_began(node: Node) -> None:
    reload, abort = node.ask(), node.ask(abort="alice")
    node.run()
    node.run()
    said = node.result(reload)
    assert said == Outcome(False, "the driver reload was aborted before it began, by alice", reload.id)
    nothing = node.result(abort)
    assert nothing is not None and nothing.ok and "nothing to abort" in nothing.message
    assert node.loaded() == OLD and node.step() == "None" and not node.queue.under_way


def test_a_joining_force_forces_and_a_joining_timeout_only_shortens_the_wait(node: Node) -> None:
    node.ask(timeout=600)
    node.run()
    reload = node.runtime.reload
    assert reload is not None and not reload.force and reload.wait_seconds == 600
    node.ask(timeout=7200)
    node.queue.take()
    assert reload.wait_seconds == 600 and not reload.force
    node.ask(force=True, timeout=60)
    node.queue.take()
    assert reload.wait_seconds == 60 and reload.force


@pytest.mark.parametrize("kind", ["fifo", "directory", "full directory", "link", "other id", "bad id", "not json",
                                  "latin-1", "huge", "digits", "stale"])
def test_what_is_not_a_request_is_dropped_and_said_once(tmp_path: Path, kind: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    root = Root(tmp_path)
    run = tmp_path / "run/gpu-agent"
    run.mkdir(parents=True)
    good = ReloadRequest()
    path = run / f"driver-reload.request.{good.id}"
    at = time.time() - (3600 if kind == "stale" else 0)
    body = json.dumps({"force": False, "timeout": None, "id": good.id, "at": at, "abort": None})
    if kind == "fifo":
        os.mkfifo(path)  # a writer never comes: opening it must not wait for one
    elif kind in ("directory", "full directory"):
        path.mkdir()
        if kind == "full directory":
            (path / "x").write_text("")
    elif kind == "link":
        (tmp_path / "elsewhere").write_text(body)
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "other id":
        path.write_text(body.replace(good.id, "f" * 32))
    elif kind == "bad id":
        path = run / "driver-reload.request.\x1b[2J"
        path.write_text(body.replace(good.id, "\x1b[2J"))
    elif kind == "not json":
        path.write_text("not a request\n")
    elif kind == "latin-1":
        path.write_bytes(body.encode().replace(b'"abort": null', b'"abort": "caf\xe9"'))
    elif kind == "huge":
        path.write_text(body + " " * (rr.MAX_FILE_BYTES + 1))
    elif kind == "digits":
        path.write_text(body.replace('"timeout": null', '"timeout": ' + "9" * 5000))
    else:
        path.write_text(body)
    with caplog.at_level(logging.INFO, logger="gpu_agent.daemon.reload_request"):
        assert rr.take_requests(root) == []
        assert rr.take_requests(root) == []
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and "driver reload request" in errors[0] and "\x1b" not in errors[0], errors
    assert not any(record.exc_info for record in caplog.records)
    left = sorted(p.name for p in run.iterdir())
    if kind == "full directory":
        assert "cannot be removed" in errors[0]
    elif kind == "stale":
        assert left == [f"driver-reload.result.{good.id}"] and "stale" in json.loads(
            (run / left[0]).read_text())["message"]
    else:
        assert left == [], left
    if kind == "link":
        assert (tmp_path / "elsewhere").read_text() == body  # the link removed, not what it names


@pytest.mark.parametrize("kind", ["fifo", "directory", "not json", "another request's", "huge"])
def test_a_result_that_is_not_one_is_a_failed_outcome_not_a_wait(tmp_path: Path, kind: str) -> None:
    root = Root(tmp_path)
    request = ReloadRequest()
    path = tmp_path / f"run/gpu-agent/driver-reload.result.{request.id}"
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "not json":
        path.write_bytes(b"\xff\xfe")
    elif kind == "another request's":
        path.write_text(json.dumps({"ok": True, "message": "driver reloaded", "id": "f" * 32}))
    else:
        path.write_text(" " * (rr.MAX_FILE_BYTES + 1))
    outcome = rr.read_result(root, request.id)
    assert outcome is not None and not outcome.ok and f"driver-reload.result.{request.id}" in outcome.message


def test_results_nobody_reads_are_removed_when_another_is_written(tmp_path: Path) -> None:
    root = Root(tmp_path)
    old, new = ReloadRequest(), ReloadRequest()
    rr.write_result(root, Outcome(True, "done", old.id))
    path = root(rr.result_path(old.id))
    os.utime(path, (time.time() - rr.RESULT_TTL_S - 1,) * 2)
    rr.write_result(root, Outcome(True, "done", new.id))
    assert not path.exists() and rr.read_result(root, new.id) == Outcome(True, "done", new.id)
    rr.write_result(root, Outcome(True, "done", "../../etc/passwd"))  # no request has such an id
    assert not (tmp_path / "etc/passwd").exists()


@pytest.mark.parametrize("as_json", [False, True])
def test_the_outcome_is_printed_printable(capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    """The agent's message names what the node shows (a unit, a module, a process): an escape sequence in it
    reaches the terminal of whoever runs the command as text, never as a control."""
    from gpu_agent.cli.driver import _report

    message = "could not load nvidia: \x1b]0;owned\x07\x1b[2J\u202eevil"
    assert _report(Namespace(json=as_json), False, message, "daemon", None) == 1
    assert _report(Namespace(json=as_json), True, message, "daemon", None) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err and "\u202e" not in out + err
    if not as_json:
        assert "\\x1b[2J\\u202eevil" in out and "\\x1b[2J\\u202eevil" in err


@pytest.mark.subprocess
@pytest.mark.host_paths  # the commands read /proc/PID/cmdline of the lock's holder
def test_two_commands_against_the_daemon_each_get_the_reloads_outcome(agent: Any, root: Path, tmp_path: Path) -> None:
    """The issue's reproduction: a second `gpu-agent driver reload` while the first one's reload waits for
    the GPUs. Both get the reload's outcome and exit 0 once the GPU's process ends."""
    daemon = agent(simulate="t4", settings={"toolkit": {"enabled": False},
                                            "reconcile": {"backoff_initial_seconds": 0.5, "backoff_max_seconds": 1}})
    daemon.wait_ready()
    node = SimNode(root, "t4")
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("install-driver", NEW)
    run = root / "run/gpu-agent"

    def command() -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "gpu_agent", "--root", str(root), "--config", str(daemon.config),
                "--simulate", "t4", "driver", "reload", "--json"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean,
                                stdin=subprocess.DEVNULL)

    first = command()
    try:
        wait_until(lambda: (Ledger(Root(root)).driver_reload() or {}).get("step") == WAITING,
                   "the first command's reload waiting for the GPU", timeout=60)
        daemon.signal(signal.SIGSTOP)  # the second request is written before the agent looks again
        try:
            second = command()
            wait_until(lambda: list(run.glob("driver-reload.request*")), "the second request written", timeout=60)
        finally:
            daemon.signal(signal.SIGCONT)
        wait_until(lambda: not list(run.glob("driver-reload.request*")), "the second request taken", timeout=60)
        assert second.poll() is None and first.poll() is None  # both wait: nobody was told "no reload"
        node.sim("clear")  # the GPU's process ends
        answers = [process.communicate(timeout=120) for process in (first, second)]
    finally:
        for process in [first, *([second] if "second" in locals() else [])]:
            if process.poll() is None:
                process.kill()
                process.wait()
    outcomes = [json.loads(out) for out, _ in answers]
    assert [process.returncode for process in (first, second)] == [0, 0], answers
    assert outcomes[0]["message"].startswith(f"driver reloaded {OLD} -> {NEW}"), outcomes
    assert outcomes[1]["message"] == outcomes[0]["message"] and outcomes[0]["via"] == outcomes[1]["via"]
    assert loaded_version(node.machine.read(), "nvidia") == NEW
    assert not list(run.glob("driver-reload.*"))


def test_a_result_that_cannot_be_written_is_said_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The run directory not writable (a file where it should be): the agent's pass goes on, the log says
    which result and why, never a traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run/gpu-agent").write_text("not a directory")
    request = ReloadRequest()
    with caplog.at_level(logging.ERROR, logger="gpu_agent.daemon.reload_request"):
        rr.write_result(Root(tmp_path), Outcome(True, "driver reloaded", request.id))
    said, = [record.getMessage() for record in caplog.records]
    assert f"cannot write /run/gpu-agent/driver-reload.result.{request.id} (driver reloaded)" in said
