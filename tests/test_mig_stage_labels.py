"""The mig stage's node labels on every way it can fail: nvidia.com/mig.config.state ends `failed` (never
left `pending`, never dropped), as k8s-mig-manager's reconfigure script ends every failure
(deployments/container/reconfigure-mig.sh, exit_failed, mig-parted v0.15.0), and no label is left paused:
the agent pauses no operand (k8s-mig-manager sets nvidia.com/gpu.deploy.* to paused-for-mig-change while
it changes MIG; the agent's device plugin, GFD and exporter take the new devices in the same pass)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness import Pass, SimNode
from kube_emulator import KubeEmulator
from gpu_agent.mig import apply as mig_apply
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import SimModprobe

SHIPPED = Path(__file__).resolve().parent.parent / "packaging" / "mig.yaml"
NODE = "gpu-node-1"
STATE = "nvidia.com/mig.config.state"
DEPLOY = "nvidia.com/gpu.deploy."  # the operands' labels k8s-mig-manager pauses


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    yield emulator
    emulator.close()


def _node(tmp_path: Path, api: KubeEmulator, simulate: str) -> SimNode:
    root = tmp_path / "root"
    (root / "etc/gpu-agent").mkdir(parents=True)
    shutil.copy(SHIPPED, root / "etc/gpu-agent/mig.yaml")
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    node = SimNode(root, simulate, {"toolkit": {"enabled": False}})
    node.apply({"toolkit": {"enabled": False}, "kubernetes": {"node_name": NODE}})  # the driver loaded
    return node


@pytest.fixture
def h100(tmp_path: Path, api: KubeEmulator) -> SimNode:
    return _node(tmp_path, api, "dgx-h100")


def settings(config: str, **mig: object) -> dict[str, Any]:
    return {"toolkit": {"enabled": False}, "mig": {"config": config, **mig}, "kubernetes": {"node_name": NODE}}


def _states(api: KubeEmulator) -> list[str]:
    """Every value of the state label the agent sent, in order."""
    return [request.json["metadata"]["labels"][STATE] for request in api.requests
            if request.method == "PATCH" and STATE in ((request.json or {}).get("metadata") or {}).get("labels", {})]


def _failed(result: Pass, api: KubeEmulator, says: str) -> None:
    mig = result.stage("mig")
    assert mig.state == "failed" and says in mig.message, mig.message
    assert api.labels()[STATE] == "failed", _states(api)
    paused = [key for key, value in api.labels().items() if "paused" in value or key.startswith(DEPLOY)]
    assert not paused


def test_a_config_name_the_file_lacks(h100: SimNode, api: KubeEmulator) -> None:
    _failed(h100.apply(settings("no-such-config")), api, "no MIG config 'no-such-config'")


def test_a_config_file_that_cannot_be_read(h100: SimNode, api: KubeEmulator) -> None:
    (h100.root / "etc/gpu-agent/mig.yaml").write_text("version: v1\nmig-configs: [\n")
    _failed(h100.apply(settings("all-balanced")), api, "mig.yaml")


def test_an_nvml_call_that_fails_while_applying(h100: SimNode, api: KubeEmulator) -> None:
    h100.sim("fail", "nvmlDeviceCreateGpuInstanceWithPlacement", "--gpu", "2", "--times", "1")
    result = h100.apply(settings("all-balanced"))
    _failed(result, api, "GPU 2")
    assert _states(api) == ["pending", "failed"]  # pending while it ran, failed after: not left pending


def test_a_geometry_the_gpus_cannot_have(h100: SimNode, api: KubeEmulator) -> None:
    config = h100.root / "etc/gpu-agent/mig.yaml"
    config.write_text(config.read_text() + "  too-many:\n    - devices: all\n      mig-enabled: true\n"
                                           "      mig-devices: {\"3g.40gb\": 3}\n")
    _failed(h100.apply(settings("too-many")), api, "3x 3g.40gb needs")


def test_a_gpu_running_compute_processes(h100: SimNode, api: KubeEmulator) -> None:
    h100.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "trainer")
    _failed(h100.apply(settings("all-balanced")), api, "4242 (trainer)")


def test_a_unit_that_cannot_be_stopped(h100: SimNode, api: KubeEmulator) -> None:
    _failed(h100.apply(settings("all-balanced", stop_units=["no-such-unit.service"])), api,
            "stopping no-such-unit.service before the MIG change failed")


def test_nvml_failing_before_the_geometry_is_read(h100: SimNode, api: KubeEmulator) -> None:
    assert h100.apply(settings("all-balanced")).stage("mig").state == "ok" and api.labels()[STATE] == "success"
    h100.sim("fail", "nvmlDeviceGetCount", "--times", "1000")
    _failed(h100.apply(settings("all-balanced")), api, "NVML")


@pytest.mark.parametrize("error, says", [
    (AgentError("the ledger cannot be written: No space left on device"), "No space left on device"),
    (KeyError("a bug"), "internal error: KeyError"),
])
def test_an_error_inside_the_change_after_pending_was_set(h100: SimNode, api: KubeEmulator,
                                                          monkeypatch: pytest.MonkeyPatch, error: Exception,
                                                          says: str) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(mig_apply.Applier, "apply_all", broken)
    _failed(h100.apply(settings("all-balanced")), api, says)
    assert _states(api) == ["pending", "failed"]


def test_a_mode_change_only_a_reboot_applies_is_rebooting_then_success(tmp_path: Path, api: KubeEmulator) -> None:
    """Not a failure while the reboot has not happened: `rebooting` (docs/mig.md); the reboot applies it."""
    node = _node(tmp_path, api, "dgx-a100")
    SimModprobe(node.machine, Root(node.root)).load("nvidia_drm")
    result = node.apply(settings("all-balanced"))
    assert result.state.mig.state == "rebooting" and api.labels()[STATE] == "rebooting"
    node.sim("reboot")  # the pass after it loads the driver again and makes the instances
    assert node.apply(settings("all-balanced")).stage("mig").state == "ok" and api.labels()[STATE] == "success"
    assert _states(api)[-3:] == ["rebooting", "pending", "success"]
