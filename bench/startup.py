"""Time from exec to READY=1, and the daemon's resident memory, on simulated nodes.

Run with `make bench`. Prints one line per profile; nothing here is asserted by the tests.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RUNS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(profile: str, workdir: Path) -> tuple[float, float]:
    notify_path = workdir / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    config = workdir / "config.yaml"
    config.write_text(f"version: v1\nhttp:\n  listen: 127.0.0.1:{free_port()}\n")
    root = workdir / "root"
    root.mkdir(exist_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_agent", "--root", str(root), "--config", str(config), "--simulate", profile, "run"],
        env={**os.environ, "NOTIFY_SOCKET": str(notify_path)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        while "READY=1" not in notify.recv(65536).decode().splitlines():
            pass
        ready_s = time.monotonic() - started
        time.sleep(1.0)  # let the first samples and the XID watcher settle
        rss_mib = psutil.Process(proc.pid).memory_info().rss / 2**20
    finally:
        proc.terminate()
        proc.wait(10)
        notify.close()
        notify_path.unlink()
    return ready_s, rss_mib


def main() -> None:
    print(f"{'profile':10} {'READY=1 median (s)':>20} {'max (s)':>8} {'RSS (MiB)':>10}")
    for profile in ("dgx-h100", "dgx-a100", "t4", "none"):
        results = []
        for _ in range(RUNS):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(one_start(profile, Path(tmp)))
        ready = [r[0] for r in results]
        print(f"{profile:10} {statistics.median(ready):20.3f} {max(ready):8.3f} {max(r[1] for r in results):10.1f}")


if __name__ == "__main__":
    main()
