"""No stage blinds the others: a failing driver stage makes the node unready, naming the stage, while
every GPU NVML sees is still in /status and /metrics (in-process, through the composition root)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import SimModprobe


def test_a_failing_driver_stage_hides_no_gpu(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\ndriver:\n  version: '1.2.3'\ntoolkit:\n  enabled: false\n")
    runtime = Runtime.build(Root(tmp_path / "root"), load_config(config, required=True), "dgx-h100")
    try:
        machine = runtime.nvml.lib.machine
        for module in ("nvidia", "nvidia_uvm"):
            SimModprobe(machine, runtime.root).load(module)
        runtime.state.first_reconcile_done = True
        asyncio.run(runtime.engine.reconcile(force=True))
        document = runtime.state.to_json()
        stages = {stage["name"]: stage for stage in document["stages"]}
        assert stages["driver"]["state"] == "failed"
        assert "driver version pin (driver.version) is 1.2.3" in stages["driver"]["message"]
        assert stages["discovery"]["state"] == "ok"
        ready, failing = runtime.state.readiness()
        assert not ready and failing is not None and failing.name == "driver"
        assert len(document["gpus"]) == 8 and document["driver"]["version"] == "550.90.07"
        metrics = render(make_registry(AgentCollector(runtime.state, lambda: 0, "node-1"))).decode()
        families = {family.name: family for family in text_string_to_metric_families(metrics)}
        assert families["gpu_agent_gpus"].samples[0].value == 8
        assert families["gpu_agent_ready"].samples[0].value == 0
    finally:
        runtime.nvml.close()
