"""Issue 38 on the running daemon: GPUs 4-7 of a simulated dgx-h100 switched to vfio-pci by a config reload leave
NVML, and so /metrics: no series names them, GPUs 0-3 are still scraped, and nothing fails on the way (no error
on /metrics, no traceback, no 'gpu-agent bug' in the daemon's log)."""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

VM = {"gpus": {"4": "vm-passthrough", "5": "vm-passthrough", "6": "vm-passthrough", "7": "vm-passthrough"}}
SETTINGS = {"metrics": {"sample_interval_seconds": 1}}


def _vfio(status: int, body: str) -> bool:
    stages = {stage["name"]: stage for stage in json.loads(body)["stages"]} if status == 200 else {}
    return "vfio" in stages and stages["vfio"]["state"] == "ok"


def _temperatures(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP{")]


def test_gpus_passed_through_leave_metrics_without_errors(agent, write_config, root: Path) -> None:
    daemon = agent("dgx-h100", SETTINGS)
    daemon.wait_ready()
    uuids = [gpu["uuid"] for gpu in json.loads(daemon.get("/status")[1])["gpus"]]
    status, before = daemon.get("/metrics")
    assert status == 200 and len(_temperatures(before)) == 8 and all(uuid in before for uuid in uuids)

    write_config({**SETTINGS, "workload": VM})
    daemon.signal(signal.SIGHUP)
    daemon.wait_http("/status", _vfio, timeout=30)
    status, after = daemon.wait_http("/metrics", lambda code, body: len(_temperatures(body)) == 4, timeout=30)
    assert status == 200
    assert not [line for line in after.splitlines() if any(uuid in line for uuid in uuids[4:])]  # none outside NVML
    assert all(uuid in after for uuid in uuids[:4])
    shown = sorted(re.search(r'gpu="(\d+)"', line).group(1) for line in _temperatures(after))  # type: ignore[union-attr]
    assert shown == ["0", "1", "2", "3"]
    gpus = json.loads(daemon.get("/status")[1])["gpus"]
    assert [(gpu["index"], gpu["binding"]["driver"]) for gpu in gpus] == [
        (0, "nvidia"), (1, "nvidia"), (2, "nvidia"), (3, "nvidia"), *[(None, "vfio-pci")] * 4]

    assert daemon.stop() == 0
    log = daemon.output()
    assert "Traceback" not in log and "gpu-agent bug" not in log, log[-4000:]
