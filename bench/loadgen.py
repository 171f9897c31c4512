"""An open-loop HTTP load generator: request i is due at start + i / rate, whether or not earlier ones have
been answered, and its latency is counted from when it was due (no coordinated omission: a server that
stalls is charged for every request that queued behind the stall).

    python bench/loadgen.py --port P --path /readyz --rate 1000 --seconds 30     # prints JSON
    python bench/loadgen.py --serve PORT                                         # a do-nothing server

Each due request takes an idle keep-alive connection, or opens one (up to --max-connections; beyond that
it waits here for the first connection to come free, and its latency still runs from when it was due;
`queued_for_a_connection` counts them, a sign of a stalled server). A keep-alive connection the server
closes as idle just as a request goes out on it loses that request: as HTTP clients do (RFC 9112 9.3.1),
such a GET is sent again once, on a new connection, still charged from when it was due, and counted in
`retried_after_idle_close`, not as an error. `late_ms_p99` is how late
the generator itself sent requests: when it grows, the generator, not the server, is the bottleneck. The
`--serve` mode answers every request with a fixed 200 at once; the bench drives it to measure this
generator's own capacity.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchkit import percentile


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight. Callbacks, no task per request:
    the generator must stay far cheaper than the server it measures."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = b""
        self.due: Optional[float] = None  # when the request in flight was due
        self.closed = False
        self.answers = 0  # answers received on this connection
        self.resent = False  # the request in flight is a second try

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.due is not None:
            self.load.send(self, self.due)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.due is None:
            return
        parsed = parse_response(self.buffer)
        if parsed is None:
            return
        status, used = parsed
        self.buffer = self.buffer[used:]
        due, self.due = self.due, None
        self.answers += 1
        self.load.answered(self, due, status)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self.due is not None:
            due, self.due = self.due, None
            if self.answers and not self.buffer and not self.resent:  # closed as idle: nothing of it was read
                self.load.resend(due)
            else:
                self.load.failed(self, due)
        else:
            self.load.dropped(self)


def parse_response(buffer: bytes) -> Optional[tuple[int, int]]:
    """(status, bytes used) of the first whole response in `buffer` (Content-Length or chunked), else None."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = buffer[:head_end].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    at = head_end + 4
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(buffer[at:line_end].split(b";")[0], 16)
            at = line_end + 2 + size + 2
            if at > len(buffer):
                return None
            if size == 0:
                return status, at
    length = int(headers.get("content-length", "0"))
    if len(buffer) < at + length:
        return None
    return status, at + length


class Load:
    def __init__(self, host: str, port: int, path: str, gzip: bool, max_connections: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.host, self.port, self.max_connections = host, port, max_connections
        self.request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
                        + ("Accept-Encoding: gzip\r\n" if gzip else "") + "\r\n").encode()
        self.idle: list[Connection] = []
        self.open = 0
        self.in_flight = 0
        self.latencies: list[float] = []
        self.late: list[float] = []
        self.statuses: dict[str, int] = {}
        self.errors = {"connect": 0, "closed_before_answer": 0}
        self.resent = 0
        self.queued: collections.deque[float] = collections.deque()  # due times waiting for a connection
        self.client_queued = 0
        self.last_answer = 0.0

    def fire(self, due: float) -> None:
        if self.idle:
            self.send(self.idle.pop(), due)
        elif self.open < self.max_connections:
            self._open_for(due)
        else:  # every connection busy: wait for one, still charged from `due`
            self.client_queued += 1
            self.in_flight += 1
            self.queued.append(due)

    def _open_for(self, due: float, resent: bool = False) -> None:
        self.open += 1
        self.in_flight += 1
        conn = Connection(self)
        conn.due, conn.resent = due, resent
        self.loop.create_task(self._connect(conn))

    def _next_queued(self, conn: Connection) -> bool:
        if not self.queued or conn.closed:
            return False
        self.in_flight -= 1  # send() counts it again
        self.send(conn, self.queued.popleft(), waited=True)
        return True

    async def _connect(self, conn: Connection) -> None:
        try:
            await self.loop.create_connection(lambda: conn, self.host, self.port)
        except OSError:
            conn.due = None
            self.open -= 1
            self.in_flight -= 1
            self.errors["connect"] += 1

    def send(self, conn: Connection, due: float, waited: bool = False) -> None:
        if conn.due is None:
            conn.due = due
            conn.resent = False
            self.in_flight += 1
        if not waited and not conn.resent:  # the generator's own lateness (a wait for a connection is the server's)
            self.late.append(self.loop.time() - due)
        assert conn.transport is not None
        conn.transport.write(self.request)

    def answered(self, conn: Connection, due: float, status: int) -> None:
        self.in_flight -= 1
        self.last_answer = self.loop.time()
        self.latencies.append(self.last_answer - due)
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1
        if not conn.closed and not self._next_queued(conn):
            self.idle.append(conn)

    def failed(self, conn: Connection, due: float) -> None:
        self.in_flight -= 1
        self.errors["closed_before_answer"] += 1
        self.open -= 1
        self._reopen()

    def resend(self, due: float) -> None:
        """The request went out on a keep-alive connection the server was closing as idle: once more, on a
        new connection (in the place of the one closed), where a failure is the server's."""
        self.in_flight -= 1
        self.open -= 1
        self.resent += 1
        self._open_for(due, resent=True)

    def _reopen(self) -> None:
        """A connection went away: requests waiting for one get a new one."""
        while self.queued and self.open < self.max_connections:
            self.in_flight -= 1  # fire() counts it again
            self.fire(self.queued.popleft())

    def dropped(self, conn: Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        self.open -= 1
        self._reopen()


async def run_load(host: str, port: int, path: str, rate: float, seconds: float, max_connections: int,
                   gzip: bool) -> dict[str, object]:
    load = Load(host, port, path, gzip, max_connections)
    loop = load.loop
    start = loop.time() + 0.05
    total = int(rate * seconds)
    sent = 0
    while sent < total:
        now = loop.time()
        while sent < total and start + sent / rate <= now:  # everything due by now, even if we woke late
            load.fire(start + sent / rate)
            sent += 1
        if sent < total:
            await asyncio.sleep(max(0.0, start + sent / rate - loop.time()))
    deadline = loop.time() + 30
    while load.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    unanswered = load.in_flight
    elapsed = max(load.last_answer, start + seconds) - start  # served per second until the last answer
    for conn in list(load.idle):
        if conn.transport is not None:
            conn.transport.close()
    ms = [x * 1000 for x in load.latencies]
    return {
        "path": path, "rate": rate, "seconds": seconds, "scheduled": total, "completed": len(ms),
        "achieved_rps": round(len(ms) / max(elapsed, 1e-9), 1), "statuses": load.statuses,
        "errors": sum(load.errors.values()) + unanswered, "error_kinds": load.errors,
        "retried_after_idle_close": load.resent,
        "unanswered_after_30s": unanswered, "queued_for_a_connection": load.client_queued,
        "max_connections": load.max_connections, "shed_503": load.statuses.get("503", 0),
        "p50_ms": round(percentile(ms, 50), 3) if ms else None,
        "p99_ms": round(percentile(ms, 99), 3) if ms else None,
        "p999_ms": round(percentile(ms, 99.9), 3) if ms else None,
        "max_ms": round(max(ms), 3) if ms else None,
        "late_ms_p99": round(percentile([x * 1000 for x in load.late], 99), 3) if load.late else None,
    }


class NullServer(asyncio.Protocol):
    RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.RESPONSE * data.count(b"\r\n\r\n"))


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(NullServer, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=int, help="be the do-nothing server on this port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--path", default="/readyz")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-connections", type=int, default=48,
                        help="at most this many connections (default 48: below the agent's cap of 64, which "
                             "closes the longest idle beyond it); further requests queue here, still charged "
                             "from when they were due")
    parser.add_argument("--gzip", action="store_true", help="send Accept-Encoding: gzip, as Prometheus does")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.port is None:
        parser.error("--port is needed")
    result = asyncio.run(run_load(args.host, args.port, args.path, args.rate, args.seconds,
                                  args.max_connections, args.gzip))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
