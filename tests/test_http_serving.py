"""Serving: /status and /metrics rendered once per published state and served as cached bytes (gzip
when asked, ETag and 304), probes never cached, and each endpoint capped with 503 + Retry-After."""
from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpu_agent.config import load_config
from gpu_agent.daemon.http import RENDER_CACHES, build_app
from gpu_agent.daemon.responses import Capped
from gpu_agent.daemon.web import web
from gpu_agent.host.paths import Root
from gpu_agent.metrics.exporter import AgentCollector, make_registry
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import OK, AgentState, StageStatus


@pytest.fixture
def agent_state(tmp_path: Path) -> Any:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    SimModprobe(machine, Root(tmp_path)).load("nvidia")
    nvml = Nvml(FakeNvml(machine), call_timeout=2.0)
    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    state.inventory = nvml.inventory()
    state.stages["discovery"] = StageStatus("discovery", OK, "8 GPUs found")
    Sampler(nvml, state, Root(tmp_path)).sample()
    state.first_reconcile_done = True
    yield state
    nvml.close()


def serve(app: web.Application, scenario: Callable[[TestClient], Awaitable[None]]) -> None:
    async def run() -> None:
        async with TestClient(TestServer(app)) as client:
            await scenario(client)

    asyncio.run(run())


def app_of(state: AgentState) -> web.Application:
    return build_app(state, make_registry(AgentCollector(state, lambda: 0, "node-1")), lambda: True)


def test_status_is_rendered_once_per_published_state(agent_state: AgentState) -> None:
    app = app_of(agent_state)
    cache = app[RENDER_CACHES]["/status"]

    async def scenario(client: TestClient) -> None:
        bodies = [await (await client.get("/status")).text() for _ in range(5)]
        assert cache.renders == 1 and len(set(bodies)) == 1
        assert json.loads(bodies[0])["gpus"][0]["product"] == "NVIDIA H100 80GB HBM3"
        agent_state.stages["discovery"] = StageStatus("discovery", OK, "changed")
        assert json.loads(await (await client.get("/status")).text())["stages"][0]["message"] == "8 GPUs found"
        agent_state.published += 1  # what Daemon.publish does
        assert json.loads(await (await client.get("/status")).text())["stages"][0]["message"] == "changed"
        assert cache.renders == 2

    serve(app, scenario)


def test_before_the_first_reconcile_status_is_rendered_every_time(agent_state: AgentState) -> None:
    agent_state.first_reconcile_done = False
    app = app_of(agent_state)

    async def scenario(client: TestClient) -> None:
        for _ in range(3):
            await client.get("/status")
        assert app[RENDER_CACHES]["/status"].renders == 3

    serve(app, scenario)


def test_gzip_when_asked_etag_and_304(agent_state: AgentState) -> None:
    async def scenario(client: TestClient) -> None:
        plain = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
        body = await plain.read()
        assert plain.status == 200 and "Content-Encoding" not in plain.headers
        assert b"DCGM_FI_DEV_GPU_TEMP" in body
        etag = plain.headers["ETag"]
        zipped = await client.get("/metrics", headers={"Accept-Encoding": "gzip, deflate"}, auto_decompress=False)
        assert zipped.headers["Content-Encoding"] == "gzip" and zipped.headers["Vary"] == "Accept-Encoding"
        assert gzip.decompress(await zipped.read()) == body and zipped.headers["ETag"] != etag
        again = await client.get("/metrics", headers={"Accept-Encoding": "identity", "If-None-Match": etag})
        assert again.status == 304 and await again.read() == b"" and again.headers["ETag"] == etag
        other = await client.get("/metrics", headers={"Accept-Encoding": "identity", "If-None-Match": '"other"'})
        assert other.status == 200
        refused = await client.get("/status", headers={"Accept-Encoding": "gzip;q=0"})
        assert "Content-Encoding" not in refused.headers

    serve(app_of(agent_state), scenario)


def test_probes_are_never_cached(agent_state: AgentState) -> None:
    async def scenario(client: TestClient) -> None:
        for path in ("/readyz", "/readyz?verbose", "/healthz"):
            response = await client.get(path)
            assert response.headers["Cache-Control"] == "no-store", path
        agent_state.stages["driver"] = StageStatus("driver", "failed", "no module")
        response = await client.get("/readyz")  # readiness is never served from a cache
        assert response.status == 503 and "[-]driver failed: no module" in await response.text()

    serve(app_of(agent_state), scenario)


def test_an_endpoint_beyond_its_cap_answers_503_with_retry_after() -> None:
    release = asyncio.Event

    async def scenario_with(client: TestClient, gate: asyncio.Event, capped: Capped) -> None:
        slow = [asyncio.ensure_future(client.get("/slow")) for _ in range(2)]
        while capped.busy < 2:
            await asyncio.sleep(0.01)
        shed = await client.get("/slow")
        assert shed.status == 503 and shed.headers["Retry-After"] == "1"
        assert (await client.get("/other")).status == 200  # other endpoints are not affected
        gate.set()
        assert [r.status for r in await asyncio.gather(*slow)] == [200, 200]
        assert capped.busy == 0 and capped.shed == 1
        assert (await client.get("/slow")).status == 200

    async def run() -> None:
        gate = release()

        async def slow(request: web.Request) -> web.Response:
            await gate.wait()
            return web.Response(text="done\n")

        async def other(request: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        capped = Capped(slow, 2)
        app = web.Application()
        app.router.add_get("/slow", capped.handle)
        app.router.add_get("/other", Capped(other, 2).handle)
        async with TestClient(TestServer(app)) as client:
            await scenario_with(client, gate, capped)

    asyncio.run(run())
