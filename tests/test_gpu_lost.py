"""One GPU off the bus, or whose NVML queries fail, is a fact about that GPU (issue 33): discovery, the node's
labels, /metrics (its XID series too), the CDI spec, the device plugin and readiness go on serving the others.

In-process, on simulated nodes, with the daemon's composition root kept across passes as the daemon keeps it
(the inventory remembers its last reading): each step is what the daemon does on the event (an XID has the GPUs
sampled, a GPU that stops answering or answers again has a pass run). Until this, XID 79 on GPU 3 of a DGX H100
failed discovery as a whole ("nvmlDeviceGetHandleByIndex: GPU is lost"): no GPU in /status, gpu_agent_gpus 0,
no DCGM series (no XID 79 either), CDI waiting for discovery, the node unready under unready_when: all."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml

from gpu_agent.cli.status import print_table
from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.health.xid import XidWatcher
from gpu_agent.host.driver_gpus import DriverGpu
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import node_labels
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.model import Gpu, GpuHealth, Inventory, MigState
from gpu_agent.nvml.unreadable import Unread, stand_ins
from gpu_agent.plugin.devices import GPU_RESOURCE
from gpu_agent.plugin.server import device_list
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.state import AgentState
from harness import SimNode

CDI_SPEC = "var/run/cdi/nvidia.yaml"
_SAMPLE = re.compile(r'^(?P<name>\w+)\{(?P<labels>.*)\} (?P<value>\S+)$')


class Node:
    """A simulated node's daemon, minus its event loop: one Runtime for every pass, its sampler and XID watcher
    over the same state, and a Podman that reads the CDI spec (so the agent writes one)."""

    def __init__(self, tmp_path: Path, profile: str, settings: Optional[dict[str, Any]] = None) -> None:
        self.sim_node = SimNode(tmp_path / "root", profile)
        self.root = self.sim_node.root
        for binary in ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-cdi-hook"):
            (self.root / "usr/bin").mkdir(parents=True, exist_ok=True)
            (self.root / "usr/bin" / binary).write_text("#!/bin/sh\n")
        self.sim("install-runtime", "podman", "5.4.2")
        self.profile = profile
        self.config = tmp_path / "config.yaml"
        self.config.write_text(yaml.safe_dump({"version": "v1", "plugin": {"enabled": True},
                                               **(settings or {"health": {"unready_when": "all"}})}))

    def start(self) -> Node:
        """The daemon starts: its first pass, its first sample, the XID events registered."""
        self.runtime = Runtime.build(Root(self.root), load_config(self.config, required=True), self.profile)
        self.state: AgentState = self.runtime.state
        self.nvml = self.runtime.nvml
        self.sampler = Sampler(self.nvml, self.state, self.runtime.root)
        self.watcher = XidWatcher(self.nvml, self.state, lambda: None)
        self.runs = self.reconcile()
        self.state.first_reconcile_done = True
        self.sampler.sample()
        self.events = self.nvml.events.watch_xids()
        return self

    def sim(self, *argv: str) -> None:
        self.sim_node.sim(*argv)

    def reconcile(self) -> dict[str, Any]:
        runs = asyncio.run(self.runtime.engine.reconcile(force=True))
        return {run.stage: run for run in runs}

    def xid(self, gpu: int, xid: int) -> dict[str, Any]:
        """`sim inject-xid`: the event as NVML delivers it, recorded; the GPUs sampled; a pass."""
        self.sim("inject-xid", "--gpu", str(gpu), "--xid", str(xid))
        event = self.events(2000)
        assert event is not None and event.xid == xid
        self.watcher.record(event)
        return self.sample_and_reconcile()

    def fail(self, call: str, gpu: int, error: str) -> dict[str, Any]:
        self.sim("fail", call, "--gpu", str(gpu), "--error", error)
        return self.sample_and_reconcile()

    def sample_and_reconcile(self) -> dict[str, Any]:
        self.sampler.sample()
        self.runs = self.reconcile()
        return self.runs

    def status(self) -> dict[str, Any]:
        return self.state.to_json()

    def metrics(self) -> str:
        return render(make_registry(AgentCollector(self.state, lambda: 0, "node-1"))).decode()

    def plugin(self) -> dict[str, str]:
        """The nvidia.com/gpu devices as ListAndWatch sends them: health by device id."""
        resource = DevicePluginManager(self.runtime.root, self.state).compute().resources[GPU_RESOURCE]
        return {device.ID: device.health for device in device_list(resource).devices}

    def labels(self) -> dict[str, str]:
        labels = node_labels(self.state.config.config, self.state.inventory, self.state.ready, self.state.machine)
        return {key: value for key, value in labels.items() if key != "nvidia.com/gfd.timestamp"}

    def cdi(self) -> dict[str, Any]:
        return yaml.safe_load((self.root / CDI_SPEC).read_text())

    def uuid(self, gpu: int) -> str:
        return str(self.sim_node.machine.read()["gpus"][gpu]["uuid"])

    def close(self) -> None:
        self.nvml.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def build(profile: str, settings: Optional[dict[str, Any]] = None, start: bool = True) -> Node:
        node = Node(tmp_path / f"node{len(made)}", profile, settings)
        made.append(node)
        return node.start() if start else node

    yield build
    for node in made:
        if hasattr(node, "nvml"):
            node.close()


def series(metrics: str, name: str) -> dict[str, tuple[dict[str, str], float]]:
    """The samples of one family, by their gpu label: (labels, value)."""
    found = {}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            found[labels.get("gpu", "")] = (labels, float(match["value"]))
    return found


def gauge(metrics: str, name: str) -> float:
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


def assert_the_others_served(node: Node, sick: int, before: dict[str, Any]) -> None:
    """Every GPU in /status and the plugin, the sick one alone unhealthy; the others' metrics, devices and
    labels as before; the CDI spec unchanged."""
    count = len(node.sim_node.machine.read()["gpus"])
    others = [str(i) for i in range(count) if i != sick]
    assert node.runs["discovery"].state == "ok", node.runs["discovery"].message
    assert node.runs["cdi"].state == "ok", node.runs["cdi"].message
    gpus = node.status()["gpus"]
    assert [gpu["index"] for gpu in gpus] == list(range(count))
    assert [gpu["health"] for gpu in gpus] == ["unhealthy" if i == sick else "healthy" for i in range(count)]
    metrics = node.metrics()
    assert gauge(metrics, "gpu_agent_gpus") == count
    assert set(series(metrics, "DCGM_FI_DEV_POWER_USAGE")) >= set(others)  # the others' series stay
    healthy = series(metrics, "gpu_agent_gpu_healthy")
    assert {gpu: value for gpu, (_, value) in healthy.items()} == {str(i): float(i != sick) for i in range(count)}
    devices = node.plugin()
    assert devices == {node.uuid(i): "Unhealthy" if i == sick else "Healthy" for i in range(count)}
    assert node.labels() == {**before["labels"], "nvidia.com/gpu-agent.ready": str(node.state.ready).lower()}
    assert node.cdi() == before["cdi"]


def snapshot(node: Node) -> dict[str, Any]:
    assert node.state.ready and all(run.state == "ok" for run in node.runs.values())
    return {"labels": node.labels(), "cdi": node.cdi()}


@pytest.mark.parametrize("profile, sick, xid", [
    ("dgx-h100", 3, 79),  # the example
    ("dgx-a100", 5, 79),
    ("dgx-h100", 3, 48),  # on the bus: unhealthy by the XID alone
    ("dgx-a100", 2, 94),
])
def test_an_xid_on_one_gpu_leaves_the_others_served(make: Any, profile: str, sick: int, xid: int) -> None:
    node = make(profile)
    before = snapshot(node)
    node.xid(sick, xid)

    assert_the_others_served(node, sick, before)
    assert node.state.ready, node.state.summary_line()  # unready_when: all, seven healthy GPUs
    health = next(check for check in node.state.checks() if check.name == "gpu-health")
    assert health.ok and health.reason.startswith("1 of 8 GPUs failing, not all")
    xids = series(node.metrics(), "DCGM_FI_DEV_XID_ERRORS")
    assert xids[str(sick)][1] == xid and xids[str(sick)][0]["err_code"] == str(xid)
    assert all(value == 0 for gpu, (_, value) in xids.items() if gpu != str(sick)) and len(xids) == 8
    gpu = node.status()["gpus"][sick]
    assert gpu["last_xid"]["xid"] == xid and gpu["uuid"] == node.uuid(sick)
    if xid == 79:  # off the bus: what is known of it, not a reading; no metric of it but its XID
        assert gpu["unreadable"] == "nvmlDeviceGetHandleByIndex: GPU is lost" and gpu["known_from"] == "last reading"
        assert gpu["lost"] and gpu["mig"] is not None and gpu["memory_mib"] > 0
        assert str(sick) not in series(node.metrics(), "DCGM_FI_DEV_POWER_USAGE")
        assert "GPU is lost" in node.runs["discovery"].message


def test_the_same_on_a_single_gpu_node_makes_it_unready_even_with_unready_when_all(make: Any) -> None:
    """An A30 on PCIe, its one GPU lost: every GPU is failing, so the node is unready; the rest holds."""
    node = make("a30")
    before = snapshot(node)
    node.xid(0, 79)
    assert_the_others_served(node, 0, before)
    ready, failing = node.state.readiness()
    assert not ready and failing is not None and failing.name == "gpu-health" and "XID 79" in failing.reason
    assert series(node.metrics(), "DCGM_FI_DEV_XID_ERRORS")["0"][1] == 79


def test_unready_when_any_names_the_lost_gpu_and_still_serves_the_others(make: Any) -> None:
    node = make("dgx-h100", {"health": {"unready_when": "any"}})
    before = snapshot(node)
    node.xid(3, 79)
    assert_the_others_served(node, 3, before)
    ready, failing = node.state.readiness()
    assert not ready and failing is not None and failing.name == "gpu-health"
    assert failing.reason.startswith(f"GPU 3 ({node.uuid(3)}): XID 79 (GPU has fallen off the bus)")


@pytest.mark.parametrize("call, error", [
    ("nvmlDeviceGetHandleByIndex", "Unknown"),
    ("nvmlDeviceGetHandleByIndex", "GpuIsLost"),
    ("nvmlDeviceGetMemoryInfo", "Timeout"),
    ("nvmlDeviceGetMemoryInfo", "NotSupported"),
    ("nvmlDeviceGetMigMode", "Unknown"),
])
def test_a_gpu_whose_nvml_queries_fail_is_that_gpus_fact(make: Any, call: str, error: str) -> None:
    """`sim fail CALL --gpu 2`: no XID, GPU 2's queries fail; it is unhealthy for that, the rest is served."""
    node = make("dgx-h100")
    before = snapshot(node)
    node.fail(call, 2, error)
    assert_the_others_served(node, 2, before)
    gpu = node.status()["gpus"][2]
    assert gpu["unreadable"].startswith(f"{call}: ") and gpu["known_from"] == "last reading"
    assert gpu["health_reason"].startswith("NVML ") and not gpu["lost"]
    assert node.state.ready

    node.sim("clear")
    node.sample_and_reconcile()
    assert node.status()["gpus"][2]["unreadable"] is None and node.state.ready
    assert set(node.plugin().values()) == {"Healthy"}


def test_back_on_the_bus_it_is_back_everywhere(make: Any) -> None:
    node = make("dgx-h100")
    before = snapshot(node)
    node.xid(3, 79)
    assert str(3) not in series(node.metrics(), "DCGM_FI_DEV_POWER_USAGE")

    node.sim("clear")  # as a reset does: back at its bus id
    node.sample_and_reconcile()
    assert all(run.state == "ok" for run in node.runs.values())
    gpu = node.status()["gpus"][3]
    assert gpu["health"] == "healthy" and gpu["unreadable"] is None and gpu["known_from"] == "nvml"
    assert not gpu["lost"] and gpu["xid_counts"] == {"79": 1}
    metrics = node.metrics()
    assert set(series(metrics, "DCGM_FI_DEV_POWER_USAGE")) == {str(i) for i in range(8)}
    assert series(metrics, "DCGM_FI_DEV_XID_ERRORS")["3"][1] == 79  # the last XID it had, as dcgm-exporter's
    assert set(node.plugin().values()) == {"Healthy"}
    assert node.labels() == before["labels"] and node.cdi() == before["cdi"]
    assert node.nvml.inventory.read().readable == node.state.inventory.gpus  # read whole again


def test_a_gpu_already_lost_when_the_agent_starts_is_known_from_the_driver(make: Any) -> None:
    """No earlier reading: what the driver's /proc/driver/nvidia/gpus says of it (its UUID, bus id, model and
    device minor) names it, so the plugin lists it Unhealthy, the CDI spec keeps its device and the labels
    count it; the XID events of the others are watched."""
    node = make("dgx-h100", start=False)
    node.sim("inject-xid", "--gpu", "3", "--xid", "79")
    node.start()
    assert node.runs["discovery"].state == "ok" and node.runs["cdi"].state == "ok"
    gpu = node.status()["gpus"][3]
    machine = node.sim_node.machine.read()["gpus"][3]
    assert gpu["known_from"] == "identity only" and gpu["uuid"] == machine["uuid"]
    assert (gpu["pci_bus_id"], gpu["product"]) == ("0000:5d:00.0", "NVIDIA H100 80GB HBM3")
    assert gpu["mig"] is None and gpu["memory_mib"] is None and gpu["compute_capability"] is None
    assert gpu["health"] == "unhealthy"
    assert node.state.ready  # unready_when: all
    assert node.plugin()[machine["uuid"]] == "Unhealthy" and list(node.plugin().values()).count("Healthy") == 7
    assert node.labels()["nvidia.com/gpu.count"] == "8"
    assert node.labels()["nvidia.com/gpu.memory"] == "81559"  # the others describe the node
    assert {"3", machine["uuid"]} <= {device["name"] for device in node.cdi()["devices"]}

    node.sim("inject-xid", "--gpu", "5", "--xid", "48")
    event = node.events(2000)
    assert event is not None and (event.gpu_uuid, event.xid) == (node.uuid(5), 48)

    # Back on the bus: read whole, and its own XIDs watched once the watcher registers it (it could not before)
    node.watcher.start()
    try:
        node.sim("clear")
        node.sample_and_reconcile()
        assert node.status()["gpus"][3]["known_from"] == "nvml" and node.state.health[node.uuid(3)].healthy
        deadline = time.monotonic() + 10
        while (node.state.health.get(node.uuid(3)) or GpuHealth()).last_xid != 13:
            assert time.monotonic() < deadline, "XID 13 on GPU 3 never reached the watcher"
            node.sim("inject-xid", "--gpu", "3", "--xid", "13")  # again, until the watcher has registered it
            time.sleep(0.2)
    finally:
        node.watcher.stop()


def test_the_daemon_reads_a_gpu_that_stops_answering_or_answers_again_without_waiting_for_the_interval(
        make: Any) -> None:
    """What a sample finds (a GPU whose queries start or stop failing) has discovery run now, not at the next
    reconcile.interval_seconds: a pass when it stops (the outputs mark it), a forced one when it answers
    again (the stages that failed on it try again at once). The readiness does not change here
    (unready_when: all), so only that asks for the passes."""
    from gpu_agent.daemon import app

    node = make("dgx-h100", {"health": {"unready_when": "all"}, "plugin": {"enabled": False}}, start=False)
    runtime = Runtime.build(Root(node.root), load_config(node.config, required=True), "dgx-h100")

    async def scenario() -> None:
        daemon = app.Daemon(runtime, node.config, config_required=True)
        await runtime.engine.reconcile(force=True)
        runtime.state.first_reconcile_done = True
        await daemon._sample()
        daemon._wake.clear()
        node.sim("fail", "nvmlDeviceGetHandleByIndex", "--gpu", "2", "--error", "Unknown")
        await daemon._sample()
        assert daemon._wake.is_set() and not daemon._force
        daemon._wake.clear()
        await daemon._sample()  # still failing: nothing new
        assert not daemon._wake.is_set()
        node.sim("clear")
        await daemon._sample()
        assert daemon._wake.is_set() and daemon._force

    try:
        asyncio.run(scenario())
    finally:
        runtime.nvml.close()


# --- what is known of a GPU NVML cannot read: the rules, one by one ------------------------------------


def _gpu(index: int, bus: str) -> Gpu:
    return Gpu(index, f"GPU-0000000{index}-0000-0000-0000-000000000000", bus, "NVIDIA H100 80GB HBM3", 81559, (9, 0),
               index, MigState(True))


def _driver(index: int, bus: str, excluded: bool = False) -> DriverGpu:
    return DriverGpu(bus, f"GPU-0000000{index}-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", index, excluded)


BUSES = ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0")


def test_the_last_reading_is_kept_only_while_nothing_says_the_index_names_another_gpu() -> None:
    read = {0: _gpu(0, BUSES[0]), 2: _gpu(2, BUSES[2])}
    last = {1: _gpu(1, BUSES[1])}
    records, unnamed = stand_ins([Unread(1, "lost")], read, last, [], None)
    assert records[0].known_from == "last reading" and records[0].uuid == last[1].uuid and not unnamed
    # NVML answers another bus id for index 1: another GPU; nothing else names it
    records, unnamed = stand_ins([Unread(1, "lost", bus_id="0000:9a:00.0")], read, last, [], None)
    assert not records and unnamed[0].index == 1 and unnamed[0].reason == "lost"
    # its bus id is a GPU read now at another index (the indexes moved)
    moved = {0: _gpu(0, BUSES[1]), 2: _gpu(2, BUSES[2])}
    assert stand_ins([Unread(1, "lost")], moved, last, [], None)[0] == []


def test_the_driver_names_it_by_position_only_where_the_read_gpus_sit_at_theirs() -> None:
    read = {0: _gpu(0, BUSES[0]), 2: _gpu(2, BUSES[2])}
    driver = [_driver(i, bus) for i, bus in enumerate(BUSES)]
    records, _ = stand_ins([Unread(1, "lost")], read, {}, driver, None)
    assert records[0].pci_bus_id == BUSES[1] and records[0].known_from == "identity only"
    assert records[0].minor_number == 1 and not records[0].details_known
    # an excluded GPU is not counted by NVML: the positions are those of the others
    excluded = [_driver(9, "0000:07:00.0", excluded=True)] + driver
    assert stand_ins([Unread(1, "lost")], read, {}, excluded, None)[0][0].pci_bus_id == BUSES[1]
    # a read GPU not at its position: the order cannot be trusted
    swapped = [driver[2], driver[1], driver[0]]
    assert stand_ins([Unread(1, "lost")], read, {}, swapped, None)[0] == []
    # but the bus id or UUID NVML still answers finds it, wherever it is
    assert stand_ins([Unread(1, "lost", bus_id=BUSES[1])], read, {}, swapped, None)[0][0].index == 1


def test_a_gpu_nothing_names_is_counted_failing_and_shown(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_agent.config.loader import LoadedConfig, parse_config
    from gpu_agent.nvml.model import UnidentifiedGpu
    from gpu_agent.state import OK, StageStatus

    inventory = Inventory("550.90.07", "12.4", (_gpu(0, BUSES[0]), _gpu(2, BUSES[2])),
                          unidentified=(UnidentifiedGpu(1, "nvmlDeviceGetHandleByIndex: GPU is lost"),))
    for when, ready in (("any", False), ("all", True)):
        config = LoadedConfig(parse_config(f"version: v1\nhealth: {{unready_when: {when}}}\n", "c"), "c", "d")
        state = AgentState(config, inventory=inventory, first_reconcile_done=True)
        state.stages["discovery"] = StageStatus("discovery", OK, "ok")
        check = next(check for check in state.checks() if check.name == "gpu-health")
        assert state.ready is ready and "GPU 1: NVML cannot read it: nvmlDeviceGetHandleByIndex: GPU is lost" in \
            check.reason and ("1 of 3 GPUs failing" in check.reason) is ready
    status = state.to_json()
    assert [gpu["index"] for gpu in status["gpus"]] == [0, 1, 2]
    assert status["gpus"][1]["uuid"] is None and status["gpus"][1]["health"] == "unhealthy"
    print_table(status)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("1 "))
    assert row.split()[:6] == ["1", "?", "?", "?", "?", "?"] and "unhealthy" in row


def test_the_driver_stage_notes_a_gpu_nvml_cannot_answer_for_and_fails_only_when_none_answers(
        tmp_path: Path) -> None:
    """Any NVML error on one GPU's bus id is that GPU's (it was GPU_IS_LOST alone, another error failed the
    driver stage); the same error on every GPU, none of them lost, is the driver's."""
    node = SimNode(tmp_path / "root", "dgx-h100")
    node.sim("fail", "nvmlDeviceGetPciInfo", "--gpu", "2", "--error", "Unknown")
    one = node.apply({"toolkit": {"enabled": False}})
    driver = one.stage("driver")
    assert driver.state == "ok" and "GPU 2 lost to NVML (nvmlDeviceGetPciInfo: Unknown Error" in driver.message
    assert one.stage("discovery").state == "ok"
    node.sim("clear")
    node.sim("fail", "nvmlDeviceGetPciInfo", "--error", "Unknown")
    every = node.apply({"toolkit": {"enabled": False}}).stage("driver")
    assert every.state == "failed" and "NVML fails" in every.message and "Unknown Error" in every.message
