"""Issue 12's acceptance, from outside: hand-written mig-parted configs (tests/data/mig/acceptance.yaml,
none of them shipped) applied by the daemon's pass to DGX A100 and DGX H100 simulations. The geometry
matches; re-applying changes nothing; changing one GPU touches only it; an impossible geometry and a
busy GPU are refused with nothing changed; an NVML failure mid-apply restores that GPU; a driver reload
(Hopper forgets MIG mode) is repaired at the next pass; nvidia.com/mig.config.state goes pending ->
success, and is rebooting while only a reboot can apply a mode change."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpu_agent.mig.config import entry_for, load_mig_config
from gpu_agent.mig.export import geometry
from harness import Pass, SimNode
from kube_emulator import KubeEmulator

CONFIGS = Path(__file__).resolve().parent / "data" / "mig" / "acceptance.yaml"
CONFIG_FILE = "/etc/gpu-agent/mig-acceptance.yaml"
NODE = "gpu-node-1"
STATE = "nvidia.com/mig.config.state"
PRODUCT = {"dgx-a100": "A100-SXM4-40GB", "dgx-h100": "H100 80GB HBM3"}
MIXED = {"dgx-a100": (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)),
         "dgx-h100": (("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1))}


# `make test` runs the core cases on the DGX H100; the DGX A100 runs, and the cases whose apply-level or
# stage-level sibling stays fast, are slow (`make test-slow`, CI).
@pytest.fixture(params=[pytest.param("dgx-a100", marks=pytest.mark.slow), "dgx-h100"])
def node(request: Any, tmp_path: Path) -> SimNode:
    root = tmp_path / "root"
    (root / "etc/gpu-agent").mkdir(parents=True)
    shutil.copy(CONFIGS, root / CONFIG_FILE.lstrip("/"))
    return SimNode(root, request.param, {"toolkit": {"enabled": False}})


def settings(name: str, **more: Any) -> dict[str, Any]:
    return {"toolkit": {"enabled": False}, "mig": {"config": name, "config_file": CONFIG_FILE}, **more}


def expected(node: SimNode, name: str, result: Pass) -> list[tuple[bool, tuple[tuple[str, int], ...]]]:
    """Each GPU's geometry as the config's last entry selecting it says."""
    entries = tuple(load_mig_config(CONFIGS).select(name))
    found = []
    for gpu in result.state.inventory.gpus:
        entry = entry_for(entries, gpu.index, gpu.pci_device_id, gpu.pci_subsystem_id)
        assert entry is not None, (name, gpu.index)
        found.append((entry.mig_enabled, tuple(sorted(entry.wanted.items())) if entry.mig_enabled else ()))
    return found


def geometries(result: Pass) -> list[tuple[bool, tuple[tuple[str, int], ...]]]:
    return [geometry(gpu) for gpu in result.state.inventory.gpus]


def gpus(node: SimNode) -> list[dict[str, Any]]:
    """The simulated GPUs' whole state: MIG mode, instances with placements, MIG device UUIDs."""
    return copy.deepcopy(node.machine.read()["gpus"])


def changed_gpus(result: Pass) -> set[int]:
    return {change.gpu for change in result.changes("mig")}  # type: ignore[attr-defined]


def test_each_config_gives_its_geometry_and_reapplying_it_changes_nothing(node: SimNode) -> None:
    applied = {}
    for name in ("mixed", "split-0-2", "enabled-empty", "whole", "disabled"):
        result = applied[name] = node.apply(settings(name))
        assert result.stage("mig").state == "ok", (name, result.stage("mig").message)
        assert result.state.mig.state == "success"
        assert geometries(result) == expected(node, name, result), name
        before = gpus(node)
        again = node.apply(settings(name))
        assert again.changes("mig") == [] and gpus(node) == before, f"{name}: re-applying changed a GPU"
        assert again.stage("mig").message == f"MIG config {name} applied (8 GPUs)"
    assert geometries(applied["mixed"])[0] == (True, MIXED[node.simulate])
    split = applied["split-0-2"]
    profile = "7g.40gb" if node.simulate == "dgx-a100" else "7g.80gb"
    assert geometries(split)[2] == (True, ((f"1c.{profile}", 1), (f"2c.{profile}", 1), (f"4c.{profile}", 1)))
    assert len(split.state.inventory.gpus[2].mig.gpu_instances) == 1  # one GPU instance, split three ways
    assert changed_gpus(split) == {0, 2}
    assert geometries(applied["enabled-empty"]) == [(True, ())] * 8


@pytest.mark.slow  # fast sibling: test_mig_apply.py::test_one_changed_gpu_touches_only_that_gpu_and_keeps_what_fits
def test_changing_one_gpu_touches_only_that_gpu(node: SimNode) -> None:
    node.apply(settings("mixed"))
    before = gpus(node)
    result = node.apply(settings("media-on-3"))
    assert result.stage("mig").state == "ok" and changed_gpus(result) == {3}
    after = gpus(node)
    assert [gpu for i, gpu in enumerate(after) if i != 3] == [gpu for i, gpu in enumerate(before) if i != 3]
    me = "1g.5gb+me" if node.simulate == "dgx-a100" else "1g.10gb+me"
    assert (me, 1) in geometries(result)[3][1]
    # The 2g and 3g instances on GPU 3 stayed where they were, with their MIG devices.
    kept = [gi for gi in before[3]["mig"]["gpu_instances"] if gi["size"] >= 2]
    assert all(gi in after[3]["mig"]["gpu_instances"] for gi in kept) and len(kept) == 2


@pytest.mark.slow  # fast sibling: test_mig_apply.py::test_an_impossible_geometry_is_refused_before_any_change
def test_an_impossible_geometry_is_refused_with_nothing_changed(node: SimNode) -> None:
    node.apply(settings("mixed"))
    before = gpus(node)
    result = node.apply(settings("impossible-on-5"))
    mig = result.stage("mig")
    small = "1g.5gb" if node.simulate == "dgx-a100" else "1g.10gb"
    big = "3g.20gb" if node.simulate == "dgx-a100" else "3g.40gb"
    assert mig.state == "failed"
    assert f"GPU 5 ({PRODUCT[node.simulate]}): 2x {big} + 1x {small} needs 9 of 8 memory slices" in mig.message
    assert result.changes("mig") == [] and gpus(node) == before and result.state.mig.state == "failed"


@pytest.mark.slow  # fast sibling: test_mig_apply.py::test_a_busy_gpu_is_refused_naming_its_processes
def test_a_busy_gpu_is_refused_naming_its_process(node: SimNode) -> None:
    node.apply(settings("mixed"))
    node.sim("add-process", "--gpu", "1", "--pid", "4242", "--name", "trainer")
    before = gpus(node)
    result = node.apply(settings("whole"))
    assert result.stage("mig").state == "failed"
    assert "GPU 1" in result.stage("mig").message and "4242 (trainer)" in result.stage("mig").message
    assert gpus(node)[1] == before[1]
    assert [g for i, g in enumerate(geometries(result)) if i != 1] == [g for i, g in enumerate(
        expected(node, "whole", result)) if i != 1]
    assert result.state.mig.state == "failed"


@pytest.mark.slow  # fast sibling: test_mig_apply.py::test_an_nvml_failure_mid_apply_restores_the_previous_geometry
def test_an_nvml_failure_mid_apply_restores_that_gpus_previous_geometry(node: SimNode) -> None:
    node.apply(settings("mixed"))
    before = gpus(node)
    node.sim("fail", "nvmlGpuInstanceCreateComputeInstanceWithPlacement", "--gpu", "6", "--times", "1")
    result = node.apply(settings("whole"))
    after = gpus(node)
    assert [(gi["profile_id"], gi["start"], gi["size"]) for gi in after[6]["mig"]["gpu_instances"]] == [
        (gi["profile_id"], gi["start"], gi["size"]) for gi in before[6]["mig"]["gpu_instances"]]
    assert geometries(result)[6] == (True, MIXED[node.simulate])
    gpu6 = next(gpu for gpu in result.state.mig.gpus if gpu.gpu == 6)
    assert gpu6.action == "restored" and "previous MIG geometry is restored" in gpu6.reason
    assert all(geometries(result)[i] == expected(node, "whole", result)[i] for i in range(8) if i != 6)


def test_an_nvml_failure_mid_apply_from_mig_off_restores_mig_off(node: SimNode) -> None:
    """On the A100 the mode change is undone with its own reset."""
    node.apply(settings("disabled"))
    node.sim("fail", "nvmlDeviceCreateGpuInstanceWithPlacement", "--gpu", "4", "--times", "1")
    result = node.apply(settings("mixed"))
    assert geometries(result)[4] == (False, ()) and geometries(result)[3] == (True, MIXED[node.simulate])


@pytest.mark.slow  # fast sibling: test_mig_apply.py::test_a_driver_reload_clears_hopper_mig_mode_and_every_...
def test_a_driver_reload_is_repaired_at_the_next_pass(node: SimNode) -> None:
    node.apply(settings("mixed"))
    node.sim("reload-driver")
    hopper = node.simulate == "dgx-h100"
    lost = node.machine.read()["gpus"]
    assert all(gpu["mig"]["gpu_instances"] == [] and gpu["mig"]["current"] == (0 if hopper else 1) for gpu in lost)
    result = node.apply(settings("mixed"))
    kinds = [change.kind for change in result.changes("mig")]
    assert kinds.count("SetMigMode") == (8 if hopper else 0) and kinds.count("CreateGpuInstance") == 32
    assert result.stage("mig").state == "ok" and geometries(result) == expected(node, "mixed", result)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    yield emulator
    emulator.close()


def sent_states(api: KubeEmulator) -> list[str]:
    return [request.json["metadata"]["labels"][STATE] for request in api.requests
            if request.method == "PATCH" and STATE in ((request.json or {}).get("metadata") or {}).get("labels", {})]


@pytest.mark.slow  # fast sibling: test_mig_stage.py::test_state_label_goes_pending_then_success_and_the_node_...
def test_the_state_label_goes_pending_then_success(node: SimNode, api: KubeEmulator) -> None:
    api.write_kubeconfig(node.root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    result = node.apply(settings("split-0-2", kubernetes={"node_name": NODE}))
    assert result.stage("mig").state == "ok"
    assert sent_states(api) == ["pending", "success"] and api.labels()[STATE] == "success"


def test_a_mode_change_only_a_reboot_can_apply_is_rebooting_with_the_reason(tmp_path: Path, api: KubeEmulator) -> None:
    root = tmp_path / "root"
    (root / "etc/gpu-agent").mkdir(parents=True)
    shutil.copy(CONFIGS, root / CONFIG_FILE.lstrip("/"))
    node = SimNode(root, "dgx-a100")
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    config = settings("mixed", kubernetes={"node_name": NODE}, driver={"modules": {"nvidia_drm": True}})
    result = node.apply(config)
    status = next(stage for stage in result.state.to_json()["stages"] if stage["name"] == "mig")
    assert status["facts"]["state"] == "rebooting" and "nvidia_drm is loaded" in status["facts"]["reason"]
    assert "reboot the node" in status["facts"]["reason"] and result.stage("mig").state == "failed"
    assert api.labels()[STATE] == "rebooting" and sent_states(api) == ["pending", "rebooting"]
    before = gpus(node)
    again = node.apply(config)  # only the reset is retried: no NVML change, no label flapping through pending
    assert again.state.mig.state == "rebooting" and sent_states(api) == ["pending", "rebooting"]
    assert gpus(node) == before and all(gpu["mig"]["pending"] == 1 for gpu in before)
    node.sim("reboot")
    after = node.apply(config)
    assert after.stage("mig").state == "ok" and geometries(after) == [(True, MIXED["dgx-a100"])] * 8
    assert api.labels()[STATE] == "success" and sent_states(api)[-2:] == ["pending", "success"]
