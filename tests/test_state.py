"""gpu_agent.state.AgentState: the one model every output reads (summary, checks, ready, /status JSON)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_agent.config import load_config
from gpu_agent.nvml.model import Gpu, GpuHealth, GpuSample, Inventory, MigState
from gpu_agent.state import FAILED, OK, AgentState, StageStatus


def gpu(index: int) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", pci_bus_id=f"0000:{0x18 + index:02x}:00.0",
               product="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability=(9, 0),
               minor_number=index, mig=MigState(capable=True))


@pytest.fixture
def fresh(tmp_path: Path) -> AgentState:
    return AgentState(load_config(tmp_path / "missing.yaml", required=False))


@pytest.fixture
def ready(fresh: AgentState) -> AgentState:
    fresh.stages["discovery"] = StageStatus("discovery", OK, "2 GPUs found")
    fresh.stages["driver"] = StageStatus("driver", OK, "driver 550.90.07 loaded")
    fresh.inventory = Inventory("550.90.07", "12.4", (gpu(0), gpu(1)))
    fresh.first_reconcile_done = True
    fresh.reconciles = 1
    return fresh


def test_not_started(fresh: AgentState) -> None:
    assert fresh.summary_line() == "starting: first reconcile in progress"
    assert fresh.ready is False
    assert fresh.degraded is False
    checks = fresh.checks()
    assert [(c.name, c.ok, c.reason) for c in checks] == [("gpu-health", False, "no GPU discovered")]
    doc = fresh.to_json()
    assert doc["ready"] is False
    assert doc["summary"] == "starting: first reconcile in progress"
    assert doc["driver"] is None and doc["gpus"] == [] and doc["stages"] == []
    assert doc["config"]["source"] == "built-in defaults"
    assert doc["config"]["digest"].startswith("sha256:")
    assert doc["config"]["reload_error"] is None


def test_not_started_even_if_every_check_passes(ready: AgentState) -> None:
    ready.first_reconcile_done = False
    assert all(c.ok for c in ready.checks())
    assert ready.ready is False
    assert ready.summary_line().startswith("starting:")


def test_ready_with_inventory(ready: AgentState) -> None:
    assert ready.ready is True
    assert ready.summary_line() == "ready: 2x H100 80GB HBM3, driver 550.90.07"
    checks = {c.name: c for c in ready.checks()}
    assert list(checks) == ["discovery", "driver", "gpu-health"]
    assert all(c.ok for c in checks.values())
    assert checks["gpu-health"].reason == "2 GPUs healthy"

    ready.samples["GPU-0"] = GpuSample(utilization_percent=35.0, temperature_c=43.0)
    doc = json.loads(json.dumps(ready.to_json()))  # must be JSON-serialisable as is
    assert doc["ready"] is True and doc["degraded"] is False
    assert doc["summary"] == ready.summary_line()
    assert doc["reconciles"] == 1
    assert doc["driver"] == {"version": "550.90.07", "cuda_version": "12.4"}
    assert [s["name"] for s in doc["stages"]] == ["discovery", "driver"]
    assert doc["stages"][1]["state"] == "ok"
    assert [c["name"] for c in doc["checks"]] == ["discovery", "driver", "gpu-health"]
    first, second = doc["gpus"]
    assert first["uuid"] == "GPU-0" and first["pci_bus_id"] == "0000:18:00.0"
    assert first["compute_capability"] == "9.0"
    assert first["health"] == "healthy" and first["health_reason"] is None
    assert first["mig"] == {"capable": True, "mode": "disabled", "pending_mode": "disabled", "instances": [],
                            "gpu_instances": [], "profiles": []}
    assert first["metrics"]["utilization_percent"] == 35.0
    assert second["metrics"] is None


def test_failing_stage_makes_it_not_ready(ready: AgentState) -> None:
    ready.stages["driver"].state = FAILED
    ready.stages["driver"].message = "nvidia module not loaded: run modprobe nvidia"
    assert ready.ready is False
    assert ready.summary_line() == "not ready: driver: nvidia module not loaded: run modprobe nvidia"
    assert ready.to_json()["ready"] is False


def test_unhealthy_gpu(ready: AgentState) -> None:
    ready.health["GPU-1"] = GpuHealth(xid_reason="XID 79: GPU has fallen off the bus", last_xid=79,
                                      xid_counts=((13, 1), (79, 2)))
    ready.health["GPU-0"] = GpuHealth()
    assert ready.ready is False
    check = ready.checks()[-1]
    assert (check.name, check.ok) == ("gpu-health", False)
    assert check.reason == "GPU 1 (GPU-1): XID 79: GPU has fallen off the bus"
    assert ready.summary_line() == f"not ready: gpu-health: {check.reason}"
    doc = ready.to_json()
    assert doc["ready"] is False
    assert doc["gpus"][0]["health"] == "healthy"
    assert doc["gpus"][1]["health"] == "unhealthy"
    assert doc["gpus"][1]["health_reason"] == "XID 79: GPU has fallen off the bus"
    assert doc["gpus"][1]["xid_counts"] == {"13": 1, "79": 2}


def test_health_of_a_gpu_not_in_inventory_is_ignored(ready: AgentState) -> None:
    ready.health["GPU-gone"] = GpuHealth(query_error="GPU is lost")
    assert ready.ready is True


def test_nvml_error_fails_gpu_health(ready: AgentState) -> None:
    ready.nvml_error = "NVML call nvmlDeviceGetTemperature did not return within 5 s"
    assert ready.ready is False
    assert ready.summary_line() == "not ready: gpu-health: NVML call nvmlDeviceGetTemperature did not return within 5 s"


def test_config_error_is_degraded_but_still_ready(ready: AgentState) -> None:
    ready.config_error = "c.yaml:3: http.lissten: unknown key"
    assert ready.degraded is True
    assert ready.ready is True
    assert ready.summary_line() == "ready: 2x H100 80GB HBM3, driver 550.90.07 (config reload rejected, see /status)"
    doc = ready.to_json()
    assert doc["degraded"] is True and doc["ready"] is True
    assert doc["config"]["reload_error"] == "c.yaml:3: http.lissten: unknown key"


def test_config_error_while_not_ready_reports_the_failure(ready: AgentState) -> None:
    ready.config_error = "bad"
    ready.stages["discovery"].state = FAILED
    ready.stages["discovery"].message = "expected 8 GPUs, found 7"
    assert ready.degraded is True
    assert ready.summary_line() == "not ready: discovery: expected 8 GPUs, found 7"


def test_health_is_published_by_replacement_never_in_place(tmp_path) -> None:
    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    before = state.health
    first = state.update_health("GPU-0", lambda h: replace(h, last_xid=48))
    assert before == {} and state.health == {"GPU-0": first}
    seen = state.health
    second = state.update_health("GPU-0", lambda h: replace(h, query_error="GPU is lost"))
    assert seen["GPU-0"] is first and first.query_error == "" and second.last_xid == 48
