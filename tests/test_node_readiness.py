"""The recipe that keeps pods off a node until its GPUs are ready: the kubelet registers a startup taint, and
the Node Readiness Controller removes it once the agent's GPUAgentReady condition is True. The agent owns
only the condition (NodeRestriction forbids a node its own taints). Our example rule
(docs/examples/gpu-readiness-rule.yaml) is checked against the controller's schema and admission rules
(tests/facts/node_readiness_controller.py), and evaluated as the controller evaluates it on the Node the
agent writes, ready and not."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import yaml
from facts import node_readiness_controller as nrc
from harness import SimNode
from kube_emulator import KubeEmulator

from gpu_agent.stages.labels import CONDITION

RULE_FILE = Path(__file__).resolve().parent.parent / "docs/examples/gpu-readiness-rule.yaml"
NODE = "gpu-node-1"
STARTUP_TAINT = {"key": "readiness.k8s.io/gpu-agent", "value": "pending", "effect": "NoSchedule"}


@pytest.fixture
def rule() -> dict:
    return yaml.safe_load(RULE_FILE.read_text())


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    """A Node as the kubelet registers it with --register-with-taints=readiness.k8s.io/gpu-agent=pending:NoSchedule."""
    emulator = KubeEmulator(tmp_path / "pki", nodes=()).start()
    emulator.add_node(NODE, taints=[STARTUP_TAINT])
    yield emulator
    emulator.close()


def test_the_example_rule_is_one_the_controller_accepts(rule: dict) -> None:
    assert nrc.problems(rule) == []
    # the check refuses what the controller refuses
    for broken, why in (
            ({"taint": {**rule["spec"]["taint"], "key": "nvidia.com/gpu-agent"}}, "spec.taint.key"),
            ({"conditions": [{**rule["spec"]["conditions"][0], "defaultStatus": "False"}]}, "bootstrap-only"),
            ({"nodeSelector": {}}, "spec.nodeSelector"), ({"enforcementMode": "once"}, "spec.enforcementMode"),
            ({"conditionPolicy": "allOf"}, "spec.conditionPolicy: unknown")):  # after v0.5.0: not in the example
        assert any(why in problem for problem in nrc.problems({**rule, "spec": {**rule["spec"], **broken}})), why


def test_the_rule_names_the_condition_and_the_taint_the_recipe_registers(rule: dict) -> None:
    (condition,) = rule["spec"]["conditions"]
    assert (condition["type"], condition["requiredStatus"]) == (CONDITION, "True")
    assert {key: rule["spec"]["taint"][key] for key in ("key", "effect")} == \
        {key: STARTUP_TAINT[key] for key in ("key", "effect")}
    assert STARTUP_TAINT["value"] == rule["spec"]["taint"]["value"]
    assert f"--register-with-taints={STARTUP_TAINT['key']}={STARTUP_TAINT['value']}:{STARTUP_TAINT['effect']}" in \
        RULE_FILE.read_text()


def test_the_controller_lifts_the_taint_once_the_agent_says_ready_and_not_before(
        rule: dict, api: KubeEmulator, root: Path) -> None:
    registered = api.get_node(NODE)
    assert nrc.has_taint(rule, registered) and not nrc.removes_taint(rule, registered)  # no condition yet: Unknown
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", user=f"system:node:{NODE}", mode="cert-data")
    settings = {"kubernetes": {"node_name": NODE}, "reconcile": {"backoff_initial_seconds": 0.2}}

    failing = SimNode(root, "dgx-a100", {**settings, "driver": {"version": "1.2.3"}}).apply()  # another driver
    assert failing.stage("driver").state == "failed"
    condition = api.condition(CONDITION, NODE)
    assert condition is not None and (condition["status"], condition["reason"]) == ("False", "DriverFailed")
    node = api.get_node(NODE)
    assert not nrc.removes_taint(rule, node) and nrc.has_taint(rule, node)
    assert node["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"  # the selector matches already

    ready = SimNode(root, "dgx-a100", settings).apply()
    assert ready.ok, [(run.stage, run.message) for run in ready.runs if run.state != "ok"]
    node = api.get_node(NODE)
    assert (api.condition(CONDITION, NODE) or {}).get("reason") == "GPUsReady" and nrc.removes_taint(rule, node)
    selector = rule["spec"]["nodeSelector"]["matchLabels"]
    assert all(node["metadata"]["labels"].get(key) == value for key, value in selector.items())
    assert node["spec"]["taints"] == [STARTUP_TAINT]  # the agent never touches taints: the controller does
