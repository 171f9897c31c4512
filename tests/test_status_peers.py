"""`gpu-agent status` against peers that are not the agent: a process answering on the TCP port (any local user
can bind it while the agent is down), one serving a unix socket as another user, and answers whose strings
carry terminal escapes or whose document lacks what the table reads. Only the agent's answer is ever
reported ready, and nothing a peer sends reaches the terminal raw or as a traceback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from harness import run_cli
from served import Served
from test_http_serving import agent_state, app_of  # noqa: F401  (fixture)
from test_kube_exchange import RawServer, Script, answering

from gpu_agent import endpoint_proof
from gpu_agent.cli.status import printable_document
from gpu_agent.config.schema import HttpConfig

HOSTILE = "\x1b]0;owned\x07\x1b[2J\u202eevil\r\nforged line\x9b1m\ud800"
SHOWN = "\\x1b]0;owned\\x07\\x1b[2J\\u202eevil\\r\\nforged line\\x9b1m\\ud800"


def ready_document(text: str = "ready: 8x H100") -> dict[str, Any]:
    """A /status document as the agent writes one, every string `text`-like."""
    return {
        "version": text, "ready": True, "degraded": False, "summary": text,
        "config": {"source": text, "digest": "sha256:" + text, "reload_error": text},
        "http": {"error": text},
        "stages": [{"name": text, "state": "ok", "message": text}],
        "gpus": [{"index": 0, "uuid": text, "pci_bus_id": text, "product": text, "memory_mib": 1, "health": "unhealthy",
                  "health_reason": text, "lost": False, "recovers_at": None, "failing_checks": text,
                  "query_error": None, "last_xid": {"xid": 79, "meaning": text},
                  "mig": {"capable": True, "mode": "enabled", "instances": [
                      {"uuid": text, "health": "unhealthy", "health_reason": text, "failing_checks": text}]}}],
        "mps": {"daemons": [{"resource": text, "gpus": [0], "pid": None, "active_thread_percentage": 100,
                             "pinned_memory_limits": {text: text}, "restarts": 0, "up": False, "error": text}],
                "withheld": {text: text}},
        "labels": {text: text},
    }


def answering_with(body: bytes, headers: str = "") -> Script:
    """A process that is not the agent, answering every request with `body` (HTTP/1.1 200)."""
    return answering(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body)


@pytest.fixture
def tcp_peer(write_config: Callable[..., Path]) -> Iterator[Callable[..., RawServer]]:
    peers: list[RawServer] = []

    def start(body: bytes, headers: str = "") -> RawServer:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", write_config.port))  # type: ignore[attr-defined]
        peers.append(RawServer(answering_with(body, headers), sock))
        return peers[-1]

    yield start
    for peer in peers:
        peer.sock.close()


def unix_peer(path: Path, body: bytes) -> RawServer:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return RawServer(answering_with(body), sock)


# --- a squatter on the TCP port ------------------------------------------------------------------------


def test_status_wait_never_reports_ready_from_a_squatter_on_the_tcp_port(
        root: Path, write_config: Callable[..., Path], tcp_peer: Callable[..., RawServer]) -> None:
    """The issue's reproduction: the agent down, another process answering on 127.0.0.1:9445 with a ready
    document. Before, `status --wait` fell back to TCP and exited 0 "ready"."""
    config = write_config()
    squatter = tcp_peer(json.dumps(ready_document()).encode())
    waited = run_cli("status", "--wait", "--timeout", "1", root=root, config=config)
    assert waited.returncode == 1 and waited.stdout == "", waited
    assert "gpu-agent is not running or not answering" in waited.stderr
    assert run_cli("status", root=root, config=config).returncode == 1
    assert squatter.requests == []  # never asked: the unix socket is the contract


@pytest.mark.parametrize("token", [None, "stale", "garbage"])
def test_status_over_tcp_asks_for_the_agents_proof_and_a_squatter_has_none(
        token: Optional[str], root: Path, write_config: Callable[..., Path],
        tcp_peer: Callable[..., RawServer]) -> None:
    config = write_config()
    path = root / endpoint_proof.TOKEN_PATH.lstrip("/")
    if token is not None:
        path.parent.mkdir(parents=True)
        path.write_text(endpoint_proof.new_token() if token == "stale" else "not a token\n")
    # A squatter that even copies a proof header from somewhere: not one for this challenge and body.
    squatter = tcp_peer(json.dumps(ready_document()).encode(), f"X-Gpu-Agent-Proof: {'0' * 64}\r\n")
    result = run_cli("status", "--tcp", "--wait", "--timeout", "1", root=root, config=config)
    assert result.returncode == 1 and result.stdout == "", result
    if token == "stale":  # an earlier run's token, left by a crash: the squatter cannot prove it
        assert "is not the gpu-agent of this root" in result.stderr
        assert squatter.requests and b"x-gpu-agent-challenge: " in squatter.requests[0]
        assert path.read_text().strip().encode() not in squatter.requests[0]  # the token never crosses
    else:
        assert f"cannot read the agent's token {path}" in result.stderr
        assert squatter.requests == []


def test_status_over_tcp_believes_the_agent_that_proves_its_token(agent_state: Any, tmp_path: Path) -> None:  # noqa: F811
    root = tmp_path / "root"
    root.mkdir()
    server = Served(app_of(agent_state), root)  # the agent's endpoint: it writes its token under root
    try:
        config = tmp_path / "config.yaml"
        config.write_text(f"version: v1\nhttp:\n  listen: 127.0.0.1:{server.port}\n")
        token = root / endpoint_proof.TOKEN_PATH.lstrip("/")
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        result = run_cli("status", "--tcp", root=root, config=config)
        assert result.returncode == 0 and "NVIDIA H100 80GB HBM3" in result.stdout, result
        token.write_text(endpoint_proof.new_token() + "\n")  # another agent's: this one's proof does not match
        assert "is not the gpu-agent of this root" in run_cli("status", "--tcp", root=root, config=config).stderr
    finally:
        server.close()
    assert not token.exists()  # the agent stopped: its token goes with its socket


# --- what a peer sends reaches the terminal escaped ----------------------------------------------------


def test_every_string_of_a_status_document_is_printed_escaped(root: Path, write_config: Callable[..., Path]) -> None:
    """The issue's reproduction: `status` printed a peer's strings raw, so escapes reached root's terminal
    (written as JSON escapes: JSON refuses raw control characters in a string, see the next test)."""
    peer = unix_peer(root / "run/gpu-agent/agent.sock", json.dumps(ready_document(HOSTILE)).encode())
    try:
        table = run_cli("status", root=root, config=write_config())
        as_json = run_cli("status", "--json", root=root, config=write_config())
        labels = run_cli("labels", root=root, config=write_config())
    finally:
        peer.sock.close()
    assert table.returncode == 0, table
    for out in (table.stdout, as_json.stdout, labels.stdout):
        assert not any(c in out for c in "\x1b\x07\r\u202e"), out
    assert table.stdout.count(SHOWN) >= 15  # summary, config, http error, stage, GPU, MIG device and MPS lines
    assert f"http: {SHOWN}" in table.stdout
    assert labels.stdout == f"{SHOWN}={SHOWN}\n"
    assert json.loads(as_json.stdout)["summary"] == HOSTILE  # --json: escaped by JSON itself, read back whole


@pytest.mark.parametrize("text", ["\u202eevil\u2066", "caf\u00e9 \u0085 \u009b2J", "\x1b[2J"])
def test_strings_sent_as_raw_utf8_reach_the_terminal_escaped_too(
        text: str, root: Path, write_config: Callable[..., Path]) -> None:
    """The document's bytes as UTF-8, not JSON escapes: bidirectional overrides and C1 controls are printed
    escaped; raw C0 controls make the document invalid JSON, an error that repeats none of it."""
    body = json.dumps(ready_document(text), ensure_ascii=False).encode("utf-8", "surrogatepass")
    peer = unix_peer(root / "run/gpu-agent/agent.sock", body)
    try:
        result = run_cli("status", root=root, config=write_config())
    finally:
        peer.sock.close()
    out = result.stdout + result.stderr
    assert not any(c in out for c in "\x1b\x85\x9b\u202e\u2066"), out
    assert "Traceback" not in out and result.returncode in (0, 1), result


def test_printable_document_escapes_keys_and_values_at_any_depth() -> None:
    assert printable_document({"a\nb": ["x\x1b", {"k": "\u202e"}], "n": 3, "t": True}) == {
        "a\\nb": ["x\\x1b", {"k": "\\u202e"}], "n": 3, "t": True}


@pytest.mark.parametrize("body", [
    b"{}", b'{"ready": true}', b"[]", b'"ready"', b"null", b'{"ready": "yes", "degraded": false}',
    b'{"version": 1, "summary": 2, "config": 3, "stages": 4, "gpus": 5, "ready": true, "degraded": false}',
    b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b"not json",
])
def test_a_document_the_table_cannot_read_is_an_error_not_a_traceback(
        body: bytes, root: Path, write_config: Callable[..., Path]) -> None:
    peer = unix_peer(root / "run/gpu-agent/agent.sock", body)
    try:
        result = run_cli("status", root=root, config=write_config())
        waited = run_cli("status", "--wait", "--timeout", "0.5", root=root, config=write_config())
    finally:
        peer.sock.close()
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result
    assert result.stderr.strip(), result  # says why
    assert waited.returncode in (1, 2) and "Traceback" not in waited.stderr, waited  # never ready


@pytest.mark.subprocess  # a server running as another user
@pytest.mark.skipif(os.geteuid() != 0, reason="serving a socket as another user takes root")
def test_a_unix_socket_served_by_another_user_is_not_the_agent(root: Path, write_config: Callable[..., Path],
                                                               tmp_path: Path) -> None:
    """A socket path the config points at outside the agent's own directory, served by an unprivileged user."""
    path = tmp_path / "s" / "agent.sock"
    path.parent.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-c", (  # bound here, listening as nobody: the peer's credentials are listen()'s
            "import os, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s.listen(4); print('up', flush=True)\n"
            "body = sys.argv[2].encode()\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    try:\n"
            "        c.recv(4096)\n"
            "        c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n' % len(body) + body)\n"
            "    except OSError:\n"
            "        pass\n"
            "    c.close()\n"),
         str(path), json.dumps(ready_document())], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        config = write_config({"http": {"socket": "/run/elsewhere/agent.sock"}})
        link = root / "run/elsewhere"
        link.parent.mkdir(parents=True)
        link.symlink_to(path.parent)
        result = run_cli("status", "--wait", "--timeout", "0.5", root=root, config=config)
    finally:
        server.kill()
        server.wait(10)
    assert result.returncode == 1 and "runs as uid 65534, neither root nor you: not gpu-agent" in result.stderr, result


def test_the_tcp_squatter_never_stops_the_endpoint_serving_on_the_unix_socket(
        agent_state: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """In-process: http.listen taken by another process is an error reported and retried; the unix socket
    serves meanwhile, and TCP once the port is free."""
    from gpu_agent.daemon import http as http_module

    monkeypatch.setattr(http_module, "TCP_RETRY_INITIAL_S", 0.05)
    monkeypatch.setattr(http_module, "TCP_RETRY_MAX_S", 0.2)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    root = Path(os.path.realpath(tmp_path)) / "r"
    errors: list[Optional[str]] = []
    settings = HttpConfig(listen=f"127.0.0.1:{port}", socket="/run/gpu-agent/agent.sock")
    server = Served(app_of(agent_state), root, settings, on_tcp_error=errors.append)
    try:
        assert server.server.tcp_error is not None and "Address already in use" in server.server.tcp_error
        assert errors == [server.server.tcp_error]
        assert f"cannot serve HTTP on 127.0.0.1:{port} (http.listen): Address already in use" in errors[0]
        with socket.socket(socket.AF_UNIX) as unix:
            unix.connect(str(root / "run/gpu-agent/agent.sock"))
            unix.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert unix.recv(4096).startswith(b"HTTP/1.1 200 ")
        squatter.close()
        deadline = 200
        while server.on_loop(lambda: server.server.tcp_error) is not None:
            deadline -= 1
            assert deadline, "never bound once the port was free"
            time.sleep(0.05)
        assert errors[1:] == [None]  # said once while it failed the same way, then that it is fine
        with socket.create_connection(("127.0.0.1", port), timeout=5) as tcp:
            tcp.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tcp.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        squatter.close()
        server.close()


def test_a_reload_moves_tcp_to_a_taken_port_but_the_unix_socket_only_where_it_can_bind(
        agent_state: Any, tmp_path: Path) -> None:  # noqa: F811
    from gpu_agent.errors import AgentError

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    root = Path(os.path.realpath(tmp_path)) / "r"
    first = HttpConfig(listen="127.0.0.1:0", socket="/run/gpu-agent/agent.sock")
    server = Served(app_of(agent_state), root, first)

    def readyz_over_unix(path: str) -> bytes:
        with socket.socket(socket.AF_UNIX) as unix:
            unix.connect(str(root / path.lstrip("/")))
            unix.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return unix.recv(4096)[:13]

    try:
        taken = HttpConfig(listen=f"127.0.0.1:{squatter.getsockname()[1]}", socket=first.socket)
        server.run(server.server.restart(taken))  # applies: TCP is retried, the unix socket kept as it is
        assert server.server.settings == taken and "Address already in use" in (server.server.tcp_error or "")
        assert readyz_over_unix(first.socket) == b"HTTP/1.1 200 "
        (root / "run/blocked/agent.sock").mkdir(parents=True)  # not a socket: never removed, cannot be bound
        moved = HttpConfig(listen="", socket="/run/blocked/agent.sock")
        with pytest.raises(AgentError, match="cannot serve HTTP on .*/run/blocked/agent.sock \\(http.socket\\)"):
            server.run(server.server.restart(moved))
        assert server.server.settings == taken and readyz_over_unix(first.socket) == b"HTTP/1.1 200 "
        server.run(server.server.restart(HttpConfig(listen="", socket="/run/other/agent.sock")))
        assert readyz_over_unix("/run/other/agent.sock") == b"HTTP/1.1 200 "
        assert not (root / "run/gpu-agent/agent.sock").exists() and server.server.tcp_error is None
    finally:
        squatter.close()
        server.close()
