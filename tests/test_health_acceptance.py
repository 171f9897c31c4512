"""Issue 13's acceptance, on the running daemon over a simulated dgx-h100: /metrics parses with
prometheus_client's parser and has 8 series for each default DCGM name (16 with two MIG devices on every
GPU, where dcgm-exporter has them per GPU instance); the periodic checks are named in /readyz?verbose;
`gpu-agent status` shows per-GPU health, the last XID and its meaning, and when the GPU will recover."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import cli
from gpu_agent.metrics.dcgm import DEFAULT_COUNTERS, XID_ERRORS

pytestmark = pytest.mark.subprocess

FAST = {"metrics": {"sample_interval_seconds": 0.5}, "health": {"check_interval_seconds": 0.5}}
# What NVML does not report for a GPU in MIG mode (whole-GPU utilisations), and the reserved framebuffer,
# which a MIG device's memory info (v1) does not give: left out, not made up.
NOT_ON_MIG = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_RESERVED"}


def series_counts(body: str) -> dict[str, int]:
    return {family.name: len(family.samples) for family in text_string_to_metric_families(body)
            if family.name.startswith("DCGM_")}


def every_default_name(counts: dict[str, int], wanted: int, left_out: frozenset[str] = frozenset()) -> bool:
    return all(counts.get(counter.name) == wanted for counter in DEFAULT_COUNTERS + (XID_ERRORS,)
               if counter.name not in left_out)


def test_dgx_h100_has_8_series_per_default_name_named_checks_and_a_status_table(agent, root: Path) -> None:
    daemon = agent("dgx-h100", settings={**FAST, "health": {**FAST["health"], "recover_after_seconds": 600}})
    daemon.wait_ready()
    # two samples: NVLink bandwidth and the GPM (PROF) series are over an interval
    _, body = daemon.wait_http("/metrics", lambda _, text: every_default_name(series_counts(text), 8))
    assert set(series_counts(body)) == {c.name for c in DEFAULT_COUNTERS + (XID_ERRORS,)}

    _, verbose = daemon.wait_http("/readyz?verbose", lambda status, text: "[+]temperature ok" in text)
    for check in ("gpu-health", "nvml-responsive", "row-remap-pending", "row-remap-failure", "temperature"):
        assert f"[+]{check} ok" in verbose
    assert cli("sim", "set", "--gpu", "5", "--temperature", "95", root=root).returncode == 0
    _, verbose = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert "[-]temperature failed: GPU 5 (" in verbose and "95 C, at or above its slowdown threshold of 89 C" in verbose

    assert cli("sim", "inject-xid", "--gpu", "2", "--xid", "48", root=root).returncode == 0
    daemon.wait_http("/status", lambda _, text: json.loads(text)["gpus"][2]["health"] == "unhealthy")
    table = cli("status", root=root, config=daemon.config)
    assert table.returncode == 2, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("2 "))
    assert "unhealthy" in row and "48 (double-bit ECC error)" in row and " at 20" in row  # recovers at a date
    hot = next(line for line in table.stdout.splitlines() if line.startswith("5 "))
    assert "unhealthy" in hot and "when its checks pass" in hot
    assert "GPU 2 unhealthy: XID 48 (double-bit ECC error)" in table.stdout
    assert "GPU 5 unhealthy: temperature: 95 C" in table.stdout


def test_two_mig_devices_on_every_gpu_give_16_series_per_default_name(agent, root: Path, tmp_path: Path) -> None:
    machine = tmp_path / "dgx-h100-mig.yaml"
    machine.write_text("name: dgx-h100-mig\ngpus:\n  - model: H100-80GB-HBM3\n    count: 8\n"
                       "    mig: {enabled: true, devices: [3g.40gb, 3g.40gb]}\nnvswitches: 4\nnvlinks: 18\n")
    daemon = agent(str(machine), settings=FAST)
    daemon.wait_ready()
    _, body = daemon.wait_http("/metrics", lambda _, text: every_default_name(
        series_counts(text), 16, frozenset(NOT_ON_MIG)))
    counts = series_counts(body)
    assert not NOT_ON_MIG & set(counts)
    families = {family.name: family for family in text_string_to_metric_families(body)}
    assert all("GPU_I_ID" in sample.labels for sample in families["DCGM_FI_PROF_GR_ENGINE_ACTIVE"].samples)

    status = json.loads(daemon.get("/status")[1])
    first, second = status["gpus"][4]["mig"]["instances"]
    assert cli("sim", "inject-xid", "--gpu", "4", "--xid", "48", "--gpu-instance", str(second["gpu_instance_id"]),
               root=root).returncode == 0
    _, verbose = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert f"GPU 4 MIG device 3g.40gb (GI {second['gpu_instance_id']}, CI 0, {second['uuid']}): XID 48" in verbose
    status = json.loads(daemon.get("/status")[1])
    first, second = status["gpus"][4]["mig"]["instances"]
    assert (first["health"], second["health"], status["gpus"][4]["health"]) == ("healthy", "unhealthy", "healthy")
    table = cli("status", root=root, config=daemon.config).stdout
    assert f"GPU 4 MIG device {second['uuid']} unhealthy: XID 48 (double-bit ECC error)" in table
