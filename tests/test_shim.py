"""packaging/kubernetes: the shim DaemonSet, its PodMonitor and the example alerts, checked against the
agent itself: the probe's port is the default http.listen's, its path and the scrape path are routes the
agent serves, and every series an alert uses is one the agent exports."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.config import load_config
from gpu_agent.config.schema import HttpConfig
from gpu_agent.daemon.http import build_app
from gpu_agent.host.paths import Root
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import OK, AgentState, StageStatus

KUBERNETES = Path(__file__).resolve().parent.parent / "packaging" / "kubernetes"


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [doc for doc in docs if doc["kind"] == kind]
    return doc


@pytest.fixture
def agent_state(tmp_path: Path) -> Any:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    SimModprobe(machine, Root(tmp_path)).load("nvidia")
    nvml = Nvml(FakeNvml(machine), call_timeout=2.0)
    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    state.inventory = nvml.inventory.read()
    state.stages["discovery"] = StageStatus("discovery", OK, "8 GPUs found")
    Sampler(nvml, state, Root(tmp_path)).sample()
    yield state
    nvml.close()


def routes(state: AgentState) -> set[str]:
    return set(build_app(state, make_registry(AgentCollector(state, lambda: 0, "node-1")), lambda: None).routes)


def test_the_shim_probes_the_agents_default_listener(agent_state: AgentState) -> None:
    docs = documents("gpu-agent-shim.yaml")
    assert {doc["kind"] for doc in docs} == {"Namespace", "RuntimeClass", "DaemonSet"}
    runtime_class = of_kind(docs, "RuntimeClass")  # the containerd, CRI-O and Docker runtime the toolkit adds
    assert (runtime_class["apiVersion"], runtime_class["handler"]) == ("node.k8s.io/v1", "nvidia")
    namespace = of_kind(docs, "Namespace")["metadata"]["name"]
    daemonset = of_kind(docs, "DaemonSet")
    assert daemonset["apiVersion"] == "apps/v1" and daemonset["metadata"]["namespace"] == namespace == "gpu-agent"
    template = daemonset["spec"]["template"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}  # a string, not YAML's true
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    [container] = pod["containers"]
    assert container["image"].startswith("registry.k8s.io/pause:")
    probe = container["readinessProbe"]["httpGet"]
    defaults = HttpConfig()
    assert (probe["host"], probe["port"]) == (defaults.host, defaults.port) == ("127.0.0.1", 9445)
    assert probe["path"] == "/readyz" and probe["path"] in routes(agent_state)
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("http", defaults.port)]


def test_every_label_and_selector_value_is_a_string() -> None:
    """YAML 1.1 reads true, yes, on and 8080 as other types; Kubernetes wants strings there."""
    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in ("labels", "matchLabels", "nodeSelector", "annotations"):
                    assert all(isinstance(v, str) for v in item.values()), f"{path}.{key}"
                walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    for name in ("gpu-agent-shim.yaml", "gpu-agent-podmonitor.yaml", "gpu-agent-alerts.yaml",
                 "gpu-agent-deviceclass-reader.yaml"):
        for doc in documents(name):
            walk(doc, name)


def test_the_pod_monitor_scrapes_the_shims_pods_on_the_agents_metrics_path(agent_state: AgentState) -> None:
    monitor = of_kind(documents("gpu-agent-podmonitor.yaml"), "PodMonitor")
    daemonset = of_kind(documents("gpu-agent-shim.yaml"), "DaemonSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    template = daemonset["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    port_names = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    assert endpoint["path"] in routes(agent_state)


def test_every_series_an_alert_uses_is_one_the_agent_exports(agent_state: AgentState) -> None:
    [group] = documents("gpu-agent-alerts.yaml")[0]["groups"]
    alerts = {rule["alert"]: rule for rule in group["rules"]}
    assert {"GPUUnhealthy", "GPUAgentNotReady", "GPUAgentStageFailing"} <= set(alerts)
    assert alerts["GPUAgentStageFailing"]["for"] == "10m"
    samples = scrape(agent_state)
    for name, rule in alerts.items():
        used = set(re.findall(r"\b(?:gpu_agent|DCGM)_\w+", rule["expr"]))
        assert used and used <= {sample.name for sample in samples}, name
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name


def scrape(state: AgentState) -> list[Any]:
    text = render(make_registry(AgentCollector(state, lambda: 0, "node-1"))).decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_every_label_an_alert_names_is_on_every_scrape_of_its_series(agent_state: AgentState) -> None:
    """An annotation renders with any scrape config: the labels it names are ones each sample of the
    expression's series carries on a plain scrape, or instance and job, which Prometheus adds to every
    target; never one only a relabeling adds (the PodMonitor's node)."""
    [group] = documents("gpu-agent-alerts.yaml")[0]["groups"]
    samples = scrape(agent_state)
    for rule in group["rules"]:
        used = set(re.findall(r"\b(?:gpu_agent|DCGM)_\w+", rule["expr"]))
        on_every_sample = set.intersection(*(set(s.labels) for s in samples if s.name in used))
        named = {label for template in rule["annotations"].values()
                 for label in re.findall(r"\$labels\.(\w+)", template)}
        assert named <= on_every_sample | {"instance", "job"}, (rule["alert"], named - on_every_sample)


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus) is not installed")
def test_promtool_accepts_the_alert_rules() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(KUBERNETES / "gpu-agent-alerts.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout
