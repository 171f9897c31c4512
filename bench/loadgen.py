"""An open-loop HTTP load generator: request i is due at start + i / rate, whether or not earlier ones have
been answered, and its latency is counted from when it was due (no coordinated omission: a server that
stalls is charged for every request that queued behind the stall).

    python bench/loadgen.py --port P --path /readyz --rate 1000 --seconds 30     # prints JSON
    python bench/loadgen.py --serve PORT                                         # a do-nothing server

Each due request takes an idle keep-alive connection, or opens one (up to --max-connections; beyond that
the request counts as `client_limited`, a sign of a stalled server, not sent late). `late_ms_p99` is how late
the generator itself sent requests: when it grows, the generator, not the server, is the bottleneck. The
`--serve` mode answers every request with a fixed 200 at once; the bench drives it to measure this
generator's own capacity.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import percentile


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = b""
        self.waiter: Optional[asyncio.Future[int]] = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0 or self.waiter is None:
            return
        head = self.buffer[:head_end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            if line[:15].lower() == "content-length:":
                length = int(line[15:])
        if len(self.buffer) < head_end + 4 + length:
            return
        self.buffer = self.buffer[head_end + 4 + length:]
        waiter, self.waiter = self.waiter, None
        if not waiter.done():
            waiter.set_result(int(head[0].split()[1]))

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed by the server"))


async def run_load(host: str, port: int, path: str, rate: float, seconds: float, max_connections: int,
                   gzip: bool) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
               + ("Accept-Encoding: gzip\r\n" if gzip else "") + "\r\n").encode()
    idle: list[Connection] = []
    open_count = 0
    latencies: list[float] = []
    late: list[float] = []
    statuses: dict[str, int] = {}
    errors = 0
    client_limited = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        nonlocal open_count, errors
        conn: Optional[Connection] = idle.pop() if idle else None
        try:
            if conn is None:
                open_count += 1
                _, conn = await loop.create_connection(Connection, host, port)
            late.append(loop.time() - due)
            conn.waiter = loop.create_future()
            assert conn.transport is not None
            conn.transport.write(request)
            status = await asyncio.wait_for(conn.waiter, 30)
        except (OSError, asyncio.TimeoutError, ConnectionError):
            errors += 1
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            open_count -= 1
            return
        latencies.append(loop.time() - due)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if conn.closed:
            open_count -= 1
        else:
            idle.append(conn)

    start = loop.time() + 0.05
    total = int(rate * seconds)
    for i in range(total):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if not idle and open_count >= max_connections:
            client_limited += 1
            continue
        task = asyncio.create_task(one(due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    elapsed = loop.time() - start
    if tasks:
        await asyncio.wait(tasks, timeout=35)
    for conn in idle:
        if conn.transport is not None:
            conn.transport.close()
    ms = [x * 1000 for x in latencies]
    return {
        "path": path, "rate": rate, "seconds": seconds, "scheduled": total, "completed": len(latencies),
        "achieved_rps": round(len(latencies) / max(elapsed, 1e-9), 1), "statuses": statuses,
        "errors": errors, "client_limited": client_limited, "shed_503": statuses.get("503", 0),
        "p50_ms": round(percentile(ms, 50), 3) if ms else None,
        "p99_ms": round(percentile(ms, 99), 3) if ms else None,
        "p999_ms": round(percentile(ms, 99.9), 3) if ms else None,
        "max_ms": round(max(ms), 3) if ms else None,
        "late_ms_p99": round(percentile([x * 1000 for x in late], 99), 3) if late else None,
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
    parser.add_argument("--max-connections", type=int, default=256)
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
