"""The endpoint's HTTP/1.1 (daemon/protocol.py) on a real socket: keep-alive, HTTP/1.0, pipelining, HEAD,
what it refuses (bodies, oversize heads, malformed requests, other methods, unknown paths), flow control
for clients that do not read, and the bounded stop."""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from served import Served, read_responses, read_until_closed, responses_in

from gpu_agent.daemon import http as http_module
from gpu_agent.daemon import protocol as protocol_module
from gpu_agent.daemon.http import Endpoints
from gpu_agent.daemon.responses import Capped, Request, Response

BIG = b"x" * (1 << 20)  # far more than the few KiB of send buffer small_send_buffers() leaves
MID = b"m" * (256 << 10)


def _echo(request: Request) -> Response:
    query = ",".join(f"{k}={v}" for k, v in sorted(request.query.items()))
    return Response.text(f"{request.method} {request.path} {query} {request.headers.get('x-echo', '')}\n")


@pytest.fixture
def routes() -> dict[str, Capped]:
    return {"/echo": Capped(_echo, 4), "/big": Capped(lambda request: Response(body=BIG), 4),
            "/mid": Capped(lambda request: Response(body=MID), 4),
            "/small": Capped(lambda request: Response.text("small\n"), 4)}


@pytest.fixture
def served(routes: dict[str, Capped], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Served]:
    server = Served(Endpoints(routes, {}), tmp_path)
    with caplog.at_level(logging.WARNING):
        yield server
        server.close()
    # No input, however bad, reaches the log (asyncio's own complaints included).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _exchange(served: Served, data: bytes, bodiless: tuple[int, ...] = ()) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data`, close the sending side, and parse everything the server sends until it closes."""
    with served.raw() as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return responses_in(read_until_closed(sock), bodiless)


def test_keep_alive_answers_many_requests_on_one_connection(served: Served) -> None:
    connection = served.client()
    for n in range(3):
        connection.request("GET", f"/echo?n={n}", headers={"X-Echo": "a"})
        response = connection.getresponse()
        assert response.status == 200 and response.read() == f"GET /echo n={n} a\n".encode()
        assert response.getheader("Connection") is None
        if n == 0:
            first = connection.sock
        assert connection.sock is first  # the same connection: never closed in between
    connection.close()


def test_pipelined_requests_are_answered_in_order_and_the_connection_stays(served: Served) -> None:
    requests = (b"GET /echo?n=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                b"HEAD /small HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /echo?n=2 HTTP/1.1\r\nHost: x\r\n\r\n")
    answers = _exchange(served, requests, bodiless=(1,))
    assert [status for status, _, _ in answers] == [200, 200, 404, 200]
    assert answers[0][2] == b"GET /echo n=1 \n" and answers[3][2] == b"GET /echo n=2 \n"
    assert b"/echo" in answers[2][2]  # the 404 names what is served


def test_head_has_the_headers_of_get_and_no_body(served: Served) -> None:
    get, body = served.get("/small")
    head, nothing = served.get("/small", method="HEAD")
    assert head.status == 200 and nothing == b""
    assert head.getheader("Content-Length") == get.getheader("Content-Length") == str(len(body))
    assert head.getheader("Content-Type") == get.getheader("Content-Type")
    [(status, headers, _)] = _exchange(served, b"HEAD /big HTTP/1.1\r\nHost: x\r\n\r\n", bodiless=(0,))
    assert status == 200 and headers["content-length"] == str(len(BIG))


def test_http_1_0_and_connection_close_are_answered_then_closed(served: Served) -> None:
    for request in (b"GET /small HTTP/1.0\r\n\r\n", b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
        with served.raw() as sock:
            sock.sendall(request + b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")  # never answered: closed before
            [(status, headers, body)] = responses_in(read_until_closed(sock))  # read_until_closed: it closed
            assert (status, body, headers["connection"]) == (200, b"small\n", "close")


def test_a_client_that_stops_sending_still_gets_its_answers(served: Served) -> None:
    answers = _exchange(served, b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    assert [(status, body) for status, _, body in answers] == [(200, b"small\n")] * 2


def test_other_methods_get_405_with_allow_and_the_connection_goes_on(served: Served) -> None:
    connection = served.client()
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW"):
        connection.request(method, "/small")
        response = connection.getresponse()
        assert response.status == 405 and response.getheader("Allow") == "GET, HEAD", method
        assert method.encode() in response.read()
    connection.request("GET", "/small")
    assert connection.getresponse().read() == b"small\n"
    connection.close()


def test_unknown_paths_are_404_and_paths_are_percent_decoded(served: Served) -> None:
    for path in ("/nowhere", "/small/", "/SMALL", "//small", "/small%2f", "*"):
        assert served.get(path)[0].status == 404, path
    assert served.get("/sm%61ll")[1] == b"small\n"
    assert served.get("http://localhost/small?x=1")[1] == b"small\n"  # the absolute form


@pytest.mark.parametrize("head", [
    b"GET /small HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"POST /small HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET /small HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n" + b"y" * (1 << 20),
])
def test_a_request_body_is_refused_with_413_and_the_connection_closed(served: Served, head: bytes) -> None:
    answers = _exchange(served, head + b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(answers) == 1, answers  # nothing after the body is answered
    status, headers, body = answers[0]
    assert status in (405, 413) and headers["connection"] == "close", answers
    assert status == (405 if head.startswith(b"POST") else 413)


def test_oversize_request_heads_are_refused_with_431(served: Served) -> None:
    long_header = b"GET /small HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (64 << 10) + b"\r\n\r\n"
    long_line = b"GET /small?" + b"q" * (64 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    many = b"GET /small HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(5000)) + b"\r\n"
    for request in (long_header, long_line, many):
        [(status, headers, body)] = _exchange(served, request)
        assert status == 431 and headers["connection"] == "close" and body.startswith(b"bad request")
    # Just under the limit is served.
    fits = b"GET /small HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (protocol_module.MAX_HEAD_BYTES - 200) + b"\r\n\r\n"
    assert [status for status, _, _ in _exchange(served, fits)] == [200]


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /small HTTP/1.1\r\nno colon here\r\n\r\n",
    b"GET /small HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET /sm\xffall HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /small HTTP/2.0\r\nHost: x\r\n\r\n",
    b"GET /small HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"GET /small HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET /small HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",  # a TLS hello
])
def test_a_malformed_request_gets_400_and_the_connection_closed(served: Served, request_bytes: bytes) -> None:
    answers = _exchange(served, request_bytes + b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(answers) == 1, answers
    [(status, headers, body)] = answers
    assert status in (400, 501, 505) and headers["connection"] == "close" and body.startswith(b"bad request"), answers
    assert served.get("/small")[1] == b"small\n"


def test_random_input_never_reaches_the_log_and_the_server_goes_on(served: Served) -> None:
    rng = random.Random(15)
    pieces = [b"GET ", b"HEAD ", b"/small", b"/echo?", b"%", b"%zz", b" HTTP/1.1", b" HTTP/1.0", b"\r\n",
              b"\n", b"Host: x", b"Content-Length: 3", b"Transfer-Encoding: chunked", b"Connection: close",
              b": ", b"\x00", b"\xff", b"\t", b" ", b"abc", b"0\r\n\r\n"]
    for _ in range(150):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        with served.raw() as sock:
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                read_until_closed(sock)
            except OSError:  # the server may close while this still sends
                pass
    assert served.get("/small")[1] == b"small\n"


def test_a_client_that_does_not_read_holds_one_answer_and_nothing_more(served: Served, routes) -> None:
    """Four pipelined requests for 256 KiB each, not read: one answer at a time waits in the server, and
    the connection is not read meanwhile; read at last, every answer arrives whole and in order."""
    served.small_send_buffers()
    with served.raw() as sock:
        sock.sendall(b"GET /mid HTTP/1.1\r\nHost: x\r\n\r\n" * 4)

        def waiting() -> tuple[int, bool, int]:
            [connection] = served.server.listeners[0]._open
            transport = connection.transport
            assert transport is not None
            return transport.get_write_buffer_size(), transport.is_reading(), served.server.listeners[0].answering

        _until(served, lambda: served.server.listeners[0].answering == 1)
        for _ in range(20):  # however long it waits
            buffered, reading, answering = served.on_loop(waiting)
            assert buffered <= len(MID) and not reading and answering == 1
            assert routes["/mid"].busy == 1
        answers = read_responses(sock, 4)
    assert [(status, body) for status, _, body in answers] == [(200, MID)] * 4


def test_a_client_gone_mid_answer_frees_its_place_quietly(served: Served, routes) -> None:
    served.small_send_buffers()
    for _ in range(10):
        sock = served.raw()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(served, lambda: routes["/big"].busy == 1)
        sock.close()
        _until(served, lambda: routes["/big"].busy == 0 and served.server.listeners[0].connections == 0)
    assert served.get("/small")[1] == b"small\n"


def test_a_client_that_never_reads_is_closed_after_the_send_timeout(served: Served, routes,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol_module, "SEND_TIMEOUT_S", 0.2)
    served.small_send_buffers()
    with served.raw() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(served, lambda: routes["/big"].busy == 0 and served.server.listeners[0].connections == 0)
        assert len(read_until_closed(sock)) < len(BIG)


def test_stop_gives_answers_being_written_their_time_then_closes_all(served: Served, routes,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    served.small_send_buffers()
    monkeypatch.setattr(http_module, "_SHUTDOWN_TIMEOUT_S", 60.0)
    reader, stuck, idle = served.raw(), served.raw(), served.raw()
    for sock in (reader, stuck):
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    idle.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
    assert responses_in(idle.recv(4096))[0][2] == b"small\n"
    _until(served, lambda: routes["/big"].busy == 2)
    stopped = asyncio.run_coroutine_threadsafe(served.server.stop(), served.loop)
    [(status, _, body)] = read_responses(reader, 1)  # written whole meanwhile
    assert status == 200 and body == BIG
    _until(served, lambda: routes["/big"].busy == 1)
    assert not stopped.done()  # `stuck` has not read its answer: stop waits, up to _SHUTDOWN_TIMEOUT_S
    with pytest.raises(OSError):
        served.raw(timeout=2)  # but accepts nothing new
    stuck.close()  # gone: nothing is left to wait for
    stopped.result(10)
    assert read_until_closed(reader) == b"" and read_until_closed(idle) == b""  # all closed at the end
    reader.close()
    idle.close()


def test_stop_is_bounded_for_a_client_that_never_reads(served: Served, routes,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    served.small_send_buffers()
    monkeypatch.setattr(http_module, "_SHUTDOWN_TIMEOUT_S", 0.1)
    with served.raw() as stuck:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(served, lambda: routes["/big"].busy == 1)
        served.run(served.server.stop())
        assert len(read_until_closed(stuck)) < len(BIG)  # cut off
    assert routes["/big"].busy == 0


def _until(served: Served, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `condition()`, evaluated on the server's loop, holds."""
    deadline = time.monotonic() + timeout
    while not served.on_loop(condition):
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)
