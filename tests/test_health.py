"""GPU health that recovers: XIDs make a GPU unhealthy at once, time (or its return to the bus) heals it.

In-process, on a simulated machine, with a clock of the test's own: nothing sleeps."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpu_agent.config import load_config
from gpu_agent.health.xid import XidWatcher
from gpu_agent.host.paths import Root
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import XidEvent
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import OK, AgentState, StageStatus


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A simulated dgx-h100 with the agent's state, XID watcher (not started) and sampler over it."""

    def __init__(self, tmp_path: Path, health: str) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(f"version: v1\nhealth: {health}\n")
        self.machine = MachineState(Root(tmp_path))
        self.machine.ensure("dgx-h100")
        SimModprobe(self.machine, Root(tmp_path)).load("nvidia")
        self.nvml = Nvml(FakeNvml(self.machine), call_timeout=2.0)
        self.state = AgentState(load_config(config, required=True))
        self.state.inventory = self.nvml.inventory.read()
        self.state.stages["discovery"] = StageStatus("discovery", OK, "8 GPUs found")
        self.state.first_reconcile_done = True
        self.clock = Clock()
        self.changes = 0
        self.watcher = XidWatcher(self.nvml, self.state, self._changed, clock=self.clock)
        self.sampler = Sampler(self.nvml, self.state, Root(tmp_path))

    def _changed(self) -> None:
        self.changes += 1

    def xid(self, gpu: int, xid: int) -> None:
        self.watcher.record(XidEvent(self.state.inventory.gpus[gpu].uuid, xid, self.clock.now))

    def later(self, seconds: float) -> None:
        self.clock.now += seconds
        self.watcher.recover()

    def gpu_json(self, gpu: int) -> dict[str, Any]:
        return self.state.to_json()["gpus"][gpu]

    def fail(self, call: str, gpu: int, error: str) -> None:
        with self.machine.edit() as doc:
            doc["faults"].append({"id": len(doc["faults"]) + 1, "call": call, "gpu": gpu, "times": None,
                                  "error": error})

    def clear_faults(self) -> None:
        with self.machine.edit() as doc:
            doc["faults"].clear()

    def transitions(self) -> dict[str, float]:
        text = render(make_registry(AgentCollector(self.state, lambda: 0, "node-1"))).decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("gpu_agent_gpu_health_transitions_total{")}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(health: str = "{recover_after_seconds: 300}") -> Node:
        made.append(Node(tmp_path, health))
        return made[-1]

    yield make
    for n in made:
        n.clear_faults()
        n.nvml.close()


def test_a_critical_xid_makes_the_gpu_unhealthy_at_once_and_recovers_after_the_quiet_period(node, caplog) -> None:
    n = node()
    caplog.set_level(logging.INFO)
    n.xid(3, 48)
    ready, failing = n.state.readiness()
    assert not ready and failing is not None and failing.name == "gpu-health"
    assert "GPU 3 (" in failing.reason and "XID 48 (double-bit ECC error)" in failing.reason
    doc = n.gpu_json(3)
    assert doc["health"] == "unhealthy" and doc["last_xid"] == {"xid": 48, "meaning": "double-bit ECC error"}
    assert doc["recovers_at"] == n.clock.now + 300 and doc["lost"] is False

    n.later(299)
    assert not n.state.ready
    n.xid(3, 48)  # a new critical event starts the quiet period again
    assert n.gpu_json(3)["recovers_at"] == n.clock.now + 300
    n.later(299)
    assert not n.state.ready
    n.later(1)
    assert n.state.ready and n.gpu_json(3)["health"] == "healthy" and n.gpu_json(3)["recovers_at"] is None
    assert n.gpu_json(3)["last_xid"]["xid"] == 48 and n.gpu_json(3)["xid_counts"] == {"48": 2}

    uuid = n.state.inventory.gpus[3].uuid
    assert n.transitions() == {
        f'gpu_agent_gpu_health_transitions_total{{UUID="{uuid}",gpu="3",to="unhealthy"}}': 1.0,
        f'gpu_agent_gpu_health_transitions_total{{UUID="{uuid}",gpu="3",to="healthy"}}': 1.0,
    }
    logged = [r.getMessage() for r in caplog.records if r.name == "gpu_agent.health.xid"]
    assert sum("unhealthy: XID 48" in m for m in logged) == 1
    assert sum("still unhealthy" in m for m in logged) == 1
    assert sum("healthy again" in m for m in logged if "unhealthy" not in m) == 1
    said = len(caplog.records)
    n.later(1000)
    assert len(caplog.records) == said and n.changes == 3  # two events, one recovery: nothing more to say


def test_ignored_xids_count_but_do_not_change_health(node) -> None:
    n = node()
    n.xid(2, 13)
    n.xid(2, 31)
    assert n.state.ready and n.gpu_json(2)["xid_counts"] == {"13": 1, "31": 1}
    assert n.gpu_json(2)["last_xid"] == {"xid": 31, "meaning": "GPU memory page fault"}
    assert n.transitions() == {}


def test_extra_critical_xids_win_over_ignored_ones(node) -> None:
    n = node("{ignored_xids: [13, 31, 48], extra_critical_xids: [31]}")
    n.xid(0, 48)
    assert n.state.ready
    n.xid(0, 31)
    assert not n.state.ready and "XID 31 (GPU memory page fault)" in n.state.summary_line()


def test_all_in_either_list_covers_every_xid(node) -> None:
    """DP_DISABLE_HEALTHCHECKS=all with DP_ENABLE_HEALTHCHECKS=48, and DP_ENABLE_HEALTHCHECKS=all."""
    quiet = node("{ignored_xids: all, extra_critical_xids: [48]}")
    quiet.xid(0, 74)
    quiet.xid(1, 94)
    assert quiet.state.ready and quiet.transitions() == {}
    quiet.xid(2, 48)
    assert not quiet.state.ready and "XID 48" in quiet.state.summary_line()
    strict = node("{extra_critical_xids: all}")
    strict.xid(0, 13)
    assert not strict.state.ready and "XID 13 (graphics engine exception)" in strict.state.summary_line()


def test_recovery_follows_the_configured_quiet_period(node) -> None:
    n = node("{recover_after_seconds: 5}")
    n.xid(1, 94)
    n.later(4.9)
    assert not n.state.ready
    n.later(0.1)
    assert n.state.ready and n.changes == 2  # the event, then the recovery: each published


def test_a_gpu_off_the_bus_does_not_recover_with_time(node) -> None:
    n = node("{recover_after_seconds: 5}")
    n.xid(3, 79)
    doc = n.gpu_json(3)
    assert doc["lost"] is True and doc["recovers_at"] is None
    n.later(86400)
    n.sampler.sample()  # it still answers: NVML never lost it, so it never came back either
    assert not n.state.ready and "XID 79 (GPU has fallen off the bus)" in n.state.summary_line()
    for _ in range(3):
        n.xid(3, 48)  # a later XID does not make a lost GPU recover with time
    n.later(86400)
    reason = n.gpu_json(3)["health_reason"]
    assert not n.state.ready and reason.startswith("XID 79") and reason.count("XID 48") == 1


def test_a_lost_gpu_is_healthy_once_nvml_answers_for_it_again_at_its_bus_id(node) -> None:
    n = node()
    n.xid(3, 79)
    n.fail("nvmlDeviceGetUtilizationRates", 3, "GpuIsLost")
    n.sampler.sample()
    assert not n.state.ready
    assert "NVML query failed" in n.state.summary_line() and "XID 79" in n.state.summary_line()
    n.clear_faults()
    n.sampler.sample()
    assert n.state.ready and n.gpu_json(3)["lost"] is False
    uuid = n.state.inventory.gpus[3].uuid
    assert n.transitions()[f'gpu_agent_gpu_health_transitions_total{{UUID="{uuid}",gpu="3",to="healthy"}}'] == 1


def test_a_lost_gpu_answering_at_another_bus_id_stays_unhealthy(node, caplog) -> None:
    n = node()
    n.xid(3, 79)
    n.fail("nvmlDeviceGetUtilizationRates", 3, "GpuIsLost")
    n.sampler.sample()
    n.clear_faults()
    with n.machine.edit() as doc:
        doc["gpus"][3]["pci_bus_id"] = "00000000:E1:00.0"
    n.sampler.sample()
    n.sampler.sample()
    assert not n.state.ready and n.gpu_json(3)["lost"] is True
    said = [r.getMessage() for r in caplog.records if "answers NVML again but at 0000:e1:00.0" in r.getMessage()]
    assert len(said) == 1


def test_status_command_shows_health_last_xid_and_when_it_recovers(node, capsys) -> None:
    from gpu_agent.cli.status import print_table

    n = node()
    n.xid(1, 48)
    n.xid(3, 79)
    n.xid(5, 13)
    print_table(n.state.to_json())
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("GPU "))
    assert header.split() == ["GPU", "UUID", "PCI", "PRODUCT", "MEMORY", "MIG", "MODE", "DRIVER", "HEALTH", "LAST",
                              "XID", "RECOVERS"]
    row = {line.split()[0]: line for line in lines if line[:1].isdigit()}
    due = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(n.clock.now + 300))
    assert "unhealthy" in row["1"] and "48 (double-bit ECC error)" in row["1"] and f"at {due}" in row["1"]
    assert "79 (GPU has fallen off the bus)" in row["3"] and "when NVML sees it again at 0000:" in row["3"]
    assert " healthy " in row["5"] and "13 (graphics engine exception)" in row["5"] and row["5"].endswith("-")
    assert any(line.startswith("GPU 3 unhealthy: XID 79 (GPU has fallen off the bus)") for line in lines)
