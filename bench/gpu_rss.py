"""Issue 15's real-GPU memory goal, on a node with an NVIDIA GPU and its driver loaded: the agent's idle RSS
beside a Python that imported pynvml and called nvmlInit, measured the same way in the same run. The goal:
at most 1.3x. Not part of `make bench` (which runs on simulated nodes); run it as root on the GPU node:

    .venv/bin/python bench/gpu_rss.py [--idle-seconds 60] [--json out.json]

The agent runs on the real root with every stage that could change the host off: driver (no modprobe),
toolkit, Kubernetes and MIG (no config); it reads NVML, samples metrics, watches XIDs and serves its
endpoints on a free loopback port and a socket in a temporary directory under /run. What it writes is its own: its
lock in /run/gpu-agent. Exits 2 when NVML does not initialise here, 1 when the goal is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

GOAL_RATIO = 1.3
READ_ONLY = """version: v1
http:
  listen: 127.0.0.1:{port}
  socket: {socket}
driver:
  enabled: false
toolkit:
  enabled: false
kubernetes:
  enabled: false
"""
BASELINE = "import pynvml, sys; pynvml.nvmlInit(); print('ready', flush=True); sys.stdin.read()"


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def settled_rss(pid: int, idle_seconds: float) -> float:
    """The median of one sample a second over the last ten seconds of the idle time."""
    time.sleep(max(0.0, idle_seconds - 10))
    samples = []
    for _ in range(10):
        samples.append(rss_mib(pid))
        time.sleep(1)
    return statistics.median(samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def baseline(idle_seconds: float) -> float:
    proc = subprocess.Popen([sys.executable, "-c", BASELINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            print(f"nvmlInit failed here, so this is no GPU node:\n{proc.communicate(timeout=30)[1][-2000:]}",
                  file=sys.stderr)
            raise SystemExit(2)
        return settled_rss(proc.pid, idle_seconds)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def agent(workdir: Path, idle_seconds: float) -> tuple[float, str]:
    config = workdir / "config.yaml"
    config.write_text(READ_ONLY.format(port=free_port(), socket=workdir / "agent.sock"))
    notify_path = workdir / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(120)
    with open(workdir / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpu_agent", "--config", str(config), "run"],
                                env={**os.environ, "NOTIFY_SOCKET": str(notify_path)}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            status = ""
            while True:
                lines = notify.recv(65536).decode().splitlines()
                status = next((line[7:] for line in lines if line.startswith("STATUS=")), status)
                if "READY=1" in lines:
                    break
            return settled_rss(proc.pid, idle_seconds), status
        finally:
            notify.close()
            proc.terminate()
            proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="idle time before RSS is read (default 60)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    python = baseline(args.idle_seconds)
    with tempfile.TemporaryDirectory(dir="/run", prefix="gpu-agent-rss-") as tmp:  # http.socket must be under /run
        measured, status = agent(Path(tmp), args.idle_seconds)
    ratio = measured / python
    figures = {"python_pynvml_nvmlinit_rss_mib": round(python, 2), "agent_idle_rss_mib": round(measured, 2),
               "ratio": round(ratio, 3), "goal_ratio": GOAL_RATIO, "passed": ratio <= GOAL_RATIO,
               "agent_status": status}
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
