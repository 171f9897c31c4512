"""HTTP/1.1 on one connection: h11 parses the requests, the endpoint's routes answer them.

A connection answers its requests in order, pipelined ones too, one at a time. Every answer is whole
at once (responses.py); what takes time is the client reading it. So the transport reports any byte
of an answer it still holds (a write buffer limit of zero), and until those are written the request
keeps its place in its endpoint's cap, the listener sees the connection busy, and nothing more is
read from it: a client that does not read costs one answer's bytes, for at most SEND_TIMEOUT_S.

What the endpoint does not serve is refused at once: an unknown path 404, another method than GET or
HEAD 405. A request the connection cannot go on after (malformed 400, or 501/505 for a transfer coding
or an HTTP version not served, a request line and headers over MAX_HEAD_BYTES 431, a body 413: none
is read) is answered and the connection closed; it reads
and drops what the client still sends until the client closes too, so the answer is not lost to a
reset (the listener's idle timeout bounds that wait, and such a connection is the first it closes for a
newcomer). The listener learns of each request from this parser (request_started, request_parsed), never
from the bytes.

No client can take the event loop or the log: a connection answers at most ANSWERS_PER_TURN requests
per turn of the loop and is not read while requests it sent wait (so what it has queued is one read at
most); a gone client's requests are not answered; an answer its client does not read is evicted when
its endpoint or its listener is full (listener.py, responses.py). What a connection's socket reports
(a reset, a broken pipe, a peer gone before an answer or its end) is counted by reason
(gpu_agent_http_connection_errors_total), never logged.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Callable, Optional
from urllib.parse import unquote

import h11

from gpu_agent.daemon.listener import OncePer, request_parsed, request_started
from gpu_agent.daemon.responses import MAX_HEAD_BYTES, Capped, Request, Response

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 10.0  # for a client to take an answer the kernel could not hold at once
ANSWERS_PER_TURN = 8  # requests of one connection answered before the loop serves the others
_METHODS = ("GET", "HEAD")
_ALLOW = ", ".join(_METHODS)
_SMALL_BODY = 64 * 1024  # written with its head in one send
_REASONS = {200: b"OK", 304: b"Not Modified", 400: b"Bad Request", 404: b"Not Found",
            405: b"Method Not Allowed", 413: b"Content Too Large", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error", 501: b"Not Implemented", 503: b"Service Unavailable",
            505: b"HTTP Version Not Supported"}


class HttpProtocol(asyncio.Protocol):
    """One connection of the endpoint; `routes` maps a path to its capped handler."""

    def __init__(self, routes: Mapping[str, Capped], errors: Optional[Counter[str]] = None) -> None:
        self._routes = routes
        self._errors: Counter[str] = Counter() if errors is None else errors
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._transport: Optional[asyncio.Transport] = None
        self._unwritten = False  # the transport holds bytes of an answer (pause_writing .. resume_writing)
        self._answering: Optional[_Answering] = None  # the answer being written, while _unwritten
        self._closing = False  # no more requests: the last answer is on its way, then the connection closes
        self._dropping = False  # refused: what the client sends is dropped until it closes
        self._next_turn: Optional[asyncio.Handle] = None  # more requests to answer at the loop's next turn
        self._held: Optional[h11.Request] = None  # parsed, to be answered at the next turn

    # --- asyncio's callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=0)  # told of any byte not yet in the kernel's hands

    def data_received(self, data: bytes) -> None:
        if self._dropping or self._closing:
            return
        self._h11.receive_data(data)
        self._serve()

    def eof_received(self) -> bool:
        if self._dropping:
            return False  # the client read its answer and closed: close
        self._h11.receive_data(b"")
        if self._next_turn is None:
            self._serve()
        return True  # keep the sending side open for answers to the requests that came before

    def pause_writing(self) -> None:
        self._unwritten = True

    def resume_writing(self) -> None:
        self._unwritten = False
        if self._answering is not None:
            self._written()
            if self._next_turn is None:
                # At the loop's next turn, not here: this runs inside the transport's own write handler,
                # and a write that fails from it (a reset) makes asyncio report the connection lost twice.
                self._next_turn = asyncio.get_running_loop().call_soon(self._turn)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._transport = None
        if exc is not None:
            self._errors[_reason(exc)] += 1
        if self._next_turn is not None:
            self._next_turn.cancel()
            self._next_turn = None
        if self._answering is not None:
            self._written()  # the client left mid-answer: its place is free

    # --- requests --------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Answer the requests received so far, in order, until an answer waits for its client to read,
        or ANSWERS_PER_TURN of them were answered (the rest at the loop's next turn)."""
        try:
            self._answer_some()
        except OSError as exc:  # the socket's trouble, not ours
            self._connection_error(exc)
        except Exception:  # a bug here must not take the event loop's callback with it
            _bug_log(logging.ERROR, "answering an HTTP request failed; this is a gpu-agent bug", exc_info=True)
            if self._transport is not None:
                self._transport.abort()
        self._update_reading()

    def _answer_some(self) -> None:
        answered = 0
        while self._answering is None and not self._closing and self._open:
            event, self._held = self._held or self._next_event(), None
            if event is None or event is h11.NEED_DATA:
                return
            if type(event) is h11.Request:
                if answered >= ANSWERS_PER_TURN:  # parsed: the listener keeps the connection for its turn
                    self._held = event
                    request_parsed(self._transport)
                    self._next_turn = asyncio.get_running_loop().call_soon(self._turn)
                    return
                self._answer(event)
                answered += 1
            elif type(event) is h11.EndOfMessage or event is h11.PAUSED:
                if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
                    self._h11.start_next_cycle()
            elif type(event) is h11.ConnectionClosed:
                self._close()

    def _next_event(self) -> Optional[object]:
        """h11's next event; None when the input is not HTTP/1.x h11 accepts (refused here)."""
        try:
            return self._h11.next_event()
        except h11.RemoteProtocolError as exc:
            self._refuse(exc.error_status_hint, f"bad request: {exc}\n")
            return None

    def _turn(self) -> None:
        self._next_turn = None
        self._serve()

    @property
    def _open(self) -> bool:
        """Whether the client can still be answered (not gone, not being closed for an error)."""
        return self._transport is not None and not self._transport.is_closing()

    def _update_reading(self) -> None:
        """Read the connection only while no request of it waits: its answer unwritten, or its turn."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        wanted = self._answering is None and self._next_turn is None
        if wanted and not transport.is_reading():
            transport.resume_reading()
        elif not wanted and transport.is_reading():
            transport.pause_reading()

    def _connection_error(self, exc: OSError) -> None:
        self._errors[_reason(exc)] += 1
        if self._transport is not None:
            self._transport.abort()

    def _answer(self, event: h11.Request) -> None:
        if _head_size(event) > MAX_HEAD_BYTES:  # h11 stops only a head that arrives in pieces
            self._refuse(431, f"bad request: request line and headers over {MAX_HEAD_BYTES} bytes\n")
            return
        if event.http_version not in (b"1.0", b"1.1"):
            self._refuse(505, f"bad request: HTTP/{event.http_version.decode()} is not served; use HTTP/1.1\n")
            return
        has_body = _has_body(event.headers)
        finished = request_started(self._transport, refused=has_body)
        target = event.target.decode("ascii")  # h11 admits only visible ASCII in a target
        if "://" in target.partition("?")[0]:  # the absolute form, as to a proxy
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        path, _, query = target.partition("?")
        if "%" in path:
            path = unquote(path)
        method = event.method.decode("ascii")
        route = self._routes.get(path)
        held: Optional[Capped] = None
        if route is None:
            response = Response.text(f"not found: {path}; this endpoint serves {', '.join(self._routes)}\n", 404)
        elif method not in _METHODS:
            response = Response.text(f"method {method} not allowed on {path}; use {_ALLOW}\n", 405,
                                     [("Allow", _ALLOW)])
        elif has_body:
            response = Response.text("request bodies are not accepted here\n", 413)
        else:
            response, holds = self._call(route, Request(method, path, query, _headers(event.headers)))
            held = route if holds else None
        self._write(response, head_only=method == "HEAD", close=has_body)
        self._written_when_drained(_Answering(finished, held))
        if has_body:
            self._drop_the_rest()
        elif self._h11.our_state is h11.MUST_CLOSE:  # HTTP/1.0, or Connection: close
            self._close()

    @staticmethod
    def _call(route: Capped, request: Request) -> tuple[Response, bool]:
        try:
            return route.answer(request)
        except Exception:
            _bug_log(logging.ERROR, "answering %s failed; this is a gpu-agent bug", request.path, exc_info=True)
            return Response.text("internal error; the agent's log has the details\n", 500), False

    def _refuse(self, status: int, text: str) -> None:
        """Answer a request the connection cannot go on after, then close."""
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            finished = request_started(self._transport, refused=True)
            self._write(Response.text(text, status), head_only=False, close=True)
            self._written_when_drained(_Answering(finished, None))
            self._drop_the_rest()
        elif self._transport is not None:
            self._transport.abort()

    # --- answers ---------------------------------------------------------------------------------

    def _write(self, response: Response, head_only: bool, close: bool) -> None:
        """Hand the answer to the transport (not to a client gone or being dropped: h11 still records it)."""
        headers = list(response.headers)
        if response.status != 304:
            headers.append(("Content-Length", str(len(response.body))))
        if close:
            headers.append(("Connection", "close"))
        head = self._h11.send(h11.Response(status_code=response.status, headers=headers,
                                           reason=_REASONS.get(response.status, b"")))
        body = b"" if head_only or response.status == 304 else response.body
        if body:
            self._h11.send_with_data_passthrough(h11.Data(data=body))
        self._h11.send(h11.EndOfMessage())
        if self._transport is None or not self._open:
            return
        if len(body) < _SMALL_BODY:
            self._transport.write(head + body)
        else:
            self._transport.write(head)
            self._transport.write(body)

    def _written_when_drained(self, answering: _Answering) -> None:
        """The answer is written now, or once the client has read what the kernel could not hold."""
        if not self._unwritten or self._transport is None:
            answering.done()
            return
        self._answering = answering
        answering.timer = asyncio.get_running_loop().call_later(SEND_TIMEOUT_S, self._too_slow)
        if answering.held is not None:
            answering.held.unread(answering, self._evict)

    def _written(self) -> None:
        answering, self._answering = self._answering, None
        if answering is not None:
            answering.done()

    def _too_slow(self) -> None:
        if self._answering is not None:
            self._answering.timer = None
            if self._transport is not None:
                self._errors["send_timeout"] += 1
                self._transport.abort()

    def _evict(self) -> None:
        """Its endpoint is full and this answer has waited longest for its client to read: close."""
        self._errors["unread_evicted"] += 1
        self._written()
        if self._transport is not None:
            self._transport.abort()

    def _close(self) -> None:
        """No more requests: close once the answers are written (the transport flushes first)."""
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def _drop_the_rest(self) -> None:
        self._closing = self._dropping = True
        if self._transport is None:
            return
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        try:
            self._transport.write_eof()  # after the answer: the client sees it end
        except OSError as exc:  # the client is gone already (ENOTCONN)
            self._connection_error(exc)


class _Answering:
    """An answer not yet written: the listener's busy mark and the endpoint's place it holds."""

    __slots__ = ("finished", "held", "timer")

    def __init__(self, finished: Callable[[], None], held: Optional[Capped]) -> None:
        self.finished = finished
        self.held = held
        self.timer: Optional[asyncio.TimerHandle] = None

    def done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.held is not None:
            self.held.release(self)
        self.finished()


_bug_log = OncePer(logger=log)  # a bug repeats with every request that meets it


def _reason(exc: BaseException) -> str:
    """What a connection's error is counted as: the errno's name (ECONNRESET, EPIPE, ENOTCONN), or the type."""
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, type(exc).__name__) if isinstance(code, int) else type(exc).__name__


def _head_size(event: h11.Request) -> int:
    """The size of a request line and headers as sent (but for optional spaces)."""
    return (len(event.method) + len(event.target) + 12
            + sum(len(name) + len(value) + 4 for name, value in event.headers) + 2)


def _has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        key, text = name.decode("ascii"), value.decode("latin-1")
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out
