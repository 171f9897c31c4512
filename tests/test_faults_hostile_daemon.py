"""The daemon under this round's hostile inputs at once: dpkg's status file a FIFO, a kubelet whose
pod-resources answer carries a 1 MB pod name among 100,000 pods, then one over the size limit. Passes
keep completing, /readyz keeps answering 200, the daemon's peak resident memory stays under 150 MB,
its log under 1 MB, and nothing in it is a traceback or "a gpu-agent bug"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
from test_faults_host_files import docker_node
from test_pod_labels import Kubelet, response

from gpu_agent.kube import podresources

pytestmark = pytest.mark.subprocess
MAX_PEAK_RSS = 150 << 20
MAX_LOG = 1 << 20
PATIENCE_S = 120  # for each thing waited for; a loaded machine is slow, a blocked daemon never gets there


class Daemon:
    """`gpu-agent --simulate dgx-h100 run`, its log in a file (a pipe would block a daemon that logs a lot)."""

    def __init__(self, root: Path, config: Path, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_agent", "--root", str(root), "--config", str(config),
                 "--simulate", "dgx-h100", "run"],
                env={k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NOTIFY_", "WATCHDOG_"))},
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.readyz: list[int] = []  # every /readyz answer once it first said 200

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=PATIENCE_S) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except urllib.error.URLError:  # not listening yet (or any more)
            return 0, ""

    def until(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not done():
            assert self.proc.poll() is None, f"the daemon exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{what}: not within {PATIENCE_S} s; {self.log.read_text()[-3000:]}"
            ready = self.get("/readyz")[0]
            if self.readyz or ready == 200:
                self.readyz.append(ready)
            time.sleep(0.1)

    def status(self) -> dict[str, Any]:
        return json.loads(self.get("/status")[1])

    def peak_rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(PATIENCE_S)


def hostile_node(root: Path) -> None:
    status = docker_node(root)
    status.unlink()
    os.mkfifo(status)


@pytest.mark.host_paths  # /proc/PID/status of the daemon, for its peak resident memory
def test_the_daemon_under_hostile_files_and_a_hostile_kubelet(root: Path, tmp_path: Path,
                                                              write_config: Any) -> None:
    hostile_node(root)
    kubelet = Kubelet(root)
    config = write_config({"metrics": {"pod_labels": True, "sample_interval_seconds": 0.5},
                           "toolkit": {"enabled": True}})
    daemon = Daemon(root, config, write_config.port, tmp_path / "daemon.log")
    try:
        daemon.until("the first pass", lambda: bool(daemon.readyz))
        gpu = daemon.status()["gpus"][0]["uuid"]
        kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu]}}),
                                  ("ml", "p" * (1 << 20), {"c": {"nvidia.com/gpu": [gpu]}}),
                                  *[("ns", f"idle-{n}", {"c": {}}) for n in range(100_000)])
        daemon.until("a 1 MB pod name skipped", lambda: (daemon.status().get("pod_labels") or {})
                     .get("skipped_holders") == 1)
        metrics = daemon.get("/metrics")[1]
        assert len(metrics) < 1 << 20 and 'pod="trainer"' in metrics
        kubelet.answer = response(("x" * (podresources.MAX_MESSAGE_BYTES + 1), "p", {"c": {"nvidia.com/gpu": [gpu]}}))
        daemon.until("an answer over the limit refused", lambda: "MessageTooLarge" in str(
            (daemon.status().get("pod_labels") or {}).get("error")))
        stages = {stage["name"]: stage for stage in daemon.status()["stages"]}
        assert stages["device-path"]["state"] == "ok", stages["device-path"]
        assert "cannot read /var/lib/dpkg/status: it is a FIFO" in json.dumps(stages["device-path"])
        peak = daemon.peak_rss()
    finally:
        daemon.stop()
        kubelet.stop()
    log = daemon.log.read_text(errors="replace")
    assert set(daemon.readyz) == {200}
    print(f"peak resident memory {peak >> 20} MiB, log {len(log.encode())} bytes, {len(daemon.readyz)} probes")
    assert peak < MAX_PEAK_RSS, f"peak resident memory {peak >> 20} MiB"
    assert len(log.encode()) < MAX_LOG
    assert "Traceback" not in log and "gpu-agent bug" not in log, log[-3000:]
