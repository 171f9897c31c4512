"""Hostile local users against the running daemon, one flood or peer at a time (issue 35's acceptance):
does /readyz answer within 1 s throughout, does the daemon's RSS stay under 150 MB, does its log grow less
than 1 MB, and is there no traceback or "a gpu-agent bug" in it?

Starts `gpu-agent run` on a simulated node, then for each shape runs a flooding process for --seconds while
this one probes /readyz on fresh TCP connections every 50 ms and samples the daemon's RSS. Shapes:
- refused-*: 100 connections each repeating a request the protocol refuses (X\\r\\n\\r\\n, a header without a
  colon, a body, HTTP/2.0, an oversize head, a TLS hello), reconnecting when closed; also on the unix socket;
- half-closed: 20 clients sending part of a request and closing 20 ms later, again and again;
- pipelined-gone: 10 clients writing 2,000 pipelined requests and closing;
- never-reading: 100 clients pipelining 500 requests with a 1 KiB receive buffer and never reading;
- idle-slowloris: 200 idle connections and 100 trickling header bytes;
- sighup: 180 SIGHUPs a second (the issue's 1,800 in 10 s).
Not part of `make test`. Exits 1 when a goal is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import psutil

from flood import readyz_ms as _readyz_ms
from soak import Daemon

READYZ_GOAL_MS = 1000.0
RSS_GOAL_MIB = 150.0
LOG_GOAL_BYTES = 1 << 20
CONNECTIONS = 100

REFUSED = {
    "refused-not-a-request": b"X\r\n\r\n",
    "refused-no-colon": b"GET /readyz HTTP/1.1\r\nno colon here\r\n\r\n",
    "refused-body": b"GET /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    "refused-http2": b"GET /readyz HTTP/2.0\r\nHost: x\r\n\r\n",
    "refused-oversize": b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (20 << 10) + b"\r\n\r\n",
    "refused-tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",
}
SHAPES = [*REFUSED, "refused-unix", "half-closed", "pipelined-gone", "never-reading", "idle-slowloris", "sighup"]
REQUEST = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"


# --- the flooding process ----------------------------------------------------------------------------


async def _connect(port: int, unix: Optional[str], rcvbuf: int = 0) -> tuple[asyncio.StreamReader,
                                                                           asyncio.StreamWriter]:
    if unix:
        return await asyncio.open_unix_connection(unix)
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def _client(shape: str, port: int, unix: Optional[str], until: float) -> None:
    while time.monotonic() < until:
        writer = None
        try:
            if shape in REFUSED or shape == "refused-unix":
                _, writer = await _connect(port, unix)
                data = REFUSED.get(shape, REFUSED["refused-not-a-request"])
                while time.monotonic() < until:
                    writer.write(data)
                    await writer.drain()
                    await asyncio.sleep(0.01)
            elif shape == "half-closed":
                _, writer = await _connect(port, unix)
                writer.write(b"GET /readyz HTTP/1.1\r\nHost: x")
                await asyncio.sleep(0.02)
            elif shape == "pipelined-gone":
                _, writer = await _connect(port, unix)
                writer.write(REQUEST * 2000)
                await writer.drain()
            elif shape == "never-reading":
                _, writer = await _connect(port, unix, rcvbuf=1024)
                writer.write(REQUEST * 500)
                await asyncio.sleep(0.5)
            elif shape == "idle":
                _, writer = await _connect(port, unix)
                await asyncio.sleep(until - time.monotonic())
            elif shape == "slowloris":
                _, writer = await _connect(port, unix)
                writer.write(b"GET /readyz HTTP/1.1\r\n")
                while time.monotonic() < until:
                    writer.write(b"X-Slow: 1\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.5)
        except (OSError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.01)
        finally:
            if writer is not None:
                writer.close()


async def flood(shape: str, port: int, unix: Optional[str], seconds: float) -> None:
    until = time.monotonic() + seconds
    if shape == "idle-slowloris":
        clients = [_client("idle", port, None, until) for _ in range(2 * CONNECTIONS)]
        clients += [_client("slowloris", port, None, until) for _ in range(CONNECTIONS)]
    else:
        count = {"half-closed": 20, "pipelined-gone": 10}.get(shape, CONNECTIONS)
        clients = [_client(shape, port, unix if shape == "refused-unix" else None, until) for _ in range(count)]
    await asyncio.gather(*clients)


# --- the measuring process ---------------------------------------------------------------------------


def readyz_ms(port: int) -> float:
    return _readyz_ms(port, timeout=5)


def measure(daemon: Daemon, shape: str, seconds: float, log_path: Path) -> dict[str, Any]:
    log_before = log_path.stat().st_size
    process = psutil.Process(daemon.proc.pid)
    flooder = None
    if shape == "sighup":
        until = time.monotonic() + seconds
    else:
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", shape, "--port", str(daemon.port),
                                    "--unix", str(daemon.socket_path), "--seconds", str(seconds)])
        until = time.monotonic() + seconds
    latencies: list[float] = []
    failures: list[str] = []
    rss = 0.0
    next_hup = time.monotonic()
    while time.monotonic() < until:
        if shape == "sighup":
            while time.monotonic() >= next_hup:  # 180 a second
                os.kill(daemon.proc.pid, signal.SIGHUP)
                next_hup += 1 / 180
        try:
            latencies.append(readyz_ms(daemon.port))
        except (OSError, RuntimeError) as exc:
            failures.append(str(exc))
        rss = max(rss, process.memory_info().rss / 2**20)
        time.sleep(0.05 if shape != "sighup" else 0.0)
    if flooder is not None:
        flooder.wait(seconds + 30)
    time.sleep(1)
    log = log_path.read_bytes()[log_before:].decode(errors="replace")
    return {"shape": shape, "probes": len(latencies), "failures": len(failures), "first_failure": failures[:1],
            "readyz_max_ms": max(latencies, default=None), "rss_max_mib": rss,
            "log_growth_bytes": len(log), "tracebacks": log.count("Traceback"), "bugs": log.count("gpu-agent bug")}


def met(row: dict[str, Any]) -> bool:
    return (row["failures"] == 0 and row["readyz_max_ms"] is not None and row["readyz_max_ms"] <= READYZ_GOAL_MS
            and row["rss_max_mib"] <= RSS_GOAL_MIB and row["log_growth_bytes"] < LOG_GOAL_BYTES
            and row["tracebacks"] == 0 and row["bugs"] == 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="each flood's length (default 10)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--profile", default="dgx-h100", help="simulated machine (default dgx-h100)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--flood", help=argparse.SUPPRESS)  # the flooding process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--unix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        asyncio.run(flood(args.flood, args.port, args.unix, args.seconds))
        return 0
    shapes = [shape for shape in args.shapes.split(",") if shape]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        raise SystemExit(f"unknown shapes: {', '.join(sorted(unknown))}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(args.profile, Path(tmp))
        try:
            for shape in shapes:
                row = measure(daemon, shape, args.seconds, Path(tmp) / "agent.log")
                rows.append(row)
                print(f"{shape:24} /readyz max {row['readyz_max_ms'] or 0:7.1f} ms ({row['probes']} probes, "
                      f"{row['failures']} failed)  RSS max {row['rss_max_mib']:6.1f} MiB  "
                      f"log +{row['log_growth_bytes']} B  tracebacks {row['tracebacks']}  "
                      f"{'ok' if met(row) else 'MISSED'}", flush=True)
        finally:
            daemon.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(met(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
