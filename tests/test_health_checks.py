"""The periodic GPU checks, health.unready_when, per-MIG-device XIDs and recovery at a GPU reset.

In-process, on a simulated dgx-h100 (the Node of test_health.py), with the test's own clock."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_health import Node

from gpu_agent.health.checks import HealthChecks, judge
from gpu_agent.health.reset import ResetHealsGpu
from gpu_agent.nvml.model import HealthReading, XidEvent
from gpu_agent.sim.mig import SimGpuReset


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(health: str = "{recover_after_seconds: 300}") -> Node:
        made.append(Node(tmp_path, health))
        return made[-1]

    yield make
    for n in made:
        n.clear_faults()
        n.nvml.close()


def checks(n: Node) -> HealthChecks:
    return HealthChecks(n.nvml, n.state, clock=n.clock)


def sim_set(n: Node, gpu: int, **values: Any) -> None:
    with n.machine.edit() as doc:
        doc["gpus"][gpu].update(values)


def verbose(n: Node) -> dict[str, tuple[bool, str]]:
    return {check.name: (check.ok, check.reason) for check in n.state.checks()}


def test_each_periodic_check_is_named_and_a_gpu_failing_one_is_unhealthy_until_it_passes(node) -> None:
    n = node()
    run = checks(n)
    assert "temperature" not in verbose(n)  # not run yet: not shown as passing
    run.run()
    shown = verbose(n)
    for name in ("nvml-responsive", "row-remap-pending", "row-remap-failure", "temperature"):
        assert shown[name][0], shown[name]
    assert n.state.ready

    sim_set(n, 2, temperature_c=89)  # the H100's slowdown threshold, as the real one reports it
    sim_set(n, 5, remapped_rows={"pending": 3, "failure": 1})
    run.run()
    shown = verbose(n)
    assert not shown["temperature"][0] and "GPU 2 (" in shown["temperature"][1]
    assert "89 C, at or above its slowdown threshold of 89 C" in shown["temperature"][1]
    assert not shown["row-remap-pending"][0] and "GPU 5 (" in shown["row-remap-pending"][1]
    assert "row remapping pending" in shown["row-remap-pending"][1]
    assert not shown["row-remap-failure"][0] and "GPU 5 (" in shown["row-remap-failure"][1]
    assert shown["nvml-responsive"][0]
    assert not n.state.ready
    assert n.gpu_json(2)["health"] == "unhealthy" and "temperature: 89 C" in n.gpu_json(2)["health_reason"]
    assert n.gpu_json(5)["health"] == "unhealthy" and n.gpu_json(4)["health"] == "healthy"

    sim_set(n, 2, temperature_c=88)
    sim_set(n, 5, remapped_rows={})
    run.run()
    assert n.state.ready and n.gpu_json(2)["health"] == "healthy" and n.gpu_json(5)["health"] == "healthy"
    uuid = n.state.inventory.gpus[2].uuid
    assert n.state.health_transitions[(uuid, "unhealthy")] == 1 and n.state.health_transitions[(uuid, "healthy")] == 1


def test_a_hung_nvml_call_fails_nvml_responsive_after_its_timeout_and_passes_once_it_returns(node) -> None:
    n = node()
    n.nvml.session.call_timeout = 0.2
    run = checks(n)
    run.run()
    n.fail("nvmlDeviceGetRemappedRows", 0, "hang")
    run.run()  # returns: the stuck call is abandoned on its NVML worker thread
    ok, reason = verbose(n)["nvml-responsive"]
    assert not ok and "nvmlDeviceGetRemappedRows did not return within 0.2 s" in reason
    assert not n.state.ready
    n.clear_faults()
    for _ in range(100):  # until the abandoned call has returned (the fake polls its fault every 50 ms)
        run.run()
        if verbose(n)["nvml-responsive"][0]:
            break
        n.clock.now += 1
        time.sleep(0.05)
    assert verbose(n)["nvml-responsive"] == (True, "NVML answers within its timeout") and n.state.ready


def test_unready_when_all_keeps_the_node_ready_while_some_gpus_are_unhealthy(node) -> None:
    n = node("{unready_when: all}")
    run = checks(n)
    sim_set(n, 1, temperature_c=95)
    run.run()
    n.xid(3, 48)
    ready, failing = n.state.readiness()
    assert ready and failing is None
    ok, reason = verbose(n)["gpu-health"]
    assert ok and reason.startswith("2 of 8 GPUs failing, not all (health.unready_when: all)")
    assert n.gpu_json(1)["health"] == "unhealthy" and n.gpu_json(3)["health"] == "unhealthy"

    for gpu in range(8):
        sim_set(n, gpu, temperature_c=95)
    run.run()
    assert not n.state.ready and not verbose(n)["temperature"][0]


def test_page_retirement_stands_in_for_row_remapping_and_nothing_fails_on_what_is_not_reported() -> None:
    assert judge(HealthReading(pending_remaps=True, pending_kind="page retirement")) == {
        "row-remap-pending": "page retirement pending: takes effect at the next GPU reset; drain the node and "
                             "reset the GPU"}
    assert judge(HealthReading()) == {}
    assert judge(HealthReading(temperature_c=88, slowdown_c=89, pending_remaps=False, remap_failed=False)) == {}


def test_a_gpu_reset_brings_an_xid_unhealthy_gpu_back_at_once_and_a_lost_one_once_it_answers(node) -> None:
    n = node()
    reset = ResetHealsGpu(SimGpuReset(n.machine), n.state)
    gpus = n.state.inventory.gpus
    n.xid(3, 48)
    n.xid(4, 79)
    reset.reset(3, gpus[3].pci_bus_id)
    assert n.gpu_json(3)["health"] == "healthy" and n.gpu_json(3)["recovers_at"] is None
    reset.reset(4, gpus[4].pci_bus_id)
    assert n.gpu_json(4)["health"] == "unhealthy"  # lost: it has to answer at its bus id first
    n.sampler.sample()
    assert n.gpu_json(4)["health"] == "healthy" and n.state.ready


def mig_node(n: Node) -> list[Any]:
    """GPU 0 with two 3g.40gb GPU instances, each one MIG device."""
    assert n.nvml.mig.set_mode(0, True) is None
    for start in (0, 4):
        gi = n.nvml.mig.create_gpu_instance(0, 9, (start, 4))
        n.nvml.mig.create_compute_instance(0, gi, 3, 0)
    n.state.inventory = n.nvml.inventory.read()
    devices = list(n.state.inventory.gpus[0].mig.devices)
    assert len(devices) == 2
    return devices


def test_an_xid_on_a_mig_device_makes_that_device_unhealthy_not_its_sibling_nor_its_gpu(node, caplog) -> None:
    n = node()
    caplog.set_level(logging.INFO)
    first, second = mig_node(n)
    gpu = n.state.inventory.gpus[0]
    wait = n.nvml.events.watch_xids()
    with n.machine.edit() as doc:  # as `gpu-agent sim inject-xid --gpu 0 --xid 48 --gpu-instance N` does
        doc["xids"].append({"seq": doc["next_seq"], "gpu": 0, "xid": 48, "at": 0.0,
                            "gpu_instance_id": second.gpu_instance_id, "compute_instance_id": 0})
        doc["next_seq"] += 1
    event = wait(500)
    assert event == XidEvent(gpu.uuid, 48, event.at, second.gpu_instance_id, 0)
    n.watcher.record(event)
    wait.free()

    assert not n.state.device_health(second.uuid).healthy
    assert n.state.device_health(first.uuid).healthy and n.state.device_health(gpu.uuid).healthy
    ready, failing = n.state.readiness()
    assert not ready and failing is not None and f"GPU 0 MIG device 3g.40gb (GI {second.gpu_instance_id}, CI 0, " \
        f"{second.uuid}): XID 48" in failing.reason
    instances = {d["uuid"]: d for d in n.gpu_json(0)["mig"]["instances"]}
    assert instances[second.uuid]["health"] == "unhealthy" and instances[first.uuid]["health"] == "healthy"
    assert instances[second.uuid]["last_xid"] == {"xid": 48, "meaning": "double-bit ECC error"}
    assert n.gpu_json(0)["health"] == "healthy"
    assert any("MIG device 3g.40gb" in r.getMessage() and "unhealthy: XID 48" in r.getMessage()
               for r in caplog.records)

    n.later(300)
    assert n.state.device_health(second.uuid).healthy and n.state.ready

    n.xid(0, 79)  # a whole-GPU event: every MIG device of the GPU is unhealthy with it
    assert not n.state.device_health(first.uuid).healthy and not n.state.device_health(second.uuid).healthy
    assert "XID 79" in n.state.device_health(first.uuid).reason


def test_an_event_naming_an_instance_that_is_gone_counts_against_the_whole_gpu(node) -> None:
    n = node()
    mig_node(n)
    uuid = n.state.inventory.gpus[0].uuid
    n.watcher.record(XidEvent(uuid, 48, n.clock.now, gpu_instance_id=99))
    assert n.gpu_json(0)["health"] == "unhealthy"
