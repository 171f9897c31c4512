"""RSS soak: does the daemon's memory come back after a long stretch of mixed and abusive HTTP traffic?

Starts `gpu-agent run` on a simulated node, measures its idle RSS, then for --minutes drives:
- keep-alive clients cycling /readyz, /readyz?verbose, /status and /metrics, over TCP and the unix socket;
- one-request-per-connection clients (Connection: close);
- every 20 s, a wave of idle connections and slowloris connections trickling header bytes;
- every 60 s, an overload burst of concurrent /metrics requests on fresh connections;
then closes every connection, waits --idle-seconds and measures RSS again. The target: back within
2 MiB of the idle RSS. Not part of `make test`; `python bench/soak.py --minutes 1` for a short run.
Exits 1 when the target is missed.

"failed" counts requests whose connection the daemon closed before answering: a keep-alive client
idle between two requests is among the first the daemon closes to make room during a wave.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

TARGET_MIB = 2.0
PATHS = ("/readyz", "/readyz?verbose", "/status", "/metrics")


@dataclass
class Tally:
    requests: int = 0
    failed: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    abusive_opened: int = 0
    abusive_closed_by_server: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def idle_rss(pid: int, seconds: float = 5.0) -> float:
    """Median of one sample a second: a single sample may catch a sampler pass mid-flight."""
    samples = []
    for _ in range(max(1, int(seconds))):
        samples.append(rss_mib(pid))
        time.sleep(1.0)
    return statistics.median(samples)


class Daemon:
    def __init__(self, profile: str, workdir: Path) -> None:
        self.port = free_port()
        self.root = workdir / "root"
        self.root.mkdir()
        self.socket_path = self.root / "run/gpu-agent/agent.sock"
        config = workdir / "config.yaml"
        config.write_text(f"version: v1\nhttp:\n  listen: 127.0.0.1:{self.port}\n")
        notify_path = workdir / "notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(60)
        self.log = open(workdir / "agent.log", "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_agent", "--root", str(self.root), "--config", str(config),
             "--simulate", profile, "run"],
            env={**os.environ, "NOTIFY_SOCKET": str(notify_path)}, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        try:
            while "READY=1" not in notify.recv(65536).decode().splitlines():
                pass
        finally:
            notify.close()

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(15)
        self.log.close()
        return code


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                   close: bool = False) -> int:
    connection = "close" if close else "keep-alive"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: {connection}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                   if line.lower().startswith("content-length:")), None)
    if length is not None:
        await reader.readexactly(length)
    else:
        await reader.read()
    return status


class Load:
    def __init__(self, daemon: Daemon, tally: Tally, rate: float) -> None:
        self.daemon = daemon
        self.tally = tally
        self.rate = rate  # requests a second across the steady clients

    async def _open(self, unix: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if unix:
            return await asyncio.open_unix_connection(str(self.daemon.socket_path))
        return await asyncio.open_connection("127.0.0.1", self.daemon.port)

    def _count(self, status: Optional[int]) -> None:
        if status is None:
            self.tally.failed += 1
            return
        self.tally.requests += 1
        self.tally.by_status[status] = self.tally.by_status.get(status, 0) + 1

    async def keep_alive_client(self, until: float, interval: float, unix: bool, offset: int) -> None:
        n = offset
        writer: Optional[asyncio.StreamWriter] = None
        while time.monotonic() < until:
            try:
                if writer is None:
                    reader, writer = await self._open(unix)
                self._count(await asyncio.wait_for(_request(reader, writer, PATHS[n % len(PATHS)]), 10))
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                self._count(None)  # the server may close a keep-alive connection: reconnect
                if writer is not None:
                    writer.close()
                writer = None
            n += 1
            await asyncio.sleep(interval)
        if writer is not None:
            writer.close()

    async def one_shot_client(self, until: float, interval: float, offset: int) -> None:
        n = offset
        while time.monotonic() < until:
            self._count(await self.one_shot(PATHS[n % len(PATHS)]))
            n += 1
            await asyncio.sleep(interval)

    async def one_shot(self, path: str) -> Optional[int]:
        try:
            reader, writer = await self._open(unix=False)
        except OSError:
            return None
        try:
            return await asyncio.wait_for(_request(reader, writer, path, close=True), 30)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
            return None
        finally:
            writer.close()

    async def abusive_wave(self, idle: int, slowloris: int, hold: float) -> None:
        """Connections that never finish a request: they should all be closed by the server."""
        async def one(trickle: bool) -> None:
            try:
                reader, writer = await self._open(unix=False)
            except OSError:
                return
            self.tally.abusive_opened += 1
            try:
                deadline = time.monotonic() + hold
                if trickle:
                    writer.write(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n")
                while time.monotonic() < deadline:
                    if trickle:
                        writer.write(b"X-Slow: 1\r\n")
                    try:
                        if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                            self.tally.abusive_closed_by_server += 1
                            return
                    except asyncio.TimeoutError:
                        continue
            except OSError:
                self.tally.abusive_closed_by_server += 1
            finally:
                writer.close()

        await asyncio.gather(*(one(trickle=i < slowloris) for i in range(idle + slowloris)))

    async def overload_burst(self, size: int) -> None:
        for status in await asyncio.gather(*(self.one_shot("/metrics") for _ in range(size))):
            self._count(status)

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        steady: list[asyncio.Task[None]] = []
        clients = 8
        interval = clients * 2 / self.rate  # keep-alive and one-shot clients share the rate
        for i in range(clients):
            steady.append(asyncio.create_task(self.keep_alive_client(until, interval, unix=i % 4 == 0, offset=i)))
            steady.append(asyncio.create_task(self.one_shot_client(until, interval, offset=i)))
        waves = 0
        while time.monotonic() < until:
            await asyncio.sleep(min(20.0, max(0.0, until - time.monotonic())))
            if time.monotonic() >= until:
                break
            waves += 1
            asyncio.create_task(self.abusive_wave(idle=300, slowloris=100, hold=15))
            if waves % 3 == 0:
                await self.overload_burst(400)
        await asyncio.gather(*steady)
        # Give the abusive connections the server's idle timeout to be closed, then stop waiting.
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load phase (default 10)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="idle time before the final RSS (default 60)")
    parser.add_argument("--profile", default="dgx-h100", help="simulated machine (default dgx-h100)")
    parser.add_argument("--rate", type=float, default=200.0, help="steady requests a second (default 200)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(args.profile, Path(tmp))
        tally = Tally()
        try:
            time.sleep(5.0)  # first samples, XID watcher, imports done lazily on the first requests
            asyncio.run(Load(daemon, tally, args.rate).overload_burst(1))
            before = idle_rss(daemon.proc.pid)
            started = time.monotonic()
            asyncio.run(Load(daemon, tally, args.rate).run(args.minutes * 60))
            loaded_s = time.monotonic() - started
            peak = rss_mib(daemon.proc.pid)
            time.sleep(args.idle_seconds)
            after = idle_rss(daemon.proc.pid)
        finally:
            code = daemon.stop()
    growth = after - before
    figures = {
        "minutes": args.minutes, "requests": tally.requests, "failed": tally.failed,
        "by_status": {str(k): v for k, v in sorted(tally.by_status.items())},
        "requests_per_second": round(tally.requests / max(loaded_s, 1e-9), 1),
        "abusive_opened": tally.abusive_opened, "abusive_closed_by_server": tally.abusive_closed_by_server,
        "rss_idle_before_mib": round(before, 2), "rss_end_of_load_mib": round(peak, 2),
        "rss_idle_after_mib": round(after, 2), "rss_growth_mib": round(growth, 2),
        "target_mib": TARGET_MIB, "exit_code": code,
    }
    for key, value in figures.items():
        print(f"{key:28} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = growth <= TARGET_MIB and code == 0
    print("PASS" if ok else f"FAIL: idle RSS grew {growth:.2f} MiB (target {TARGET_MIB} MiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
