"""Liveness means progress (daemon/liveness.py): /healthz fails, and the watchdog stops pinging, once no pass
has completed within the bound the interval and the stages' timeouts give; both come back when passes do."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from gpu_agent.config import load_config
from gpu_agent.daemon import app, liveness
from gpu_agent.host.paths import Root
from gpu_agent.toolkit import versions


def _config(tmp_path: Path, text: str = "") -> Any:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n" + text)
    return load_config(path, required=True).config


def test_the_bound_is_the_interval_and_each_wait_a_pass_may_meet(tmp_path: Path) -> None:
    defaults = _config(tmp_path)
    waits = dict(liveness.waits(defaults))
    assert waits["nvml.call_timeout_seconds"] == 2 * 5
    assert waits["driver.modprobe_timeout_seconds"] == 7 * 60  # every module the driver stage knows
    assert waits["toolkit.restart_timeout_seconds"] == 3 * 60
    assert "toolkit.install" not in waits and "mig.reset_timeout_seconds" not in waits
    assert "driver.reload_units" not in waits  # driver.reload: never, and no reload asked for
    reloading = dict(liveness.waits(defaults, reloading=True))
    assert reloading["driver.reload_units"] == 2 * 4 * 60 + 7 * 60  # four units stopped and started, modules out
    assert liveness.bound(defaults) == 60 + sum(waits.values()) + liveness.GRACE_S
    assert 10 * 60 < liveness.bound(defaults) < 30 * 60  # minutes, at the defaults

    busy = _config(tmp_path, "reconcile: {interval_seconds: 600}\ntoolkit: {install: true}\n"
                             "mig: {config: all-1g.10gb, stop_units: [a.service, b.service]}\n")
    more = dict(liveness.waits(busy, gpus=16))
    assert more["toolkit.install"] == 2 * 600
    assert more["mig.reset_timeout_seconds"] == 16 * 60 and more["mig.stop_units"] == 2 * 2 * 60
    assert liveness.bound(busy, gpus=16) == liveness.bound(defaults) + 540 + 1200 + 960 + 240

    quiet = _config(tmp_path, "driver: {enabled: false}\ntoolkit: {enabled: false}\nkubernetes: {enabled: false}\n")
    assert liveness.bound(quiet) < liveness.bound(defaults)


def test_stalled_names_how_long_and_the_stage_the_pass_is_in(tmp_path: Path) -> None:
    config = _config(tmp_path)
    limit = liveness.bound(config)
    assert liveness.stalled(config, last_pass=1000.0, running=("toolkit", 1000.0), now=1000.0 + limit) is None
    problem = liveness.stalled(config, last_pass=1000.0, running=("toolkit", 1050.0), now=1000.0 + limit + 1)
    assert problem == (f"no reconcile pass completed in {limit + 1:.0f} s, more than the {limit:.0f} s a pass may "
                       f"take (reconcile.interval_seconds and the stages' timeouts); the pass in progress has been "
                       f"in stage toolkit for {limit - 49:.0f} s")
    idle = liveness.stalled(config, last_pass=0.0, running=None, now=limit + 5)
    assert idle is not None and idle.endswith("; no pass is running")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("watchdog", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["under systemd's watchdog", "without it"])
def test_a_pass_blocked_for_good_fails_healthz_and_stops_the_watchdog_until_it_completes(
        watchdog: bool, root: Path, write_config: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stage blocked in a call without a timeout (the issue's FIFO at /var/lib/dpkg/status): before, the loop
    task lived on, so /healthz stayed 200, systemd's watchdog kept being pinged, and nothing was logged."""
    monkeypatch.setattr(liveness, "GRACE_S", 0.0)
    monkeypatch.setattr(versions, "TIMEOUT_S", 0.1)
    monkeypatch.setattr(app, "_LIVENESS_POLL_S", 0.1)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    if watchdog:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
        monkeypatch.setenv("WATCHDOG_USEC", "200000")
    else:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    config = write_config({"reconcile": {"interval_seconds": 0.5}, "nvml": {"call_timeout_seconds": 0.5},
                           "driver": {"modprobe_timeout_seconds": 0.1},
                           "toolkit": {"enabled": False, "restart_timeout_seconds": 0.1},
                           "kubernetes": {"enabled": False}, "http": {"socket": ""}})
    runtime = app.Runtime.build(Root(root), load_config(config, required=True), "t4")
    url = f"http://127.0.0.1:{write_config.port}/healthz"  # type: ignore[attr-defined]
    release = threading.Event()

    def pings() -> int:
        count = 0
        while True:
            try:
                count += notify.recv(4096).decode().splitlines().count("WATCHDOG=1")
            except BlockingIOError:
                return count

    async def until(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while not (found := await asyncio.to_thread(condition)):
            assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
            await asyncio.sleep(0.05)
        return found

    def said(level: int, start: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and r.getMessage().startswith(start)]

    async def scenario() -> tuple[int, str]:
        daemon = app.Daemon(runtime, config, config_required=True)
        running = asyncio.create_task(daemon.run())
        try:
            await until(lambda: runtime.state.first_reconcile_done, "the first pass")
            assert await asyncio.to_thread(_get, url) == (200, "ok\n")
            if watchdog:
                await until(pings, "a watchdog ping")
            discovery = next(stage for stage in runtime.engine.stages if stage.name == "discovery")
            observe = discovery.observe

            def blocked() -> Any:
                release.wait()
                return observe()

            monkeypatch.setattr(discovery, "observe", blocked)
            daemon.trigger()
            failing = await until(lambda: (answer := _get(url))[0] == 500 and answer, "/healthz failing")
            await until(lambda: said(logging.ERROR, "no reconcile pass completed in "), "the error logged")
            pings()
            await asyncio.sleep(0.5)  # a ping sent as the pass stalled has arrived
            pings()
            await asyncio.sleep(1.0)  # five watchdog intervals
            silent = pings()
            release.set()
            await until(lambda: _get(url) == (200, "ok\n"), "/healthz passing again")
            await until(lambda: said(logging.WARNING, "reconcile passes complete again"), "the recovery logged")
            if watchdog:
                await until(pings, "the watchdog pinging again")
            assert silent == 0
            return failing
        finally:
            release.set()
            daemon._stopping.set()
            await running

    try:
        with caplog.at_level(logging.INFO, "gpu_agent.daemon.app"):
            status, body = asyncio.run(scenario())
    finally:
        notify.close()
        runtime.nvml.close()
    assert status == 500
    assert body.startswith("no reconcile pass completed in ") and "(reconcile.interval_seconds and the stages' " \
        "timeouts); the pass in progress has been in stage discovery for " in body
    (error,) = said(logging.ERROR, "no reconcile pass completed in ")
    ending = "; no more watchdog pings, systemd will restart the agent" if watchdog else "; /healthz fails"
    assert error.endswith(ending)
    assert len(said(logging.WARNING, "reconcile passes complete again")) == 1
