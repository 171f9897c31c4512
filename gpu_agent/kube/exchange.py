"""One HTTP/1.1 request and its answer, on a connection of its own, all within one deadline.

The agent sends a few requests an hour, so nothing is kept open between them. h11, the daemon's own
HTTP parser, frames the exchange: http.client would cost the daemon 1.3 MiB for the email and datetime
packages it imports, for no request that needs them.
"""
from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import SplitResult

import h11

_READ_BYTES = 64 * 1024
_MAX_HEAD_BYTES = 64 * 1024
_MAX_LOCATION_BYTES = 1024
_MAX_RETRY_AFTER_BYTES = 64  # delta-seconds or an HTTP date; anything longer is not one


@dataclass(frozen=True)
class Answer:
    """What the server answered: the status, at most `limit` + 1 bytes of body, and its Retry-After
    header as sent (untrusted text, None without one)."""

    status: int
    body: bytes
    retry_after: Optional[str] = None


class CannotForm(ValueError):
    """The request cannot be written as HTTP (a header value with a line break, a non-ASCII token)."""


class Redirected(Exception):
    """The server answered with a redirect (3xx): never followed (the credentials would go along),
    never read as an answer. `location` is the Location header as sent, if any (untrusted text)."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.location = location


def exchange(server: SplitResult, context: Optional[ssl.SSLContext], method: str, target: str,
             headers: list[tuple[str, str]], body: Optional[bytes], timeout: float, limit: int) -> Answer:
    """The answer to `method target` sent to `server`, over TLS when `context` is given. Reads at most
    `limit` + 1 bytes of body (so a caller sees that an answer went over `limit`).

    Raises CannotForm before connecting, OSError (TLS and timeouts included), h11.RemoteProtocolError,
    or Redirected for a 3xx answer.
    """
    client = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
    request = _request(client, server, method, target, headers, body)
    deadline = time.monotonic() + timeout
    host = server.hostname or ""
    sock = socket.create_connection((host, server.port or (443 if context else 80)), timeout=timeout)
    try:
        if context is not None:
            _until(sock, deadline)
            sock = context.wrap_socket(sock, server_hostname=host)
        _until(sock, deadline)
        sock.sendall(request)
        return _answer(client, sock, deadline, limit)
    finally:
        sock.close()


def _request(client: h11.Connection, server: SplitResult, method: str, target: str, headers: list[tuple[str, str]],
             body: Optional[bytes]) -> bytes:
    framing = [("Host", server.netloc.rpartition("@")[2]), ("Connection", "close")]
    if body is not None:
        framing.append(("Content-Length", str(len(body))))
    try:
        parts = [client.send(h11.Request(method=method, target=target, headers=framing + headers))]
    except (h11.LocalProtocolError, UnicodeError):
        raise CannotForm("the request cannot be formed") from None  # h11's message would quote the value
    if body:
        parts.append(client.send(h11.Data(data=body)))
    parts.append(client.send(h11.EndOfMessage()))
    return b"".join(part for part in parts if part)


def _answer(client: h11.Connection, sock: socket.socket, deadline: float, limit: int) -> Answer:
    status = 0
    retry_after: Optional[str] = None
    chunks: list[bytes] = []
    size = 0
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            _until(sock, deadline)
            client.receive_data(sock.recv(_READ_BYTES))
        elif type(event) is h11.Response:
            status = event.status_code
            if 300 <= status < 400:
                location = next((value for name, value in event.headers if name == b"location"), b"")
                raise Redirected(status, location[:_MAX_LOCATION_BYTES].decode("latin-1"))
            value = next((value for name, value in event.headers if name == b"retry-after"), None)
            if value is not None:
                retry_after = value[:_MAX_RETRY_AFTER_BYTES].decode("latin-1")
        elif type(event) is h11.Data:
            chunks.append(bytes(event.data))
            size += len(event.data)
            if size > limit:
                break
        elif type(event) is h11.EndOfMessage:
            break
    return Answer(status, b"".join(chunks), retry_after)


def _until(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out")
    sock.settimeout(remaining)
