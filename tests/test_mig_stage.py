"""The mig stage in the agent's pass, in-process: the geometry is applied before discovery, so the same
pass's inventory, CDI spec and labels show the new MIG devices; nvidia.com/mig.config.state goes
pending -> success on the node; the node label nvidia.com/mig.config is followed when asked."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest

from harness import SimNode
from kube_emulator import KubeEmulator

SHIPPED = Path(__file__).resolve().parent.parent / "packaging" / "mig.yaml"
NODE = "gpu-node-1"
STATE = "nvidia.com/mig.config.state"


@pytest.fixture
def node(tmp_path: Path) -> SimNode:
    root = tmp_path / "root"
    (root / "etc/gpu-agent").mkdir(parents=True)
    shutil.copy(SHIPPED, root / "etc/gpu-agent/mig.yaml")
    return SimNode(root, "dgx-h100", {"toolkit": {"enabled": False}})


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    yield emulator
    emulator.close()


def settings(config: str, **mig: object) -> dict:
    return {"toolkit": {"enabled": False}, "mig": {"config": config, **mig}}


def test_the_geometry_is_applied_and_seen_by_the_same_pass(node: SimNode) -> None:
    first = node.apply(settings("all-balanced"))
    mig = first.stage("mig")
    assert mig.state == "ok", mig.message
    kinds = [change.kind for change in first.changes("mig")]
    assert kinds.count("CreateGpuInstance") == 32 and kinds.count("SetMigMode") == 8
    assert first.state.mig.state == "success" and first.state.mig.config == "all-balanced"
    devices = first.state.inventory.gpus[0].mig.devices  # discovery ran after mig, in the same pass
    assert sorted(d.profile for d in devices) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    again = node.apply(settings("all-balanced"))
    assert again.changes("mig") == [] and again.stage("mig").message == "MIG config all-balanced applied (8 GPUs)"


def test_mig_runs_before_discovery_and_what_consumes_the_inventory(node: SimNode) -> None:
    result = node.apply({"mig": {"config": "all-7g.80gb"}})  # the toolkit stage (the CDI spec) on
    order = [run.stage for run in result.runs]
    assert order.index("mig") < order.index("discovery") < order.index("toolkit")
    assert all(gpu.mig.devices[0].profile == "7g.80gb" for gpu in result.state.inventory.gpus)


def test_a_check_plans_and_changes_nothing(node: SimNode) -> None:
    node.apply({"toolkit": {"enabled": False}})  # the driver loaded, MIG left alone
    before = node.machine.read()["gpus"]
    result = node.check(settings("all-balanced"))
    assert result.stage("mig").state == "pending" and len(result.changes("mig")) == 8 * 9
    assert node.machine.read()["gpus"] == before


def test_a_bad_config_fails_the_stage_naming_it_and_changes_nothing(node: SimNode) -> None:
    node.apply({"toolkit": {"enabled": False}})
    before = node.machine.read()["gpus"]
    result = node.apply(settings("no-such-config"))
    assert result.stage("mig").state == "failed"
    assert "no MIG config 'no-such-config'" in result.stage("mig").message
    assert "(config from mig.config)" in result.stage("mig").message
    assert result.state.mig.state == "failed" and node.machine.read()["gpus"] == before
    assert result.stage("discovery").state == "ok"  # the GPUs are still seen


def test_state_label_goes_pending_then_success_and_the_node_label_is_followed(
        node: SimNode, api: KubeEmulator) -> None:
    api.write_kubeconfig(node.root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    api.set_labels({"nvidia.com/mig.config": "all-1g.10gb"})
    config = {**settings("all-balanced", follow_node_label=True), "kubernetes": {"node_name": NODE}}
    result = node.apply(config)
    assert result.stage("mig").state == "ok" and result.state.mig.config == "all-1g.10gb"
    sent = [request.json["metadata"]["labels"][STATE] for request in api.requests
            if request.method == "PATCH" and STATE in ((request.json or {}).get("metadata") or {}).get("labels", {})]
    assert sent == ["pending", "success"]
    assert api.labels()[STATE] == "success"
    assert sorted(d.profile for d in result.state.inventory.gpus[3].mig.devices) == ["1g.10gb"] * 7
    assert STATE in api.annotations()["nvidia.com/gpu-agent.managed-labels"].split(",")
