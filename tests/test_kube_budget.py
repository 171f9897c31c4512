"""The node's API request budget (12 a minute) outlives the process that spends it. Classes: a daemon
restarting in a loop or a one-shot command beside it (one budget per node, kept under --root), a state
file that is not the budget's (corrupt, huge, not a regular file, a link), a clock set back, and a state
directory that cannot be written (the budget still holds in the process)."""
from __future__ import annotations

import logging
import os
import types
from pathlib import Path

import pytest
import yaml

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.kube import budget as budget_module
from gpu_agent.kube.budget import PATH, RATE, RequestBudget


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    now = types.SimpleNamespace(now=1_700_000_000.0)
    monkeypatch.setattr(budget_module, "time", types.SimpleNamespace(time=lambda: now.now))
    return now


def spend(budget: RequestBudget) -> int:
    """How many requests the budget allows now."""
    return sum(budget.take() for _ in range(RATE + 5))


def test_a_new_process_spends_the_same_minute(tmp_path: Path, clock: types.SimpleNamespace) -> None:
    path = tmp_path / "state/kube-requests.json"
    assert spend(RequestBudget(path=path)) == RATE
    clock.now += 30
    assert spend(RequestBudget(path=path)) == 0  # a restarted daemon: nothing left of this minute
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    clock.now += 31
    assert spend(RequestBudget(path=path)) == RATE
    first, second = RequestBudget(path=path), RequestBudget(path=path)  # two at once: a daemon and `labels`
    clock.now += 61
    assert first.take() and second.take()
    assert spend(first) + spend(second) == RATE - 2


def test_the_runtime_keeps_the_budget_under_its_root(root: Path, tmp_path: Path,
                                                     clock: types.SimpleNamespace) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1"}))
    first = Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    assert spend(first.kube_budget) == RATE
    again = Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    assert spend(again.kube_budget) == 0
    assert (root / PATH.lstrip("/")).is_file()


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"sent": "x"}', b'{"sent": [true, 1]}', b'{"sent": [null]}',
                                     b'{"sent": {"a": 1}}', b'{"other": []}', b"\xff\xfe", b"1" * 10_000,
                                     b'{"sent": [1e999, NaN, -1]}'])
def test_a_file_that_is_not_the_budget_is_started_again_with_a_log_line(
        tmp_path: Path, clock: types.SimpleNamespace, caplog: pytest.LogCaptureFixture, content: bytes) -> None:
    path = tmp_path / "kube-requests.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert spend(RequestBudget(path=path)) == RATE
    if content != b'{"sent": [1e999, NaN, -1]}':  # valid JSON times, none of the last minute
        assert f"{path} is not a request budget" in caplog.text
    assert spend(RequestBudget(path=path)) == 0  # and it is the budget's again


@pytest.mark.parametrize("kind", ["directory", "fifo", "link"])
def test_something_other_than_a_regular_file_is_never_read_through(tmp_path: Path, clock: types.SimpleNamespace,
                                                                   caplog: pytest.LogCaptureFixture, kind: str) -> None:
    path = tmp_path / "kube-requests.json"
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"sent": []}')
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(outside)
    with caplog.at_level(logging.WARNING):
        assert spend(RequestBudget(path=path)) == RATE
    assert f"{path} is not a request budget" in caplog.text
    assert outside.read_text() == '{"sent": []}'


def test_a_clock_set_back_does_not_hold_the_budget(tmp_path: Path, clock: types.SimpleNamespace) -> None:
    path = tmp_path / "kube-requests.json"
    assert spend(RequestBudget(path=path)) == RATE
    clock.now -= 3600
    assert spend(RequestBudget(path=path)) == RATE


def test_an_unwritable_state_directory_keeps_the_budget_in_the_process(
        tmp_path: Path, clock: types.SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "state").write_text("a file where the directory should be")
    budget = RequestBudget(path=tmp_path / "state/kube-requests.json")
    with caplog.at_level(logging.WARNING):
        assert spend(budget) == RATE
        clock.now += 30
        assert spend(budget) == 0
    assert caplog.text.count("cannot keep the API request budget") == 1


def test_wait_says_when_a_request_may_go_with_some_to_spare(tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    budget = RequestBudget(per_minute=4, path=tmp_path / "kube-requests.json", clock=lambda: now[0])
    assert budget.wait() == 0 and budget.wait(spare=3) == 0  # nothing spent
    for offset in (0, 10, 20):
        now[0] = 1_700_000_000.0 + offset
        assert budget.take()
    # Spent at 0, 10 and 20 s; now is 20 s. One more fits; with one to spare, the first must leave the window.
    assert budget.wait() == 0
    assert budget.wait(spare=1) == 40  # at 60 s, the request of 0 s is out of the minute
    assert budget.wait(spare=2) == 50  # two to spare: the one of 10 s too
    assert budget.wait(spare=9) == 60  # more to spare than the budget holds: the whole minute
    assert budget.take() and not budget.take()
    assert budget.wait() == 40
    now[0] += 40
    assert budget.wait() == 0 and budget.take()
    assert RequestBudget(per_minute=4, path=tmp_path / "kube-requests.json",
                         clock=lambda: now[0]).wait() == 10  # the file's times: another process's view
