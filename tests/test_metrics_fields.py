"""DCGM_FI_DEV_MEMORY_TEMP and DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL from NVML field values: what the real
H100 answered (replayed from its capture), what the simulator answers, and the capture of field values."""
from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from test_capture import CAPTURE, replay

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.capture import capture
from gpu_agent.state import AgentState


def series(state: AgentState, name: str) -> dict[str, float]:
    """The values of one DCGM series by GPU index (the parser names a counter's samples NAME_total)."""
    text = render(make_registry(AgentCollector(state, lambda: 0, "node-1"))).decode()
    return {sample.labels["gpu"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == name for sample in family.samples}


def built(tmp_path: Path, simulate: str) -> Runtime:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    runtime = Runtime.build(Root(tmp_path / "root"), load_config(path, required=True), simulate)
    asyncio.run(runtime.engine.reconcile(force=True))
    return runtime


def test_the_real_h100_memory_temperature_is_replayed_and_it_has_no_nvlink(tmp_path: Path) -> None:
    runtime = replay(tmp_path, CAPTURE)
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    [sample] = runtime.state.samples.values()
    assert sample.memory_temperature_c == 35.0  # NVML_FI_DEV_MEMORY_TEMP in the node's NVML dump
    assert sample.nvlink_data_kib is None and sample.nvlink_bandwidth_total is None  # a VM without NVLink
    assert series(runtime.state, "DCGM_FI_DEV_MEMORY_TEMP") == {"0": 35.0}
    assert series(runtime.state, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL") == {}


def test_nvlink_bandwidth_needs_two_samples_and_grows_with_load(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        assert series(runtime.state, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL") == {}  # one reading is no rate
        temperatures = series(runtime.state, "DCGM_FI_DEV_MEMORY_TEMP")
        assert len(temperatures) == 8 and all(t > series(runtime.state, "DCGM_FI_DEV_GPU_TEMP")[g]
                                              for g, t in temperatures.items())
        with runtime.machine.edit() as doc:
            doc["gpus"][1]["processes"].append({"pid": 4242, "name": "train", "used_mib": 1024})
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    bandwidth = series(runtime.state, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL")
    assert len(bandwidth) == 8 and bandwidth["1"] > 0 and bandwidth["0"] == 0


def test_a_gpu_without_hbm_or_nvlink_has_neither_series(tmp_path: Path) -> None:
    runtime = built(tmp_path, "t4")
    try:
        Sampler(runtime.nvml, runtime.state, runtime.root).sample()
    finally:
        runtime.nvml.close()
    assert series(runtime.state, "DCGM_FI_DEV_GPU_TEMP") and not series(runtime.state, "DCGM_FI_DEV_MEMORY_TEMP")
    [sample] = runtime.state.samples.values()
    assert sample.nvlink_data_kib is None


def test_a_capture_records_the_field_values_and_its_replay_answers_them(tmp_path: Path) -> None:
    live = built(tmp_path / "live", "dgx-h100")
    try:
        with live.machine.edit() as doc:
            doc["gpus"][2]["temperature_c"] = 61
        manifest = capture(live.root, live.nvml.lib, tmp_path / "capture", 5.0, "--simulate dgx-h100", "simulated")
    finally:
        live.nvml.close()
    assert manifest["problems"] == []
    replayed = replay(tmp_path / "replayed", tmp_path / "capture")
    try:
        asyncio.run(replayed.engine.reconcile(force=True))
        Sampler(replayed.nvml, replayed.state, replayed.root).sample()
        samples = [replayed.state.samples[gpu.uuid] for gpu in replayed.state.inventory.gpus]
    finally:
        replayed.nvml.close()
    assert samples[2].memory_temperature_c == 63.0 and samples[0].memory_temperature_c != 63.0
    assert all(sample.nvlink_data_kib is not None for sample in samples)  # as recorded, NVSwitch machine
