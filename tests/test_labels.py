"""GFD-compatible labels from the state model, and `gpu-agent labels`."""
from __future__ import annotations

import json
from pathlib import Path

from harness import SimNode, run_cli
from upstream_data import upstream_file

from gpu_agent.kube.labels import compute, family, sanitise, valid_key, valid_value
from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, Inventory, MigProfile, MigState

DGX_A100 = {
    "nvidia.com/cuda.driver-version.full": "550.90.07", "nvidia.com/cuda.driver-version.major": "550",
    "nvidia.com/cuda.driver-version.minor": "90", "nvidia.com/cuda.driver-version.revision": "07",
    "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "90", "nvidia.com/cuda.driver.rev": "07",
    "nvidia.com/cuda.runtime-version.full": "12.4", "nvidia.com/cuda.runtime-version.major": "12",
    "nvidia.com/cuda.runtime-version.minor": "4", "nvidia.com/cuda.runtime.major": "12",
    "nvidia.com/cuda.runtime.minor": "4", "nvidia.com/gpu-agent.ready": "true",
    "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.family": "ampere", "nvidia.com/gpu.machine": "DGXA100-920-23687-2530-000",
    "nvidia.com/gpu.memory": "40960", "nvidia.com/gpu.mode": "compute", "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.replicas": "1",
    "nvidia.com/gpu.sharing-strategy": "none", "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
    "nvidia.com/vgpu.present": "false",
}


def test_dgx_a100_labels_are_exact(root: Path) -> None:
    assert SimNode(root, "dgx-a100").apply().ok
    result = run_cli("--simulate", "dgx-a100", "labels", "--json", root=root)
    assert result.returncode == 0 and json.loads(result.stdout) == DGX_A100
    plain = run_cli("--simulate", "dgx-a100", "labels", root=root).stdout
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-40GB\n" in plain


def test_without_gpus_only_the_readiness_label_remains(root: Path) -> None:
    result = run_cli("--simulate", "none", "labels", "--json", root=root)
    assert json.loads(result.stdout) == {"nvidia.com/gpu-agent.ready": "false"}


def test_families_follow_compute_capability() -> None:
    assert [family(*cc) for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == [
        "volta", "turing", "ampere", "ampere", "ada-lovelace", "hopper", "blackwell", "blackwell"]


def test_values_and_keys_follow_kubernetes_syntax() -> None:
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise(" Super/Server  (X) ") == "SuperServer-X"  # as GFD: dropped, not replaced
    assert sanitise("NVIDIA  A100 (PCIe) 40GB") == "NVIDIA-A100-PCIe-40GB" and sanitise("1g.10gb+me") == "1g.10gbme"
    assert len(sanitise("x" * 80)) == 63 and valid_value(sanitise("x" * 80))
    assert valid_key("nvidia.com/mig-1g.10gb.engines.copy") and not valid_key("nvidia.com/-bad")


def _h100(mig: MigState, index: int = 0) -> Gpu:
    return Gpu(index, f"GPU-{index}", f"0000:{index:02x}:00.0", "NVIDIA H100 80GB HBM3", 81559, (9, 0), index, mig)


PROFILES = (MigProfile("1g.10gb", 19, 1, 7, 16, 9984, 1, 1, 0, 1, 0, ()),
            MigProfile("3g.40gb", 9, 3, 2, 60, 40448, 3, 3, 0, 3, 0, ()))


def _instance(index: int, profile: str, memory_mib: int, multiprocessors: int) -> GpuInstance:
    """A GPU instance with one compute instance as large as it: one MIG device."""
    compute = ComputeInstance(0, 0, profile, 1, (0, 1), multiprocessors, f"MIG-{index}-{profile}", index)
    return GpuInstance(index + 1, 0, profile, 1, (index, 1), memory_mib, (compute,))


def _mig(*profiles: str) -> MigState:
    instances = tuple(_instance(i, p, 40448 if p == "3g.40gb" else 9984, 60 if p == "3g.40gb" else 16)
                      for i, p in enumerate(profiles))
    return MigState(True, True, True, instances, PROFILES)


def test_mixed_strategy_labels_each_profile() -> None:
    inventory = Inventory("550.90.07", "12.4", (_h100(_mig("3g.40gb", "3g.40gb", "1g.10gb")),
                                               _h100(MigState(True, profiles=PROFILES), 1)))
    labels = compute(inventory, True, "mixed", "DGXH100")
    assert labels["nvidia.com/gpu.count"] == "2"  # every GPU of the model, as GFD counts
    assert labels["nvidia.com/mig-3g.40gb.count"] == "2" and labels["nvidia.com/mig-1g.10gb.count"] == "1"
    assert labels["nvidia.com/mig-3g.40gb.memory"] == "40448"
    assert labels["nvidia.com/mig-3g.40gb.multiprocessors"] == "60"
    assert labels["nvidia.com/mig-3g.40gb.slices.gi"] == "3" and labels["nvidia.com/mig-3g.40gb.engines.decoder"] == "3"
    assert labels["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert all(valid_key(k) and valid_value(v) for k, v in labels.items())


def test_single_strategy_uses_the_mig_devices_or_says_invalid() -> None:
    uniform = Inventory("550.90.07", "12.4", (_h100(_mig("3g.40gb", "3g.40gb")), _h100(_mig("3g.40gb", "3g.40gb"), 1)))
    labels = compute(uniform, True, "single", None)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
    assert labels["nvidia.com/gpu.count"] == "4" and labels["nvidia.com/gpu.memory"] == "40448"
    mixed = Inventory("550.90.07", "12.4", (_h100(_mig("3g.40gb", "1g.10gb")),))
    invalid = compute(mixed, True, "single", None)
    assert invalid["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-INVALID"
    assert invalid["nvidia.com/gpu.count"] == "0"


def test_odd_profile_names_give_valid_keys() -> None:
    profiles = PROFILES + (MigProfile("1g.10gb+me", 20, 1, 1, 16, 9984, 1, 1, 0, 1, 1, ()),)
    gpu = _h100(MigState(True, True, True, (_instance(0, "1g.10gb+me", 9984, 16),), profiles))
    labels = compute(Inventory("550.90.07", "12.4", (gpu,)), True, "mixed", None)
    assert labels["nvidia.com/mig-1g.10gb.me.count"] == "1"  # the plugin's resource name, as GFD keys it
    assert labels["nvidia.com/mig-1g.10gb.me.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me"
    assert all(valid_key(k) and valid_value(v) for k, v in labels.items())


def test_a_mig_gpu_without_devices_is_invalid_under_single() -> None:
    inventory = Inventory("550.90.07", "12.4", (_h100(_mig("3g.40gb", "3g.40gb")), _h100(_mig(), 1)))
    labels = compute(inventory, True, "single", None)
    assert labels["nvidia.com/gpu.product"].endswith("-MIG-INVALID") and labels["nvidia.com/gpu.replicas"] == "0"
    assert labels["nvidia.com/gpu.sharing-strategy"] == ""  # GFD's newInvalidMigStrategyLabeler


def test_the_machine_is_unknown_only_when_it_cannot_be_read() -> None:
    """GFD's machine-type.go: an unreadable file is "unknown", an empty one (or one sanitised away) empty."""
    inventory = Inventory("550.90.07", "12.4", (_h100(MigState(True, profiles=PROFILES)),))
    assert [compute(inventory, True, "none", machine)["nvidia.com/gpu.machine"]
            for machine in (None, "", "(?)", "DGX H100")] == ["unknown", "", "", "DGX-H100"]


# GFD's expected label files (NVIDIA/k8s-device-plugin tests/expected-output*.txt, read from
# ../shared/upstream): one regular expression a line, checked as its cmd/gpu-feature-discovery/main_test.go
# checkResult does (every label line matches one), and here also the other way (every label it expects is
# written). The agent's own namespace (gpu-agent.*) and gpu.present (the GPU Operator's NFD rule writes it)
# are not GFD's.
def test_the_labels_match_gfds_expected_output() -> None:
    import re

    from gpu_agent.kube.labels import with_timestamp

    inventory = Inventory("550.90.07", "12.4", tuple(_h100(MigState(True, profiles=PROFILES), i) for i in range(2)))
    labels = with_timestamp(compute(inventory, True, "none", "DGX A100"), {}, 1724632719.6)
    lines = [f"{k}={v}" for k, v in labels.items() if not k.startswith("nvidia.com/gpu-agent.")
             and k != "nvidia.com/gpu.present"]
    for name in ("expected-output.txt", "expected-output-mig-none.txt"):
        text = upstream_file("k8s-device-plugin", f"tests/{name}").read_text()
        expected = [re.compile(line) for line in text.rstrip("\n").split("\n")]
        assert [line for line in lines if not any(r.search(line) for r in expected)] == [], name
        assert [r.pattern for r in expected if not any(r.search(line) for line in lines)] == [], name
    assert labels["nvidia.com/gfd.timestamp"] == "1724632719" and labels["nvidia.com/mps.capable"] == "false"


def test_the_timestamp_changes_only_with_another_label() -> None:
    from gpu_agent.kube.labels import TIMESTAMP, with_timestamp

    wanted = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu-agent.ready": "true"}
    first = with_timestamp(wanted, {}, 1594644571.9)  # nothing published yet: now
    assert first == {**wanted, TIMESTAMP: "1594644571"}
    assert with_timestamp(wanted, first, 1700000000) == first  # nothing else changed: kept, no write
    assert with_timestamp({**wanted, TIMESTAMP: "1"}, first, 1700000000) == first  # never taken from `wanted`
    moved = with_timestamp({**wanted, "nvidia.com/gpu.count": "7"}, first, 1700000000)
    assert moved[TIMESTAMP] == "1700000000"
    assert with_timestamp(wanted, {**wanted, TIMESTAMP: "not-a-number"}, 1700000000)[TIMESTAMP] == "1700000000"


def test_a_compute_instance_smaller_than_its_gpu_instance_is_labelled_as_its_own_profile() -> None:
    """GFD's MIG device attributes: memory and engines of the GPU instance, slices of both, the compute
    instance's multiprocessors; go-nvlib names such a device 1c.3g.40gb, as the plugin's resource."""
    cis = tuple(ComputeInstance(n, 0, "1c.3g.40gb", 1, (n, 1), 16, f"MIG-{n}", n) for n in range(3))
    gpu = _h100(MigState(True, True, True, (GpuInstance(2, 9, "3g.40gb", 3, (0, 4), 40448, cis),), PROFILES))
    labels = compute(Inventory("550.90.07", "12.4", (gpu,)), True, "mixed", None)
    assert {key: value for key, value in labels.items() if key.startswith("nvidia.com/mig-")} == {
        "nvidia.com/mig-1c.3g.40gb.count": "3", "nvidia.com/mig-1c.3g.40gb.memory": "40448",
        "nvidia.com/mig-1c.3g.40gb.multiprocessors": "16", "nvidia.com/mig-1c.3g.40gb.slices.gi": "3",
        "nvidia.com/mig-1c.3g.40gb.slices.ci": "1", "nvidia.com/mig-1c.3g.40gb.engines.copy": "3",
        "nvidia.com/mig-1c.3g.40gb.engines.decoder": "3", "nvidia.com/mig-1c.3g.40gb.engines.encoder": "0",
        "nvidia.com/mig-1c.3g.40gb.engines.jpeg": "3", "nvidia.com/mig-1c.3g.40gb.engines.ofa": "0",
        "nvidia.com/mig-1c.3g.40gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1c.3g.40gb",
        "nvidia.com/mig-1c.3g.40gb.replicas": "1", "nvidia.com/mig-1c.3g.40gb.sharing-strategy": "none"}
    assert labels["nvidia.com/gpu.replicas"] == "0"  # its one GPU has MIG on: GFD's gpu.* carry no sharing
