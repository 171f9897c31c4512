"""Kubernetes API faults cost seconds, not minutes (issue 39).

The retry policy (kube/retry.py) is checked over every status and cause; the node's ApiState over what it
logs, holds back and shows; and the whole agent in-process, over a simulated DGX A100 against the API
emulator, through faults as kube-apiserver makes them (5xx, 503 and 429 with Retry-After, resets,
timeouts, conflicts from another writer). The agent's clock stands still while it works and skips the
waits between passes, so the timings measured are the agent's schedule, not the machine's load.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from harness import FakeClock, daemon_passes
from kube_emulator import KubeEmulator, KubePKI

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.kube import retry
from gpu_agent.kube.api_state import OK, RECOVERING, ApiState
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import ApiError, KubeClient
from gpu_agent.kube.retry import Failure, Step, next_step, retry_after_seconds

NODE = "gpu-node-1"
NODE_PATH = f"/api/v1/nodes/{NODE}"
REQUEST_TIMEOUT_S = 1.0  # of the timeout variant; the agent's default is 10 s
DEFAULT_TIMEOUT_S = 10.0


# --- the policy, over every status and cause --------------------------------------------------------

RETRIED = {408: "timeout", 429: "throttled", 500: "server-error", 502: "server-error", 503: "unavailable",
           504: "timeout"}
NOMINAL = {1: 1.0, 2: 2.0, 3: 4.0, 4: 8.0, 5: 8.0, 9: 8.0}


def expected(failure: Failure, in_a_row: int, conflicts: int, jitter: float) -> Step:
    """What the issue asks for, written out apart from the module."""
    shortened = 1 - 0.2 * jitter
    if failure.status == 409:
        return Step("re-read", "conflict") if conflicts < 3 else Step("wait", "conflict", 1.0 * shortened)
    if failure.status:
        why = RETRIED.get(failure.status) or ("server-error" if failure.status >= 500 else None)
    else:
        why = {"timeout": "timeout", "connection": "connection", "budget": "budget"}.get(failure.cause)
    if why is None:
        return Step("give up")
    if why == "budget":
        return Step("wait", "budget")
    if failure.status in (429, 503) and failure.retry_after is not None:
        return Step("wait", why, min(failure.retry_after, 60.0))
    return Step("wait", why, NOMINAL[in_a_row] * shortened)


FAILURES = [Failure(status, "", after) for status in range(100, 600) for after in (None, 0.0, 3.0, 3600.0)] + \
    [Failure(0, cause, None) for cause in ("", "timeout", "connection", "budget", "held", "tls")]


def _close(delay: Optional[float], wanted: Optional[float]) -> bool:
    """pytest.approx's default tolerances, without its cost: 180,000 comparisons here."""
    if delay is None or wanted is None:
        return delay is wanted
    return math.isclose(delay, wanted, rel_tol=1e-6, abs_tol=1e-12)


def test_the_policy_table_over_every_status_and_cause() -> None:
    for failure in FAILURES:
        for in_a_row in NOMINAL:
            for conflicts in range(5):
                for jitter in (0.0, 0.5, 0.999):
                    step, wanted = next_step(failure, in_a_row, conflicts, jitter), \
                        expected(failure, in_a_row, conflicts, jitter)
                    assert (step.action, step.reason) == (wanted.action, wanted.reason), (failure, in_a_row)
                    assert _close(step.delay, wanted.delay), (failure, in_a_row, conflicts, jitter)


def test_a_retry_of_the_api_schedule_is_never_longer_than_8_s_unless_the_server_says() -> None:
    for in_a_row in range(1, 50):
        for jitter in (0.0, 0.999):
            assert 0.8 <= next_step(Failure(500), in_a_row, 0, jitter).delay <= 8.0
    worst = sum(next_step(Failure(0, "connection"), n, 0, 0.0).delay for n in range(1, 5))
    assert worst == 15.0  # four failures in a row cost at most 15 s of waiting: 1 + 2 + 4 + 8


@pytest.mark.parametrize("value, seconds", [("1", 1.0), ("0", 0.0), (" 5 ", 5.0), ("120", 60.0),
                                            ("99999999999", 60.0), ("1.5", None), ("-1", None), ("", None),
                                            (None, None), ("Wed, 21 Oct 2015 07:28:00 GMT", None),
                                            ("\u0661", None)])
def test_retry_after_is_read_as_delay_seconds(value: Optional[str], seconds: Optional[float]) -> None:
    assert retry_after_seconds(value) == seconds


# --- the node's ApiState -------------------------------------------------------------------------------

@dataclass
class Clock:
    now: float = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_failures_hold_requests_back_then_recovery_shows_ok(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    published: list[Any] = []
    state = ApiState(RequestBudget(clock=clock), published.append, clock, jitter=lambda: 0.0)
    state.answered("GET /api/v1/nodes/n", write=False)
    assert (state.state, state.held()) == (OK, None)
    with caplog.at_level(logging.INFO, logger="gpu_agent.kube.api_state"):
        for n, delay in enumerate((1.0, 2.0, 4.0, 8.0, 8.0), start=1):
            message = f"PATCH /api/v1/nodes/n: 500 InternalError: boom {n}"
            assert state.failed(Failure(500), message, write=True).at == clock.now + delay
            assert state.held() == (clock.now + delay, message)
            clock.now += delay
            assert state.held() is None
        section = state.to_json()
        assert section is not None
        assert (section["state"], section["failed_requests"], section["retries"]) == (RECOVERING, 5,
                                                                                      {"server-error": 5})
        assert section["last_error"] == "PATCH /api/v1/nodes/n: 500 InternalError: boom 5"
        state.answered("GET /api/v1/nodes/n", write=False)  # reads answered while writes fail (a webhook down)
        assert state.state == RECOVERING
        state.answered("PATCH /api/v1/nodes/n", write=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"PATCH /api/v1/nodes/n: 500 InternalError: boom {n}; next attempt in {d:.1f} s "
                        f"(server-error, {n} failed request(s) in a row)"
                        for n, d in enumerate((1.0, 2.0, 4.0, 8.0, 8.0), start=1)]
    assert caplog.records[-1].getMessage() == ("Kubernetes API answers again (PATCH /api/v1/nodes/n) after 5 failed "
                                               "request(s) in 23 s")
    section = state.to_json()
    assert section is not None and published[-1] == section
    assert (section["state"], section["last_error"], section["next_attempt"], section["failed_requests"]) == (
        OK, None, None, 0)
    assert section["last_outage"] == {"ended": clock.now, "seconds": 23.0, "failed_requests": 5}
    count = len(published)
    state.answered("GET /api/v1/nodes/n", write=False)
    assert len(published) == count  # nothing changed: nothing published


def test_a_conflict_is_counted_not_failed_and_a_budget_refusal_says_nothing_of_the_api(clock: Clock) -> None:
    budget = RequestBudget(per_minute=12, clock=clock)
    state = ApiState(budget, clock=clock, jitter=lambda: 0.0)
    state.answered("GET", write=False)
    for conflicts in range(3):
        assert state.failed(Failure(409), "PATCH: 409 Conflict", True, conflicts).action == retry.REREAD
    assert (state.state, state.conflicts, state.failed_requests, state.held()) == (OK, 3, 0, None)
    assert state.failed(Failure(409), "PATCH: 409 Conflict", True, 3).at == clock.now + 1.0  # another writer, again
    assert state.state == RECOVERING and state.retries == {"conflict": 1}
    state.answered("PATCH", write=True)
    for _ in range(12):
        assert budget.take()
    refused = state.failed(Failure(0, retry.BUDGET), "PATCH not sent: 12 requests", write=True)
    assert refused.at == clock.now + 60  # when the budget has room again
    assert (state.state, state.held()) == (OK, None)  # the agent's own limit: the API is fine


def test_a_wait_leaves_the_budget_room_for_the_pass_that_converges(clock: Clock) -> None:
    budget = RequestBudget(per_minute=12, clock=clock)
    state = ApiState(budget, clock=clock, jitter=lambda: 0.0)
    for _ in range(10):  # ten requests this second: two left, and a converging pass needs three
        budget.take()
    assert state.failed(Failure(500), "GET: 500", write=False).at == clock.now + 60


def test_gpu_agent_status_says_when_the_api_recovers(clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_agent.cli.status import print_kube_api

    state = ApiState(RequestBudget(clock=clock), clock=clock, jitter=lambda: 0.0)
    state.answered("GET /api/v1/nodes/n", write=False)
    state.failed(Failure(503, "", 5.0), "GET /api/v1/nodes/n: 503 ServiceUnavailable: down", write=False)
    section = state.to_json()
    assert section is not None
    print_kube_api(section)
    assert capsys.readouterr().out.strip() == (
        f"Kubernetes API recovering since {time.strftime('%H:%M:%S', time.localtime(clock.now))}: 1 failed "
        f"request(s) in a row, next attempt at {time.strftime('%H:%M:%S', time.localtime(clock.now + 5))}; "
        "last: GET /api/v1/nodes/n: 503 ServiceUnavailable: down")


def test_what_a_person_must_fix_is_failing_and_left_to_the_stage_backoff(clock: Clock) -> None:
    state = ApiState(RequestBudget(clock=clock), clock=clock)
    for status in (400, 401, 403, 404, 405, 415, 422):
        assert state.failed(Failure(status), f"PATCH: {status}", write=True).action == retry.GIVE_UP
        assert state.held() is None
    assert state.state == "failing" and state.retries == {}


# --- the agent, in-process, through faults -----------------------------------------------------------

@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,), hang_seconds=30.0).start()
    yield emulator
    emulator.close()


KUBECONFIG = "/etc/kubernetes/kubelet.conf"


def failed_request(client: KubeClient) -> ApiError:
    with pytest.raises(ApiError) as raised:
        client.get_node(NODE)
    return raised.value


def test_a_transport_error_is_retried_when_it_passes_and_not_when_a_person_must_fix_it(api: KubeEmulator,
                                                                                       root: Path) -> None:
    other = KubePKI()
    try:
        api.write_kubeconfig(root / KUBECONFIG.lstrip("/"), mode="cert-data", ca_pem=other.ca_pem)
        wrong_ca = failed_request(KubeClient(Root(root), KUBECONFIG, 5, RequestBudget()))
    finally:
        other.cleanup()
    assert "certificate verify failed" in str(wrong_ca) and wrong_ca.next.action == retry.GIVE_UP
    api.write_kubeconfig(root / KUBECONFIG.lstrip("/"), mode="cert-data")
    cases = [(lambda: api.reset_next("*"), retry.CONNECTION), (lambda: api.hang_next("*"), retry.TIMEOUT),
             (lambda: api.fail_next("*", 502), ""), (api.close, retry.CONNECTION)]  # closed: refused
    for fault, cause in cases:
        fault()
        error = failed_request(KubeClient(Root(root), KUBECONFIG, 0.5, RequestBudget()))
        assert (error.cause, error.next.action) == (cause, retry.WAIT), (str(error), cause)


@dataclass
class Run:
    """A run of the agent's passes until its labels and condition are on the Node."""

    clock: FakeClock
    api: KubeEmulator
    converged: float  # the agent's clock at the end of the pass that put them there
    passes: list[dict[str, Any]]  # after each pass: the labels stage's state and /status's kubernetes_api

    def times(self) -> list[float]:
        return [self.clock.at(r.time) for r in self.api.requests]

    def faulted(self) -> list[tuple[float, Any]]:
        """The requests an outage answered (429, 5xx, a hang or a reset), with their time."""
        return [(t, r) for t, r in zip(self.times(), self.api.requests)
                if r.fault in ("hang", "reset") or (r.status or 0) >= 429]

    def most_in_a_minute(self) -> int:
        times = sorted(self.times())
        return max(sum(1 for t in times if start <= t < start + 60) for start in times)


def converge(api: KubeEmulator, root: Path, write_config: Callable[..., Path], fault: Callable[[KubeEmulator], Any],
             timeout: float = DEFAULT_TIMEOUT_S) -> Run:
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    fault(api)
    clock = FakeClock()
    config = write_config({"kubernetes": {"node_name": NODE, "request_timeout_seconds": timeout}})
    runtime = Runtime.build(Root(root), load_config(config, True), "dgx-a100", clock=clock)
    passes: list[dict[str, Any]] = []

    def on_the_node() -> bool:
        status = runtime.state.to_json()
        stage = next(s for s in status["stages"] if s["name"] == "labels")
        passes.append({"stage": stage["state"], "message": stage["message"], "api": status["kubernetes_api"]})
        condition = api.condition("GPUAgentReady")
        return api.labels().get("nvidia.com/gpu.product") == "NVIDIA-A100-SXM4-40GB" and condition is not None \
            and condition["status"] == "True"

    try:
        end = daemon_passes(runtime, clock, on_the_node, seconds=300)
    finally:
        runtime.nvml.close()
    return Run(clock, api, end, passes)


VARIANTS: dict[str, tuple[Callable[[KubeEmulator], Any], float]] = {
    "4x500-then-409": (lambda api: (api.fail_next("*", 500, count=4), api.write_next(NODE_PATH)), DEFAULT_TIMEOUT_S),
    "4x503-retry-after-3": (lambda api: api.fail_next("*", 503, count=4, retry_after=3), DEFAULT_TIMEOUT_S),
    "4x429": (lambda api: api.fail_next("*", 429, count=4), DEFAULT_TIMEOUT_S),
    "4x429-apiserver-shutting-down": (lambda api: api.fail_next(
        "*", 429, count=4, retry_after=5, message="The apiserver is shutting down, please try again later."),
        DEFAULT_TIMEOUT_S),
    "4x503-from-a-load-balancer": (lambda api: api.fail_next("*", 503, count=4), DEFAULT_TIMEOUT_S),
    "4-resets": (lambda api: api.reset_next("*", count=4), DEFAULT_TIMEOUT_S),
    "4-timeouts": (lambda api: api.hang_next("*", count=4), REQUEST_TIMEOUT_S),
    "2x500-on-the-write": (lambda api: api.fail_next(NODE_PATH, 500, count=2, method="PATCH"), DEFAULT_TIMEOUT_S),
}


# The hung requests wait out real timeouts: the slow part runs them (the fast one keeps every other kind of outage).
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "4-timeouts" else name
                                  for name in VARIANTS])
def test_after_an_api_outage_the_node_has_its_labels_within_seconds(
        name: str, api: KubeEmulator, root: Path, write_config: Callable[..., Path],
        caplog: pytest.LogCaptureFixture) -> None:
    fault, timeout = VARIANTS[name]
    with caplog.at_level(logging.INFO):
        run = converge(api, root, write_config, fault, timeout)
    faulted = run.faulted()
    assert faulted, "the fault never reached a request"
    first_error, answering_again = faulted[0][0], faulted[-1][0]  # the outage's last failed request
    assert run.converged - answering_again <= 10.0, run.passes
    # The agent's clock stands still during a request: a timeout (with the default 10 s request timeout)
    # after the first error adds its 10 s, as it would on a node.
    timeouts = sum(r.fault == "hang" for _, r in faulted[1:])
    assert run.converged - first_error + timeouts * DEFAULT_TIMEOUT_S <= 60.0, run.passes
    assert run.most_in_a_minute() <= 12
    # /status: recovering while it lasted, ok once the Node shows the labels, and no stale error.
    assert any(p["api"] and p["api"]["state"] == "recovering" and p["api"]["last_error"] for p in run.passes)
    final = run.passes[-1]
    assert final["stage"] == "ok" and final["api"]["state"] == "ok" and final["api"]["last_error"] is None
    assert final["api"]["last_outage"]["failed_requests"] == len(faulted)
    # A conflict (not a failure) costs one read and one write, at once.
    calls = [(r.method, r.status, t) for t, r in zip(run.times(), api.requests)]
    conflicts = [i for i, (method, status, _) in enumerate(calls) if (method, status) == ("PATCH", 409)]
    assert final["api"]["conflicts"] == len(conflicts) == ("409" in name)
    for i in conflicts:
        assert [(method, status) for method, status, _ in calls[i + 1:i + 3]] == [("GET", 200), ("PATCH", 200)]
        assert calls[i][2] == calls[i + 2][2]  # the same moment of the agent's clock: the same pass
    # Every failed request logged once, with its status and what comes next; the recovery once; the
    # stage's failures not again by the engine.
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "gpu_agent.kube.api_state"]
    assert len(failures) == len(faulted) and all("next attempt in" in m for m in failures), failures
    assert sum("Kubernetes API answers again" in r.getMessage() for r in caplog.records) == 1
    assert not [r for r in caplog.records if r.name == "gpu_agent.daemon.engine" and "labels failed" in r.getMessage()]


def test_retry_after_is_honoured(api: KubeEmulator, root: Path, write_config: Callable[..., Path]) -> None:
    run = converge(api, root, write_config, lambda api: api.fail_next("*", 503, count=3, retry_after=4))
    times = [t for t, _ in run.faulted()] + [run.converged]
    assert all(later - earlier >= 4.0 for earlier, later in zip(times, times[1:])), times


@pytest.mark.parametrize("conflicts", [1, 3])
def test_conflicts_cost_one_read_and_one_write_each_in_the_same_pass(
        conflicts: int, api: KubeEmulator, root: Path, write_config: Callable[..., Path]) -> None:
    run = converge(api, root, write_config, lambda api: api.write_next(NODE_PATH, count=conflicts))
    assert len(run.passes) == 1  # the first pass: no wait at all
    calls = [(r.method, r.status) for r in api.requests]
    assert calls == [("GET", 200)] + [("PATCH", 409), ("GET", 200)] * conflicts + [("PATCH", 200), ("PATCH", 200)]
    assert run.passes[-1]["api"]["conflicts"] == conflicts and run.passes[-1]["api"]["state"] == "ok"


def test_a_writer_that_keeps_changing_the_node_costs_a_short_pause(
        api: KubeEmulator, root: Path, write_config: Callable[..., Path]) -> None:
    """Four conflicts in a row: three re-reads in the pass, then a second's pause. (Each conflict costs a
    read and a write: five in a row would need 13 requests, more than a minute's budget.)"""
    run = converge(api, root, write_config, lambda api: api.write_next(NODE_PATH, count=4))
    assert len(run.passes) == 2 and run.passes[0]["stage"] == "failed" and "409" in run.passes[0]["message"]
    assert run.converged - run.clock.at(api.requests[0].time) <= 1.0
    final = run.passes[-1]["api"]
    assert (final["conflicts"], final["retries"]) == (3, {"conflict": 1})
    assert len(api.requests) == 11 and run.most_in_a_minute() <= 12
