"""A hostile local user: /readyz latency while thousands of idle and slowloris connections are open.

Starts `gpu-agent run` on a simulated node under the unit's descriptor limit (LimitNOFILE), opens
--idle idle TCP connections and --slowloris connections that trickle header bytes, then times
--probes sequential /readyz requests on fresh connections. Reports the latencies, how long the
slowloris connections stayed open, the daemon's descriptors, and its log lines about connections.
The goal (issue 11): /readyz within 50 ms while 2,000 idle connections are open. Exits 1 if missed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from soak import Daemon

GOAL_MS = 50.0
UNIT = Path(__file__).resolve().parent.parent / "systemd/gpu-agent.service"


def unit_nofile() -> int:
    for line in UNIT.read_text().splitlines():
        if line.startswith("LimitNOFILE="):
            return int(line.split("=", 1)[1])
    raise SystemExit(f"{UNIT}: no LimitNOFILE= line")


def readyz_ms(port: int, timeout: float = 10.0) -> float:
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/readyz")
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"/readyz answered {response.status}")
    finally:
        connection.close()
    return (time.perf_counter() - started) * 1000


def closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=int, default=2000, help="idle TCP connections (default 2000)")
    parser.add_argument("--slowloris", type=int, default=500, help="trickling connections (default 500)")
    parser.add_argument("--probes", type=int, default=200, help="/readyz requests timed (default 200)")
    parser.add_argument("--profile", default="dgx-h100", help="simulated machine (default dgx-h100)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    nofile = unit_nofile()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = args.idle + args.slowloris + 100
    if hard != resource.RLIM_INFINITY and hard < max(needed, nofile):
        raise SystemExit(f"needs a hard descriptor limit of {max(needed, nofile)}, have {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))  # the daemon inherits the unit's limit
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(args.profile, Path(tmp))
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
        opened: list[socket.socket] = []
        try:
            baseline = [readyz_ms(daemon.port) for _ in range(20)]
            fds_before = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
            for _ in range(args.idle):
                opened.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=10))
            slow = [socket.create_connection(("127.0.0.1", daemon.port), timeout=10) for _ in range(args.slowloris)]
            opened += slow
            flood_done = time.monotonic()
            for s in slow:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n")
            latencies = []
            for _ in range(args.probes):
                latencies.append(readyz_ms(daemon.port))
                for s in slow[:10]:  # keep a few trickling
                    try:
                        s.send(b"X: 1\r\n")
                    except OSError:
                        pass
            fds_during = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
            open_slow = slow
            while open_slow and time.monotonic() - flood_done < 60:
                open_slow = [s for s in open_slow if not closed_by_server(s)]
                time.sleep(0.2)
            slow_closed_s = time.monotonic() - flood_done
        finally:
            for s in opened:
                s.close()
            code = daemon.stop()
        log = (Path(tmp) / "agent.log").read_text(errors="replace")
    latencies.sort()
    figures = {
        "limit_nofile": nofile, "idle": args.idle, "slowloris": args.slowloris, "probes": args.probes,
        "readyz_idle_p50_ms": round(statistics.median(baseline), 2),
        "readyz_p50_ms": round(statistics.median(latencies), 2),
        "readyz_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1], 2),
        "readyz_max_ms": round(latencies[-1], 2),
        "daemon_fds_before": fds_before, "daemon_fds_during": fds_during,
        "slowloris_all_closed_after_s": round(slow_closed_s, 1) if not open_slow else None,
        "log_lines_about_connections": sum("gpu_agent.daemon.listener" in line for line in log.splitlines()),
        "too_many_open_files_in_log": log.count("Too many open files"),
        "exit_code": code,
    }
    for key, value in figures.items():
        print(f"{key:32} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = figures["readyz_p99_ms"] <= GOAL_MS and not open_slow and code == 0
    print("PASS" if ok else f"FAIL: goal /readyz p99 <= {GOAL_MS} ms, slowloris closed, clean exit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
