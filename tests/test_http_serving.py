"""Serving: /status and /metrics rendered once per published state and served as cached bytes (gzip
when asked, ETag and 304), probes never cached, and each endpoint capped with 503 + Retry-After.
Everything here goes through the real server on a real socket (tests/served.py)."""
from __future__ import annotations

import dataclasses
import gzip
import json
import socket
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from served import Served, read_responses

from gpu_agent.config import load_config
from gpu_agent.daemon import http as http_module
from gpu_agent.daemon import responses as responses_module
from gpu_agent.daemon.http import Endpoints, build_app
from gpu_agent.daemon.responses import Capped, Response
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
    state.inventory = nvml.inventory.read()
    state.stages["discovery"] = StageStatus("discovery", OK, "8 GPUs found")
    Sampler(nvml, state, Root(tmp_path)).sample()
    state.first_reconcile_done = True
    yield state
    nvml.close()


def app_of(state: AgentState) -> Endpoints:
    return build_app(state, make_registry(AgentCollector(state, lambda: 0, "node-1")), lambda: None)


@pytest.fixture
def served(agent_state: AgentState, tmp_path: Path) -> Iterator[Served]:
    server = Served(app_of(agent_state), tmp_path)
    yield server
    server.close()


def test_status_is_rendered_once_per_published_state(agent_state: AgentState, served: Served) -> None:
    cache = served.endpoints.caches["/status"]
    bodies = [served.get("/status")[1] for _ in range(5)]
    assert cache.renders == 1 and len(set(bodies)) == 1
    assert json.loads(bodies[0])["gpus"][0]["product"] == "NVIDIA H100 80GB HBM3"
    agent_state.stages["discovery"] = StageStatus("discovery", OK, "changed")
    assert json.loads(served.get("/status")[1])["stages"][0]["message"] == "8 GPUs found"
    agent_state.published += 1  # what Daemon.publish does
    assert json.loads(served.get("/status")[1])["stages"][0]["message"] == "changed"
    assert cache.renders == 2


def test_before_the_first_reconcile_status_is_rendered_every_time(agent_state: AgentState, served: Served) -> None:
    agent_state.first_reconcile_done = False
    for _ in range(3):
        assert served.get("/status")[0].status == 200
    assert served.endpoints.caches["/status"].renders == 3


def test_gzip_when_asked_etag_and_304(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_module, "this_second", lambda: 7)  # one body throughout: no second ticks between gets
    plain, body = served.get("/metrics", {"Accept-Encoding": "identity"})
    assert plain.status == 200 and plain.getheader("Content-Encoding") is None
    assert b"DCGM_FI_DEV_GPU_TEMP" in body and plain.getheader("Content-Length") == str(len(body))
    etag = plain.getheader("ETag")
    zipped, zipped_body = served.get("/metrics", {"Accept-Encoding": "gzip, deflate"})
    assert zipped.getheader("Content-Encoding") == "gzip" and zipped.getheader("Vary") == "Accept-Encoding"
    assert gzip.decompress(zipped_body) == body and zipped.getheader("ETag") != etag
    again, again_body = served.get("/metrics", {"Accept-Encoding": "identity", "If-None-Match": etag})
    assert again.status == 304 and again_body == b"" and again.getheader("ETag") == etag
    weak, _ = served.get("/metrics", {"If-None-Match": f'"x", W/{etag}'})
    assert weak.status == 304
    other, _ = served.get("/metrics", {"Accept-Encoding": "identity", "If-None-Match": '"other"'})
    assert other.status == 200
    refused, _ = served.get("/status", {"Accept-Encoding": "gzip;q=0"})
    assert refused.getheader("Content-Encoding") is None


def test_the_dcgm_series_are_rendered_and_compressed_once_per_sample_not_once_per_second(
        agent_state: AgentState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36's load bench: with every dcgm-exporter option on, /metrics's DCGM part is most of 600 KB, and
    rendering and gzipping it every second stalled the loop (p99 over 10 ms at 1,000 req/s). Each second
    renders the agent's own families again; the DCGM series and their deflate wait for the next sample."""
    collector = AgentCollector(agent_state, lambda: 0, "node-1")
    dcgm_renders = []
    real = collector.dcgm_text
    monkeypatch.setattr(collector, "dcgm_text", lambda: dcgm_renders.append(1) or real())
    server = Served(build_app(agent_state, make_registry(collector), lambda: None), tmp_path)
    try:
        second = [1]
        monkeypatch.setattr(http_module, "this_second", lambda: second[0])
        bodies = []
        for tick in range(3):
            second[0] = tick
            plain, body = server.get("/metrics", {"Accept-Encoding": "identity"})
            zipped, zipped_body = server.get("/metrics", {"Accept-Encoding": "gzip"})
            assert zlib.decompress(zipped_body, wbits=31) == body  # one gzip member, the whole body
            assert gzip.decompress(zipped_body) == body
            bodies.append(body)
        assert server.endpoints.caches["/metrics"].renders == 3 and len(dcgm_renders) == 1
        assert len({body.split(b"# HELP DCGM_")[1] for body in bodies}) == 1
        agent_state.samples = {uuid: dataclasses.replace(sample, temperature_c=1.0)
                               for uuid, sample in agent_state.samples.items()}  # a new sample, as published
        second[0] = 3
        body = server.get("/metrics", {"Accept-Encoding": "identity"})[1]
        assert len(dcgm_renders) == 2 and b'DCGM_FI_DEV_GPU_TEMP{gpu="0"' in body
        assert all(line.endswith(b" 1.0") for line in body.split(b"\n") if line.startswith(b"DCGM_FI_DEV_GPU_TEMP{"))
    finally:
        server.close()


@pytest.mark.parametrize("head, tail", [(b"", b""), (b"own\n", b""), (b"", b"series\n"),
                                        (b"a" * 70000, bytes(range(256)) * 900)])
def test_gzip_of_two_parts_is_one_member_of_the_whole(head: bytes, tail: bytes) -> None:
    zipped = responses_module.gzip_of(head, responses_module.Deflated(tail))
    inflater = zlib.decompressobj(wbits=31)
    assert inflater.decompress(zipped) == head + tail and inflater.eof and inflater.unused_data == b""


def test_probes_are_never_cached(agent_state: AgentState, served: Served) -> None:
    for path in ("/readyz", "/readyz?verbose", "/healthz"):
        response, _ = served.get(path)
        assert response.getheader("Cache-Control") == "no-store", path
    verbose, text = served.get("/readyz?verbose")
    assert verbose.status == 200 and text.endswith(b"readyz check passed\n") and b"[+]" in text
    assert served.get("/readyz?other=1&verbose")[1] == text
    assert served.get("/readyz")[1] == b"ok\n"
    agent_state.stages["driver"] = StageStatus("driver", "failed", "no module")
    response, text = served.get("/readyz")  # readiness is never served from a cache
    assert response.status == 503 and b"[-]driver failed: no module" in text


def test_healthz_and_livez_say_why_the_daemon_is_not_live(agent_state: AgentState, tmp_path: Path) -> None:
    problem: list[Optional[str]] = [None]
    server = Served(build_app(agent_state, make_registry(AgentCollector(agent_state, lambda: 0, "node-1")),
                              lambda: problem[0]), tmp_path)
    try:
        assert served_text(server, "/healthz") == served_text(server, "/livez") == (200, b"ok\n")
        problem[0] = "reconcile loop stopped"
        assert served_text(server, "/healthz") == served_text(server, "/livez") == (500, b"reconcile loop stopped\n")
        problem[0] = "no pass completed\x1b[2J in stage evil\nok"  # printable: one line, no escape
        assert served_text(server, "/healthz") == (500, b"no pass completed\\x1b[2J in stage evil\\nok\n")
        assert served_text(server, "/") == (200, b"gpu-agent: /healthz /livez /readyz /readyz?verbose /status "
                                                 b"/metrics\n")
    finally:
        server.close()


def served_text(server: Served, path: str) -> tuple[int, bytes]:
    response, body = server.get(path)
    return response.status, body


def _endpoints(**routes: Capped) -> Endpoints:
    return Endpoints({"/" + name: capped for name, capped in routes.items()}, {})


def test_an_endpoint_beyond_its_cap_answers_503_with_retry_after_while_slow_readers_hold_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request holds its place until its answer is written: two clients that do not read a body too
    big for the kernel's buffers fill a cap of 2; a third gets 503 at once (before their grace is out),
    other endpoints answer, and once the two read, the places are free again."""
    monkeypatch.setattr(responses_module, "UNREAD_GRACE_S", 60.0)
    big = b"x" * (1 << 20)
    slow = Capped(lambda request: Response(body=big), 2)
    other = Capped(lambda request: Response.text("ok\n"), 2)
    server = Served(_endpoints(slow=slow, other=other), tmp_path)
    server.small_send_buffers()
    readers: list[socket.socket] = []
    try:
        for _ in range(2):
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.settimeout(10)
            reader.connect(("127.0.0.1", server.port))
            reader.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(reader)
        _until(lambda: server.on_loop(lambda: slow.busy) == 2)
        shed, text = server.get("/slow")
        assert shed.status == 503 and shed.getheader("Retry-After") == "1" and text.startswith(b"busy")
        assert shed.getheader("Cache-Control") == "no-store"
        assert server.get("/other")[0].status == 200  # other endpoints are not affected
        assert server.on_loop(lambda: (slow.busy, slow.shed)) == (2, 1)
        for reader in readers:  # they read: their answers are written, their places freed
            reader.settimeout(10)
            [(status, _, body)] = read_responses(reader, 1)
            assert status == 200 and body == big
        _until(lambda: server.on_loop(lambda: slow.busy) == 0)
        assert server.get("/slow")[0].status == 200
        assert server.on_loop(lambda: (slow.busy, slow.shed)) == (0, 1)
    finally:
        for reader in readers:
            reader.close()
        server.close()


def _until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)
