"""plugin.api both holds only where the cluster serves nvidia.com/gpu through DRA (gpu_agent/dra/extended.py): a
DeviceClass with spec.extendedResourceName nvidia.com/gpu (DRAExtendedResource, Kubernetes 1.34), read with the
node's credentials and the grant packaging/kubernetes/gpu-agent-deviceclass-reader.yaml gives them."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_agent.config.loader import load_config
from gpu_agent.dra import extended
from gpu_agent.host.paths import Root
from gpu_agent.state import Verdict
from kube_emulator import KubeEmulator
from test_dra import KUBECONFIG, NODE, api_until, client_of

PACKAGING = Path(__file__).resolve().parent.parent / "packaging" / "kubernetes"


@pytest.fixture
def emulator(tmp_path: Path) -> Any:
    with KubeEmulator(tmp_path / "pki") as server:
        server.write_kubeconfig(tmp_path / "root" / KUBECONFIG.lstrip("/"))
        yield server


def test_a_class_naming_nvidia_com_gpu_is_what_lets_both_hold() -> None:
    plain = {"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": []}}
    other = {"metadata": {"name": "nic"}, "spec": {"extendedResourceName": "example.com/nic"}}
    gpus = {"metadata": {"name": "gpu-extended"}, "spec": {"extendedResourceName": "nvidia.com/gpu"}}
    assert extended.verdict([plain, other, "junk", {"spec": None}, gpus]) == Verdict("gpu-extended")
    refused = extended.verdict([plain, other])
    assert refused.device_class is None and refused.refused is not None
    assert refused.refused.startswith("no DeviceClass has spec.extendedResourceName nvidia.com/gpu")
    assert extended.verdict([{"metadata": {}, "spec": {"extendedResourceName": "nvidia.com/gpu"}}]).device_class \
        is None  # a class without a name is no answer to rely on


def test_the_node_needs_the_shipped_grant_to_read_the_classes_and_then_reads_them(
        tmp_path: Path, emulator: KubeEmulator) -> None:
    client = client_of(tmp_path)
    forbidden = extended.check(client)
    assert forbidden is not None and forbidden.device_class is None and forbidden.refused is not None
    assert "may not list DeviceClasses" in forbidden.refused and extended.GRANT in forbidden.refused
    # what the shipped manifest grants, and to whom, is what the emulator is given
    role, binding = yaml.safe_load_all((PACKAGING / "gpu-agent-deviceclass-reader.yaml").read_text())
    [rule] = role["rules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and binding["roleRef"]["name"] == role["metadata"]["name"]
    [subject] = binding["subjects"]
    assert (PACKAGING.parent.parent / extended.GRANT).is_file()
    emulator.grant(subject["name"], rule["verbs"], rule["resources"])
    emulator.add_device_class("gpu.nvidia.com")
    none = extended.check(client)
    assert none is not None and none.refused is not None and none.refused.startswith("no DeviceClass")
    emulator.add_device_class("gpu-extended", "nvidia.com/gpu")
    assert extended.check(client) == Verdict("gpu-extended")
    emulator.fail_next("*deviceclasses*", status=500)
    assert extended.check(client) is None  # no answer: the last verdict stands
    emulator.fail_next("*deviceclasses*", status=404)
    gone = extended.check(client_of(tmp_path))  # (this client holds its next request back a second after a 500)
    assert gone is not None and gone.refused is not None and "serves no /apis/resource.k8s.io/v1/deviceclasses" \
        in gone.refused


def test_the_daemon_serves_device_plugin_while_both_is_refused_and_both_once_a_class_appears(
        tmp_path: Path, emulator: KubeEmulator, write_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.daemon import app

    monkeypatch.setattr(extended, "RECHECK_S", 0.01)
    monkeypatch.setattr(app, "BOTH_REQUESTS_PER_MINUTE", 100_000)  # looked at 100 times a second here
    root = tmp_path / "root"
    config = write_config({"plugin": {"api": "both"}, "kubernetes": {"node_name": NODE}})
    runtime = app.Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    state = runtime.state
    emulator.grant("system:nodes", ["list"], ["deviceclasses"])

    async def scenario() -> None:
        daemon = app.Daemon(runtime, config, config_required=True)
        monkeypatch.setattr(daemon, "publish", lambda: (daemon._ensure_both_check(), daemon._ensure_api()))
        daemon._ensure_api()
        daemon._ensure_dra()
        assert state.serving() == "both" and daemon.dra is None  # nothing is served before the first look
        daemon.publish()
        await api_until(state, lambda: state.serving() == "device-plugin")  # a switch: no claim held a GPU
        assert state.both is not None and state.to_json()["api"]["both"]["refused"].startswith(
            "no DeviceClass has spec.extendedResourceName nvidia.com/gpu")
        assert state.to_json()["api"]["configured"] == "both"
        emulator.add_device_class("gpu-extended", "nvidia.com/gpu")
        await api_until(state, lambda: state.serving() == "both")  # no claim held a GPU: at once
        assert state.to_json()["api"]["both"] == {"device_class": "gpu-extended", "refused": None}
        state.config = load_config(write_config({"plugin": {"api": "dra"}, "kubernetes": {"node_name": NODE}}),
                                   required=True)
        daemon.publish()
        assert state.both is None and state.serving() == "dra"
        for task in daemon._tasks:
            task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        runtime.nvml.close()
