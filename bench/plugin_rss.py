"""What the device plugin costs in resident memory: the agent's idle RSS on a simulated DGX H100 with
plugin.enabled false, then true (grpclib imported, one server per resource). With
--standin (the Go kubelet stand-in: tests/kubelet_standin/build.sh OUT WORKDIR), a kubelet is there
too: the plugin registers and a ListAndWatch stream stays open, as on a real node.
The target (issue 14): at most 10 MiB more with the plugin on. Not part of `make test`.

    .venv/bin/python bench/plugin_rss.py [--standin /tmp/kubelet-standin] [--idle-seconds 10]
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
from typing import Optional

import psutil

TARGET_MIB = 10.0


def idle_rss(pid: int, seconds: float) -> float:
    """Median of one sample a second, after the first reconcile has settled."""
    samples = []
    for _ in range(max(1, int(seconds))):
        samples.append(psutil.Process(pid).memory_info().rss / 2**20)
        time.sleep(1.0)
    return statistics.median(samples)


def run(workdir: Path, plugin: bool, standin: Optional[Path], seconds: float) -> float:
    root = workdir / "root"
    plugin_dir = root / "var/lib/kubelet/device-plugins"
    plugin_dir.mkdir(parents=True)
    config = workdir / "config.yaml"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config.write_text(f"version: v1\nhttp:\n  listen: 127.0.0.1:{port}\nplugin:\n  enabled: {str(plugin).lower()}\n")
    kubelet = None
    if standin is not None:
        kubelet = subprocess.Popen([str(standin), "-dir", str(plugin_dir)], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    notify_path = workdir / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(60)
    with open(workdir / "agent.log", "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpu_agent", "--root", str(root), "--config", str(config), "--simulate",
             "dgx-h100", "run"], env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            while "READY=1" not in notify.recv(65536).decode().splitlines():
                pass
            time.sleep(3.0)  # the plugin registers, the sampler's first passes run
            return idle_rss(agent.pid, seconds)
        finally:
            notify.close()
            agent.terminate()
            agent.wait(15)
            if kubelet is not None:
                kubelet.kill()
                kubelet.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--standin", type=Path, help="the Go kubelet stand-in binary (default: no kubelet)")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle samples, one a second (default 10)")
    args = parser.parse_args()
    results = {}
    for plugin in (False, True):
        with tempfile.TemporaryDirectory(prefix="gpu-agent-plugin-rss-") as workdir:
            results["on" if plugin else "off"] = run(Path(workdir), plugin, args.standin, args.idle_seconds)
    added = results["on"] - results["off"]
    print(json.dumps({"rss_plugin_off_mib": round(results["off"], 2), "rss_plugin_on_mib": round(results["on"], 2),
                      "added_mib": round(added, 2), "target_mib": TARGET_MIB, "kubelet": args.standin is not None,
                      "within_target": added <= TARGET_MIB}, indent=2))
    sys.exit(0 if added <= TARGET_MIB else 1)


if __name__ == "__main__":
    main()
