"""The kube client's HTTP exchange (gpu_agent/kube/exchange.py) against scripted raw servers: how answers are
framed, what is refused, and that the whole exchange, not each read, is bounded by its timeout."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Callable
from urllib.parse import urlsplit

import h11
import pytest

from gpu_agent.kube.exchange import CannotForm, exchange

Script = Callable[[socket.socket, bytes], None]  # the accepted connection and the request it read


class RawServer:
    """Accepts connections on 127.0.0.1 (or on `sock`, bound: a unix socket, a given port) and runs `script`
    on each, after reading the request's head."""

    def __init__(self, script: Script, sock: socket.socket | None = None) -> None:
        self.script = script
        self.requests: list[bytes] = []
        if sock is not None:
            sock.listen(16)
        self.sock = sock or socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1] if self.sock.family != socket.AF_UNIX else 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                self.requests.append(request)
                try:
                    self.script(conn, request)
                except OSError:
                    pass


@pytest.fixture
def serve() -> Iterator[Callable[[Script], RawServer]]:
    servers: list[RawServer] = []

    def start(script: Script) -> RawServer:
        servers.append(RawServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.sock.close()


def answering(raw: bytes) -> Script:
    return lambda conn, request: conn.sendall(raw)


def get(server: RawServer, timeout: float = 5, limit: int = 1 << 20, body: bytes | None = None,
        headers: list[tuple[str, str]] | None = None) -> tuple[int, bytes]:
    answer = exchange(urlsplit(f"http://127.0.0.1:{server.port}"), None, "PATCH" if body else "GET",
                      "/api/v1/nodes/n", headers or [], body, timeout, limit)
    return answer.status, answer.body


def test_a_content_length_answer(serve: Callable[[Script], RawServer]) -> None:
    server = serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"a\": 1}"))
    assert get(server) == (200, b'{"a": 1}')
    head = server.requests[0]
    assert head.startswith(b"GET /api/v1/nodes/n HTTP/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:%d\r\n" % server.port in head.lower() and b"connection: close" in head.lower()


def test_retry_after_is_reported_as_sent(serve: Callable[[Script], RawServer]) -> None:
    """kube-apiserver's max-in-flight and priority-and-fairness filters answer 429 with `Retry-After: 1`
    and a plain-text body (staging/src/k8s.io/apiserver/pkg/server/filters/maxinflight.go, tooManyRequests)."""
    raw = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
           b"Content-Length: 43\r\n\r\nToo many requests, please try again later.\n")
    answer = exchange(urlsplit(f"http://127.0.0.1:{serve(answering(raw)).port}"), None, "GET", "/x", [], None, 5, 100)
    assert (answer.status, answer.retry_after) == (429, "1")
    long = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: " + b"9" * 500 + b"\r\nContent-Length: 0\r\n\r\n"
    answer = exchange(urlsplit(f"http://127.0.0.1:{serve(answering(long)).port}"), None, "GET", "/x", [], None, 5, 100)
    assert answer.retry_after == "9" * 64  # cut: no Retry-After is that long


def test_a_chunked_answer_in_pieces(serve: Callable[[Script], RawServer]) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        for piece in (b"HTTP/1.1 404 Not Found\r\nTransfer-", b"Encoding: chunked\r\n\r\n4\r\n{\"a\"", b"\r\n",
                      b"4\r\n: 1}\r\n0\r\n\r\n"):
            conn.sendall(piece)
            time.sleep(0.01)
    assert get(serve(script)) == (404, b'{"a": 1}')


def test_an_answer_ended_by_the_close(serve: Callable[[Script], RawServer]) -> None:
    assert get(serve(answering(b"HTTP/1.1 200 OK\r\n\r\n{}"))) == (200, b"{}")


def test_a_body_is_sent_with_its_length(serve: Callable[[Script], RawServer]) -> None:
    received: list[bytes] = []

    def script(conn: socket.socket, request: bytes) -> None:
        head, _, body = request.partition(b"\r\n\r\n")
        while len(body) < 11:
            body += conn.recv(100)
        received.append(body)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    server = serve(script)
    assert get(server, body=b'{"patch":1}', headers=[("Content-Type", "application/merge-patch+json")]) == (200, b"{}")
    assert received == [b'{"patch":1}']
    assert b"content-length: 11\r\n" in server.requests[0].lower()


def test_reading_stops_past_the_limit(serve: Callable[[Script], RawServer]) -> None:
    status, body = get(serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000)),
                       limit=1000)
    assert status == 200 and 1000 < len(body) < 100000


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",  # closed before the whole body
    b"",  # closed before any answer
    b"SSH-2.0-OpenSSH_9.2\r\n\r\n",  # not HTTP
    b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * 200000 + b"\r\n\r\n",  # a head over 64 KiB
])
def test_a_broken_answer_is_a_protocol_error(serve: Callable[[Script], RawServer], raw: bytes) -> None:
    with pytest.raises(h11.RemoteProtocolError):
        get(serve(answering(raw)))


def test_a_server_that_trickles_is_cut_off_at_the_timeout(serve: Callable[[Script], RawServer]) -> None:
    """Each byte comes within a per-read timeout; the exchange as a whole still ends at its deadline."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000
    sent: list[int] = []

    def script(conn: socket.socket, request: bytes) -> None:
        for byte in answer:
            conn.sendall(bytes([byte]))
            sent.append(byte)
            time.sleep(0.05)

    with pytest.raises(TimeoutError):
        get(serve(script), timeout=0.5)
    assert len(sent) < len(answer)  # cut off while the server was still trickling (the whole would take 52 s)


@pytest.mark.parametrize("value", ["Bearer abc\r\nX-Injected: 1", "Bearer caf\u00e9", "Bearer a\0b"])
def test_a_header_http_cannot_carry_is_refused_before_connecting(serve: Callable[[Script], RawServer],
                                                                  value: str) -> None:
    server = serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    with pytest.raises(CannotForm) as caught:
        get(server, headers=[("Authorization", value)])
    assert "abc" not in str(caught.value) and "caf" not in str(caught.value)
    assert server.requests == []


def test_an_ipv6_server_keeps_its_brackets_in_host() -> None:
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = listener.getsockname()[1]
    heads: list[bytes] = []

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            heads.append(conn.recv(65536))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    threading.Thread(target=serve_one, daemon=True).start()
    try:
        answer = exchange(urlsplit(f"http://[::1]:{port}"), None, "GET", "/x", [], None, 5, 100)
        assert (answer.status, answer.body, answer.retry_after) == (200, b"{}", None)
    finally:
        listener.close()
    assert b"\r\nhost: [::1]:%d\r\n" % port in heads[0].lower()
