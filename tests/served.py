"""The HTTP endpoint served for a test: HttpServer on an event loop in a thread, on a real TCP socket of
127.0.0.1, so that the test talks to it as any client does (http.client, or a raw socket)."""
from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from gpu_agent.config.schema import HttpConfig
from gpu_agent.daemon.http import Endpoints, HttpServer
from gpu_agent.host.paths import Root

T = TypeVar("T")


class Served:
    def __init__(self, endpoints: Endpoints, root: Path, settings: Optional[HttpConfig] = None,
                 on_tcp_error: Callable[[Optional[str]], None] = lambda error: None) -> None:
        """Served on 127.0.0.1 at a free port, unless `settings` say where."""
        self.endpoints = endpoints
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="served", daemon=True)
        self._thread.start()
        self.server = HttpServer(endpoints, Root(root), on_tcp_error)
        self.run(self.server.start(settings or HttpConfig(listen="127.0.0.1:0", socket="")))
        tcp = [listener for listener in self.server.listeners if listener.sock.family != socket.AF_UNIX]
        self.port = int(tcp[0].sock.getsockname()[1]) if tcp else 0

    def small_send_buffers(self) -> None:
        """Connections accepted from now on have a send buffer of a few KiB (Linux: no autotuning), so
        that an answer of a MiB stays partly unwritten while its client does not read."""
        for listener in self.server.listeners:
            listener.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def on_loop(self, function: Callable[[], T]) -> T:
        """`function()` called on the server's loop (to read what the server holds without a race)."""
        async def call() -> T:
            return function()
        return self.run(call())

    def client(self, timeout: float = 10) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str, headers: Optional[dict[str, str]] = None, method: str = "GET"
            ) -> tuple[http.client.HTTPResponse, bytes]:
        connection = self.client()
        try:
            connection.request(method, path, headers=headers or {})
            response = connection.getresponse()
            return response, response.read()
        finally:
            connection.close()

    def raw(self, timeout: float = 10) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def close(self) -> None:
        try:
            self.run(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def read_until_closed(sock: socket.socket, limit: int = 1 << 24) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks, size = [], 0
    while size < limit:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def responses_in(data: bytes, bodiless: tuple[int, ...] = ()) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses, in order, in what a server sent: status, headers (lower-case names) and body;
    those numbered in `bodiless` (answers to HEAD) have none, whatever their Content-Length says."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        head, separator, data = data.partition(b"\r\n\r\n")
        assert separator, f"an incomplete response head: {head[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = 0 if len(out) in bodiless else int(headers.get("content-length", "0"))
        out.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return out


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The next `count` whole responses (with bodies) from `sock`; the server must not close first."""
    data = b""
    while True:
        at, whole = 0, 0
        while whole < count:
            head_end = data.find(b"\r\n\r\n", at)
            if head_end < 0:
                break
            length = next((int(line.split(b":", 1)[1]) for line in data[at:head_end].split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(data) < head_end + 4 + length:
                break
            at, whole = head_end + 4 + length, whole + 1
        if whole == count:
            return responses_in(data[:at])
        chunk = sock.recv(1 << 20)
        assert chunk, f"the server closed after {whole} of {count} answers"
        data += chunk
