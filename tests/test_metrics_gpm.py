"""DCGM_FI_PROF_* from NVML GPM on Hopper and later: over the interval between two samples, in DCGM's
units, left out (with the reason in /status) where the GPU has no GPM or only one sample was taken."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_capture import CAPTURE, replay
from test_metrics_fields import built, series

from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.gpm import SECOND_SAMPLE
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.state import AgentState

PROF = ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")


def test_hopper_gets_the_prof_series_from_two_gpm_samples(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        with runtime.machine.edit() as doc:
            doc["gpus"][1]["processes"].append({"pid": 4242, "name": "train", "used_mib": 1024})
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        for name in PROF:
            assert series(runtime.state, name) == {}, name  # one sample: nothing to measure yet
        assert runtime.state.to_json()["gpus"][0]["metrics"]["profiling_unavailable"] == SECOND_SAMPLE
        sampler.sample()
        sampler.sample()
        calls = runtime.nvml.lib.calls
        status = runtime.state.to_json()["gpus"][1]["metrics"]
    finally:
        runtime.nvml.close()
    for name in PROF:
        assert len(series(runtime.state, name)) == 8, name
    assert series(runtime.state, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")["1"] == pytest.approx(0.35)  # a ratio, not 35 %
    assert series(runtime.state, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")["0"] == 0
    assert series(runtime.state, "DCGM_FI_PROF_PCIE_TX_BYTES")["1"] == pytest.approx(35 * 40 * 1024 * 1024)  # B/s
    assert status["profiling_unavailable"] is None and status["dram_active"] == pytest.approx(0.175)
    # two buffers per GPU, allocated once and taken in turns: three samples take 24, allocate 16, free none
    assert calls["nvmlGpmSampleGet"] == 24 and calls["nvmlGpmMetricsGet"] == 16
    assert calls["nvmlGpmSampleAlloc"] == 16 and calls["nvmlGpmSampleFree"] == 0



def test_the_buffers_of_a_gpu_no_longer_sampled_are_given_back(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        for _ in range(3):
            sampler.sample()
        sampler.profiling.keep_only({})  # as when the GPUs are gone from a sample
        calls = dict(runtime.nvml.lib.calls)
        sampler.sample()  # and back: new buffers, the first sample waits for a second
        again = dict(runtime.nvml.lib.calls)
    finally:
        runtime.nvml.close()
    assert calls["nvmlGpmSampleFree"] == calls["nvmlGpmSampleAlloc"] == 16
    assert again["nvmlGpmSampleAlloc"] == 24 and again["nvmlGpmMetricsGet"] == calls["nvmlGpmMetricsGet"]


def test_ampere_has_no_gpm_and_status_says_why(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-a100")
    try:
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
        calls = runtime.nvml.lib.calls
    finally:
        runtime.nvml.close()
    for name in PROF:
        assert series(runtime.state, name) == {}, name
    assert len(series(runtime.state, "DCGM_FI_DEV_GPU_TEMP")) == 8
    why = runtime.state.to_json()["gpus"][0]["metrics"]["profiling_unavailable"]
    assert "NVML GPM is not supported on this GPU" in why and "DCGM" in why
    assert calls["nvmlGpmQueryDeviceSupport"] == 8 and calls["nvmlGpmSampleGet"] == 0  # asked once per GPU


def test_a_replayed_node_without_recorded_gpm_leaves_the_series_out(tmp_path: Path) -> None:
    runtime = replay(tmp_path, CAPTURE)
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    assert series(runtime.state, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") == {}
    assert "NVML GPM unavailable" in runtime.state.to_json()["gpus"][0]["metrics"]["profiling_unavailable"]


def test_a_failing_gpm_call_is_a_reason_not_a_query_error(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        with runtime.machine.edit() as doc:
            doc["faults"].append({"id": 1, "call": "nvmlGpmSampleGet", "gpu": 3, "times": None, "error": "Unknown"})
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    gpu = runtime.state.to_json()["gpus"][3]
    assert gpu["health"] == "healthy"
    assert "GPM sample failed: nvmlGpmSampleGet" in gpu["metrics"]["profiling_unavailable"]
    assert set(series(runtime.state, "DCGM_FI_PROF_DRAM_ACTIVE")) == {"0", "1", "2", "4", "5", "6", "7"}


def test_each_gpu_instance_gets_its_own_prof_series(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        nvml = runtime.nvml
        assert nvml.mig.set_mode(0, True) is None
        for start in (0, 4):
            nvml.mig.create_compute_instance(0, nvml.mig.create_gpu_instance(0, 9, (start, 4)), 3, 0)
        runtime.state.inventory = nvml.inventory.read()
        busy, idle = (gi.id for gi in runtime.state.inventory.gpus[0].mig.gpu_instances)
        with runtime.machine.edit() as doc:
            doc["gpus"][0]["processes"].append({"pid": 7, "name": "infer", "used_mib": 512, "gpu_instance_id": busy,
                                                "compute_instance_id": 0})
        sampler = Sampler(nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    families = {name: series_by_instance(runtime.state, name) for name in PROF}
    for name, found in families.items():
        assert len(found) == 9, name  # seven whole GPUs, and GPU 0's two GPU instances
    active = families["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]
    assert active[("0", str(busy))] == pytest.approx(0.35) and active[("0", str(idle))] == 0
    assert ("0", None) not in active


def series_by_instance(state: AgentState, name: str) -> dict[tuple[str, Optional[str]], float]:
    text = render(make_registry(AgentCollector(state, lambda: 0, "node-1"))).decode()
    return {(s.labels["gpu"], s.labels.get("GPU_I_ID")): s.value for family in text_string_to_metric_families(text)
            if family.name == name for s in family.samples}
