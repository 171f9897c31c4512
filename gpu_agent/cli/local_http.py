"""One GET to the agent's own endpoint, for `gpu-agent status` and `labels`: HTTP/1.1 over a socket the
caller connected, without http.client (which imports email and ssl: a fifth of the command's start).
It reads what the agent's server (daemon/protocol.py) sends: a status line, headers, and a body sized
by Content-Length, or chunked, or ended by the close that `Connection: close` asks for."""
from __future__ import annotations

import socket
import time
from typing import NamedTuple, Optional

from gpu_agent.numbers import decimal

MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # /status of 64 GPUs with MIG is a few MiB


class BadResponse(ValueError):
    """The answer is not an HTTP/1.x response this client can read."""


class Answer(NamedTuple):
    code: int
    headers: dict[str, str]  # names in lower case; a repeated one's last value
    body: bytes


def get(sock: socket.socket, path: str, host: str, timeout: float) -> tuple[int, bytes]:
    """(status code, body) of `GET path` on the connected `sock`, within `timeout` seconds in all.
    Raises OSError (socket.timeout included) or BadResponse."""
    answer = request(sock, path, host, timeout)
    return answer.code, answer.body


def request(sock: socket.socket, path: str, host: str, timeout: float,
            headers: Optional[dict[str, str]] = None) -> Answer:
    """`GET path` with `headers` (ASCII) on the connected `sock`: the whole answer within `timeout` seconds
    in all. Raises OSError (socket.timeout included) or BadResponse."""
    deadline = time.monotonic() + timeout
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode("ascii"))
    data = b""
    while True:
        head, separator, body = data.partition(b"\r\n\r\n")
        if separator:
            code, fields, length, chunked = _head(head)
            if length is not None and len(body) >= length:
                return Answer(code, fields, body[:length])
            if chunked:
                decoded = _dechunked(body)
                if decoded is not None:
                    return Answer(code, fields, decoded)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout(f"no whole answer within {timeout:g} s")
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_RESPONSE_BYTES:
            raise BadResponse(f"the answer is larger than {MAX_RESPONSE_BYTES} bytes")
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        raise BadResponse("the connection closed before the answer's headers ended")
    code, fields, length, chunked = _head(head)
    if length is not None:
        raise BadResponse(f"the connection closed after {len(body)} of {length} bytes")
    if chunked:
        raise BadResponse("the connection closed inside a chunked answer")  # a whole one returned above
    return Answer(code, fields, body)


def _head(head: bytes) -> tuple[int, dict[str, str], int | None, bool]:
    """Status code, the headers, Content-Length (None when absent) and whether the body is chunked."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:60]!r}")
    length: int | None = None
    chunked = False
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadResponse(f"not a header line: {line[:60]!r}")
        name, value = name.strip().lower(), value.strip()
        fields[name.decode("latin-1")] = value.decode("latin-1")
        if name == b"content-length":
            length = decimal(value.decode("ascii", errors="replace"))
            if length is None:
                raise BadResponse(f"Content-Length is not a number: {value[:20]!r}")
        elif name == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
    return int(parts[1]), fields, (None if chunked else length), chunked


def _dechunked(body: bytes) -> bytes | None:
    """A whole chunked body's data; None when `body` does not hold all of it yet (or is not chunked)."""
    out: list[bytes] = []
    at = 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            return None
        size_text = body[at:end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadResponse(f"not a chunk size: {size_text[:20]!r}") from None
        if size == 0:
            return b"".join(out)
        start = end + 2
        if len(body) < start + size + 2:
            return None
        out.append(body[start:start + size])
        at = start + size + 2
