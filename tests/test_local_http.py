"""gpu-agent status's GET (cli/local_http.py): what the agent's server sends, and every way an answer
can be short, slow or not HTTP at all, each an OSError or BadResponse, never a hang."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpu_agent.cli import local_http
from gpu_agent.cli.local_http import BadResponse, get
from test_http_serving import agent_state, served  # noqa: F401  (fixtures)
from served import Served


@pytest.fixture
def peer() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    yield client, server
    client.close()
    server.close()


requests: list[bytes] = []


def answer_with(server: socket.socket, pieces: list[bytes], close: bool = True, pause: float = 0.0) -> threading.Thread:
    """Read the request, then send `pieces` one by one (a pause between), then close or not."""
    def run() -> None:
        request = b""
        try:
            while b"\r\n\r\n" not in request:
                request += server.recv(4096)
            for piece in pieces:
                server.sendall(piece)
                time.sleep(pause)
            if close:
                server.shutdown(socket.SHUT_WR)
        except OSError:  # the client gave up and the test closed the pair: the answer has no reader
            pass
        requests.append(request)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_agents_own_server_is_read_with_no_wait_for_its_close(served: Served) -> None:  # noqa: F811
    with served.raw() as sock:
        code, body = get(sock, "/status", "localhost", 5.0)
    assert code == 200 and json.loads(body)["gpus"][0]["product"] == "NVIDIA H100 80GB HBM3"
    with served.raw() as sock:
        assert get(sock, "/readyz", "localhost", 5.0)[0] in (200, 503)


@pytest.mark.parametrize("pieces, body", [
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"], b"hello"),
    ([b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}"], b"{}"),
    ([b"HTTP/1.1 200", b" OK\r\nContent-Le", b"ngth: 3\r\n", b"\r\nab", b"c"], b"abc"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"], b"abcde"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab", b"c\r\n0\r\n", b"\r\n"], b"abc"),
    ([b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nuntil the close"], b"until the close"),
])
def test_an_answer_in_any_framing_and_any_pieces(peer: tuple[socket.socket, socket.socket], pieces: list[bytes],
                                                 body: bytes) -> None:
    client, server = peer
    answering = answer_with(server, pieces, pause=0.01)
    assert get(client, "/status", "localhost", 5.0)[1] == body
    answering.join(5)
    assert requests[-1] == b"GET /status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def test_a_whole_answer_is_returned_while_the_peer_keeps_the_connection_open(
        peer: tuple[socket.socket, socket.socket]) -> None:
    client, server = peer
    answer_with(server, [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"], close=False)
    assert get(client, "/status", "localhost", 5.0) == (200, b"hello")  # no wait for a close that never comes


@pytest.mark.parametrize("pieces, message", [
    ([b""], "closed before the answer's headers ended"),
    ([b"SSH-2.0-OpenSSH_9.2\r\n\r\n"], "not an HTTP/1.x status line"),
    ([b"HTTP/1.1 2000 OK\r\n\r\n"], "not an HTTP/1.x status line"),
    ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "not a header line"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"], "Content-Length is not a number"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"], "closed after 3 of 10 bytes"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"], "not a chunk size"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc"], "closed inside a chunked answer"),
])
def test_a_short_or_foreign_answer_is_a_bad_response(peer: tuple[socket.socket, socket.socket], pieces: list[bytes],
                                                      message: str) -> None:
    client, server = peer
    answer_with(server, pieces)
    with pytest.raises(BadResponse, match=message):
        get(client, "/status", "localhost", 5.0)


def test_a_peer_that_trickles_is_bounded_by_the_whole_timeout(peer: tuple[socket.socket, socket.socket]) -> None:
    client, server = peer
    # A header every 0.05 s for 10 s: no single read waits long, so only the 0.5 s for the whole answer ends it.
    trickling = answer_with(server, [b"HTTP/1.1 200 OK\r\n"] + [b"X-Slow: 1\r\n"] * 200, close=False, pause=0.05)
    with pytest.raises(socket.timeout):
        get(client, "/status", "localhost", 0.5)
    assert trickling.is_alive()  # given up while the peer was still sending


def test_an_endless_answer_stops_at_the_size_bound(peer: tuple[socket.socket, socket.socket],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_http, "MAX_RESPONSE_BYTES", 100_000)
    client, server = peer
    answer_with(server, [b"HTTP/1.1 200 OK\r\n\r\n"] + [b"x" * 10_000] * 20, close=False)
    with pytest.raises(BadResponse, match="larger than 100000 bytes"):
        get(client, "/status", "localhost", 5.0)


def test_a_request_sends_its_headers_and_returns_the_answers(peer: tuple[socket.socket, socket.socket]) -> None:
    client, server = peer
    answering = answer_with(server, [b"HTTP/1.1 200 OK\r\nX-Gpu-Agent-Proof: ab12\r\nContent-Length: 2\r\n\r\nok"])
    answer = local_http.request(client, "/status", "localhost", 5.0, {"x-gpu-agent-challenge": "00ff"})
    answering.join(5)
    assert answer == (200, {"x-gpu-agent-proof": "ab12", "content-length": "2"}, b"ok")
    assert requests[-1] == (b"GET /status HTTP/1.1\r\nHost: localhost\r\nx-gpu-agent-challenge: 00ff\r\n"
                            b"Connection: close\r\n\r\n")
