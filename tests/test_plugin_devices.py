"""The device plugin's decisions, in-process: what it advertises per MIG strategy and sharing config,
what Allocate answers, the plugin config section and the sharing labels."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

import pytest

from gpu_agent.config.loader import parse_config, validated
from gpu_agent.config.plugin import PluginConfig, mig_strategy
from gpu_agent.errors import ConfigError
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import compute
from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuHealth, GpuInstance, Inventory, MigState
from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import GPU_RESOURCE, advertised, mig_resource, sharing
from gpu_agent.sim.profiles import MODELS, GiProfile, GpuModel
from gpu_agent.toolkit import cdi

from harness import SimNode


def gpu(index: int, *profiles: str) -> Gpu:
    """An H100; with profiles, in MIG mode with one MIG device per profile."""
    instances = tuple(
        GpuInstance(n + 1, 0, profile, 1, (n, 1), 40448,
                    (ComputeInstance(0, 0, profile, 1, (0, 1), 60, f"MIG-{index:04d}{n:04d}-0000-0000-0000", n),))
        for n, profile in enumerate(profiles))
    mig = MigState(True, bool(profiles), bool(profiles), instances)
    return Gpu(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", f"00000000:{0x18 + index:02X}:00.0",
               "NVIDIA H100 80GB HBM3", 81559, (9, 0), index, mig)


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory("550.90.07", "12.4", gpus)


EIGHT = inventory(*(gpu(i) for i in range(8)))


def plugin(**settings: Any) -> PluginConfig:
    return validated(PluginConfig, settings)


def ads(inv: Optional[Inventory], strategy: str = "none", settings: Optional[PluginConfig] = None,
        health: Optional[dict[str, GpuHealth]] = None, unavailable: str = "") -> Any:
    return advertised(inv, health or {}, strategy, settings or plugin(), unavailable)


def ids(result: Any, name: str = GPU_RESOURCE) -> list[str]:
    return [device.id for device in result.resources[name].devices]


# --- what is advertised --------------------------------------------------------------------------------------

def test_strategy_none_is_one_device_per_gpu_uuid() -> None:
    result = ads(EIGHT)
    assert list(result.resources) == [GPU_RESOURCE] and ids(result) == [g.uuid for g in EIGHT.gpus]
    assert result.resources[GPU_RESOURCE].socket_name == "nvidia-gpu.sock"


def test_nothing_is_advertised_without_an_inventory_or_without_gpus() -> None:
    failing = ads(None, unavailable="NVML failed: driver not loaded")
    assert failing.resources == {} and failing.reason == "NVML failed: driver not loaded"
    assert ads(inventory()).resources == {} and "no GPU" in ads(inventory()).reason


def test_mixed_strategy_names_mig_profiles_and_keeps_whole_gpus() -> None:
    node = inventory(gpu(0, "3g.40gb", "3g.40gb"), gpu(1, "1g.10gb+me"), gpu(2))
    result = ads(node, "mixed")
    assert sorted(result.resources) == [GPU_RESOURCE, "nvidia.com/mig-1g.10gb.me", "nvidia.com/mig-3g.40gb"]
    assert ids(result) == [node.gpus[2].uuid]
    assert ids(result, "nvidia.com/mig-3g.40gb") == [d.uuid for d in node.gpus[0].mig.devices]
    assert result.resources["nvidia.com/mig-1g.10gb.me"].socket_name == "nvidia-mig-1g.10gb.me.sock"
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"


# A GPU for the test alone, not a product: 4 slices, with a profile of each kind of suffix NVML has
# (Blackwell's), named as NVML and go-nvlib name them. Ids, counts and sizes are made up.
SUFFIXED = GpuModel(
    key="test-suffixed-profiles", name="NVIDIA test GPU with suffixed MIG profiles", memory_mib=97887,
    compute_capability=(12, 0), pci_device_id=0x2BB510DE, idle_temp_c=30, idle_power_w=40, max_power_w=600,
    mig_profiles=tuple(
        GiProfile(f"NVML_GPU_INSTANCE_PROFILE_{constant}", id, f"MIG {name}", slices, instances, 46 * slices,
                  24064 * slices, slices, slices, 0, slices, 0, starts, slices)
        for constant, id, name, slices, instances, starts in (
            ("1_SLICE", 19, "1g.24gb", 1, 4, (0, 1, 2, 3)),
            ("1_SLICE_REV1", 20, "1g.24gb+me", 1, 1, (0, 1, 2, 3)),
            ("1_SLICE_GFX", 47, "1g.24gb+gfx", 1, 4, (0, 1, 2, 3)),
            ("1_SLICE_NO_ME", 48, "1g.24gb-me", 1, 4, (0, 1, 2, 3)),
            ("1_SLICE_ALL_ME", 49, "1g.24gb+me.all", 1, 1, (0, 1, 2, 3)),
            ("2_SLICE", 14, "2g.48gb", 2, 2, (0, 2)),
            ("2_SLICE_GFX", 50, "2g.48gb+gfx", 2, 2, (0, 2)),
            ("4_SLICE", 5, "4g.96gb", 4, 1, (0,)))))


def test_mig_profiles_with_suffixes_are_read_and_advertised_as_their_own_resources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device plugin v0.20 (#1807): `-me`, `+me.all` and `+gfx` MIG devices are resources of their own, never
    the base profile's. Read through NVML from the simulator, as on a node."""
    monkeypatch.setitem(MODELS, SUFFIXED.key, SUFFIXED)
    machine = tmp_path / "suffixed.yaml"
    machine.write_text(f"name: suffixed\ngpus:\n"
                       f"  - model: {SUFFIXED.key}\n    mig: {{enabled: true, devices: [1g.24gb, 1g.24gb-me, "
                       f"1g.24gb+me.all, 1g.24gb+gfx]}}\n"
                       f"  - model: {SUFFIXED.key}\n    mig: {{enabled: true, devices: [2g.48gb+gfx, 2g.48gb]}}\n")
    state = SimNode(tmp_path / "root", str(machine)).apply({"toolkit": {"enabled": False},
                                                            "mig": {"strategy": "mixed"}}).state
    assert state.inventory is not None
    result = ads(state.inventory, "mixed")
    by_profile = {name: [device.gpu_index for device in resource.devices]
                  for name, resource in result.resources.items()}
    assert by_profile == {"nvidia.com/mig-1g.24gb": [0], "nvidia.com/mig-1g.24gb-me": [0],
                          "nvidia.com/mig-1g.24gb.me.all": [0], "nvidia.com/mig-1g.24gb.gfx": [0],
                          "nvidia.com/mig-2g.48gb.gfx": [1], "nvidia.com/mig-2g.48gb": [1]}
    assert result.resources["nvidia.com/mig-1g.24gb.me.all"].socket_name == "nvidia-mig-1g.24gb.me.all.sock"


def test_single_strategy_needs_one_profile_on_every_gpu() -> None:
    uniform = inventory(gpu(0, "3g.40gb", "3g.40gb"), gpu(1, "3g.40gb", "3g.40gb"))
    assert len(ids(ads(uniform, "single"))) == 4
    mixed = ads(inventory(gpu(0, "3g.40gb"), gpu(1, "1g.10gb")), "single")
    assert mixed.resources == {} and "2 profiles (1g.10gb, 3g.40gb)" in mixed.withheld[GPU_RESOURCE]
    assert mixed.reason == mixed.withheld[GPU_RESOURCE]
    partial = ads(inventory(gpu(0, "3g.40gb"), gpu(1)), "single")
    assert partial.resources == {} and "GPUs 1 have no MIG device" in partial.withheld[GPU_RESOURCE]
    assert ids(ads(EIGHT, "single")) == [g.uuid for g in EIGHT.gpus]  # no MIG at all: whole GPUs


def test_time_slicing_replicas_rename_and_per_gpu_counts() -> None:
    four = plugin(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})
    result = ads(EIGHT, settings=four)
    assert len(ids(result)) == 32 and ids(result)[:4] == [f"{EIGHT.gpus[0].uuid}::{n}" for n in range(4)]
    assert result.resources[GPU_RESOURCE].shared

    block = {"timeSlicing": {"renameByDefault": True, "resources": [{"name": "gpu", "replicas": 2, "devices": [0, 1]}]}}
    as_nvidia = ads(EIGHT, settings=plugin(sharing=block))  # NVIDIA's plugin ignores devices: every GPU shared
    assert len(ids(as_nvidia, "nvidia.com/gpu.shared")) == 16 and GPU_RESOURCE not in as_nvidia.resources
    renamed = plugin(sharing=block, per_resource_sharing=True)
    result = ads(EIGHT, settings=renamed)
    assert len(ids(result, "nvidia.com/gpu.shared")) == 4 and len(ids(result)) == 6  # GPUs 2-7 unshared

    per_gpu = plugin(gpu_replicas={0: 8, EIGHT.gpus[1].uuid: 3, "2": 1},
                     sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}})
    counts: dict[str, int] = {}
    for device in ads(EIGHT, settings=per_gpu).resources[GPU_RESOURCE].devices:
        counts[device.gpu_uuid] = counts.get(device.gpu_uuid, 0) + 1
    assert [counts[g.uuid] for g in EIGHT.gpus] == [8, 3, 1, 2, 2, 2, 2, 2]


def test_a_sick_mig_device_or_its_sick_gpu_marks_it_unhealthy() -> None:
    node = inventory(gpu(0, "3g.40gb", "3g.40gb"), gpu(1, "3g.40gb", "3g.40gb"))
    first, second = (d.uuid for d in node.gpus[0].mig.devices)
    own = ads(node, "mixed", health={first: GpuHealth(xid_reason="XID 94")}).resources["nvidia.com/mig-3g.40gb"]
    assert [d.id for d in own.devices if not d.healthy] == [first]
    whole = ads(node, "mixed", health={node.gpus[0].uuid: GpuHealth(xid_reason="XID 79")})
    assert sorted(d.id for d in whole.resources["nvidia.com/mig-3g.40gb"].devices if not d.healthy) == sorted(
        [first, second])


def test_one_sick_gpu_marks_only_its_devices_and_each_device_has_its_gpus_numa_node() -> None:
    sick = {EIGHT.gpus[2].uuid: GpuHealth(xid_reason="XID 79 (fallen off the bus)", lost=True)}
    four = plugin(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})
    devices = ads(EIGHT, settings=four, health=sick).resources[GPU_RESOURCE].devices
    assert sorted(d.id for d in devices if not d.healthy) == [f"{EIGHT.gpus[2].uuid}::{n}" for n in range(4)]
    placed = inventory(*(dataclasses.replace(g, numa_node=None if g.index == 7 else g.index // 4) for g in EIGHT.gpus))
    assert [d.numa_node for d in ads(placed).resources[GPU_RESOURCE].devices] == [0, 0, 0, 0, 1, 1, 1, None]


def test_a_gpu_known_by_its_identity_alone_is_a_whole_gpu_only_where_mig_plays_no_part() -> None:
    """Issue 33: a GPU NVML cannot read, never read whole since the agent started (its MIG state unknown), is
    listed (Unhealthy by its health) under mig.strategy none, and left out under single and mixed rather than
    guessed at: single goes on with the MIG devices of the others, instead of withholding the resource."""
    unknown = dataclasses.replace(gpu(3), mig=MigState(False), known_from="identity only",
                                  unreadable="nvmlDeviceGetHandleByIndex: GPU is lost")
    migs = [gpu(i, "3g.40gb", "3g.40gb") for i in range(3)]
    node = inventory(*migs, unknown)
    assert ids(ads(node)) == [g.uuid for g in node.gpus]
    assert ids(ads(node, "single")) == [d.uuid for g in migs for d in g.mig.devices]
    assert list(ads(node, "mixed").resources) == [mig_resource("3g.40gb")]


def test_a_gpu_failing_a_periodic_check_is_advertised_unhealthy_with_the_checks_reason() -> None:
    """health/checks.py puts a failing periodic check (row remaps, temperature) into the GPU's health."""
    reason = "row-remap-failure: row remapping failed (no spare rows left): replace the GPU"
    failing = {EIGHT.gpus[5].uuid: GpuHealth(check_reason=reason)}
    devices = ads(EIGHT, health=failing).resources[GPU_RESOURCE].devices
    assert [(d.id, d.reason) for d in devices if not d.healthy] == [(EIGHT.gpus[5].uuid, reason)]


# --- Allocate ------------------------------------------------------------------------------------------------

def test_allocate_in_each_list_strategy() -> None:
    resource = ads(EIGHT).resources[GPU_RESOURCE]
    a, b = EIGHT.gpus[1].uuid, EIGHT.gpus[4].uuid
    assert allocate(resource, [a, b], "cdi-cri", False).cdi_devices == (f"nvidia.com/gpu={a}", f"nvidia.com/gpu={b}")
    annotations = allocate(resource, [a, b], "cdi-annotations", False).annotations
    (key, value), = annotations.items()
    assert key.startswith("cdi.k8s.io/gpu-agent_") and len(key.split("/")[1]) <= 63
    assert value == f"nvidia.com/gpu={a},nvidia.com/gpu={b}"
    assert allocate(resource, [a], "envvar", False).envs == {"NVIDIA_VISIBLE_DEVICES": a}


def test_allocate_refuses_unknown_unhealthy_and_too_large_shared_requests() -> None:
    resource = ads(EIGHT).resources[GPU_RESOURCE]
    with pytest.raises(AllocationError, match="unknown device 'GPU-nope' for nvidia.com/gpu"):
        allocate(resource, [EIGHT.gpus[0].uuid, "GPU-nope"], "cdi-cri", False)
    sick = ads(EIGHT, health={EIGHT.gpus[3].uuid: GpuHealth(xid_reason="XID 48")}).resources[GPU_RESOURCE]
    unhealthy = f"{EIGHT.gpus[3].uuid} of nvidia.com/gpu \\(GPU 3\\) is unhealthy: XID 48"
    with pytest.raises(AllocationError, match=unhealthy):
        allocate(sick, [EIGHT.gpus[3].uuid], "cdi-cri", False)
    shared = ads(EIGHT, settings=plugin(gpu_replicas={"0": 2})).resources[GPU_RESOURCE]
    two = [f"{EIGHT.gpus[0].uuid}::0", f"{EIGHT.gpus[0].uuid}::1"]
    with pytest.raises(AllocationError, match="maximum request size for shared resources is 1"):
        allocate(shared, two, "cdi-cri", True)
    # without the flag, two replicas of one GPU give that GPU once
    assert allocate(shared, two, "envvar", False).envs == {"NVIDIA_VISIBLE_DEVICES": EIGHT.gpus[0].uuid}
    # Only replicas count, as NVIDIA's check looks for them: two GPUs out of sharing pass, one beside a replica not.
    whole = [EIGHT.gpus[1].uuid, EIGHT.gpus[2].uuid]
    assert allocate(shared, whole, "envvar", True).envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(whole)}
    with pytest.raises(AllocationError, match="; found 2$"):
        allocate(shared, [EIGHT.gpus[1].uuid, two[0]], "envvar", True)


def test_every_allocated_name_is_a_device_of_the_cdi_spec(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100", {"toolkit": {"enabled": False}})
    (node.root / "etc/gpu-agent").mkdir(parents=True)
    (node.root / "etc/gpu-agent/mig.yaml").write_text(
        "version: v1\nmig-configs:\n  half:\n    - devices: [0, 1, 2, 3]\n      mig-enabled: true\n"
        "      mig-devices: {3g.40gb: 2}\n    - devices: [4, 5, 6, 7]\n      mig-enabled: false\n")
    state = node.apply({"toolkit": {"enabled": False}, "mig": {"config": "half"}}).state
    assert state.inventory is not None
    root = Root(node.root).with_kernel(node.machine.kernel_dir)
    spec = cdi.build_spec(state.inventory, root, cdi.discover(root, state.inventory.driver_version))
    names = {f"{spec['kind']}={device['name']}" for device in spec["devices"]}
    four = plugin(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4},
                                                         {"name": "nvidia.com/mig-3g.40gb", "replicas": 2}]}})
    result = ads(state.inventory, "mixed", four)
    assert {name: len(r.devices) for name, r in result.resources.items()} == {
        GPU_RESOURCE: 16, "nvidia.com/mig-3g.40gb": 16}
    for resource in result.resources.values():
        for device in resource.devices:
            assert set(allocate(resource, [device.id], "cdi-cri", False).cdi_devices) <= names


# --- config and labels ---------------------------------------------------------------------------------------

NVIDIA_BLOCK = """version: v1
plugin:
  device_list_strategy: envvar
  sharing:
    timeSlicing:
      renameByDefault: false
      failRequestsGreaterThanOne: true
      resources:
      - name: nvidia.com/gpu
        replicas: 10
"""


def test_nvidia_sharing_block_pasted_unchanged() -> None:
    config = parse_config(NVIDIA_BLOCK, "config.yaml")
    slicing = config.plugin.sharing.time_slicing
    assert slicing.fail_requests_greater_than_one and slicing.resources[0].replicas == 10
    assert config.plugin.device_list_strategy == "envvar"


@pytest.mark.parametrize("text, error", [
    (NVIDIA_BLOCK.replace("replicas: 10", "replicas: 0"), "config.yaml:10: plugin.sharing.timeSlicing.resources.0."
                                                          "replicas: Input should be greater than or equal to 2"),
    (NVIDIA_BLOCK.replace("nvidia.com/gpu", "amd.com/gpu"), "config.yaml:9: plugin.sharing.timeSlicing.resources.0."
                                                            "name: 'amd.com/gpu' is not a resource name"),
    (NVIDIA_BLOCK.replace("renameByDefault", "renameByDefualt"), "config.yaml:6: plugin.sharing.timeSlicing."
                                                                 "renameByDefualt: unknown key"),
    ("version: v1\nplugin:\n  sharing:\n    mps:\n      resources: []\n",
     "config.yaml:4: plugin.sharing.mps: no resources specified"),
    ("version: v1\nplugin:\n  gpu_replicas:\n    first: 2\n", "config.yaml:3: plugin.gpu_replicas: key 'first'"),
    ("version: v1\nplugin:\n  device_list_strategy: volume-mounts\n", "config.yaml:3: plugin.device_list_strategy"),
    ("version: v1\nmig:\n  strategy: mixed\nkubernetes:\n  mig_strategy: single\n",
     "config.yaml:5: kubernetes.mig_strategy: deprecated alias of mig.strategy"),
])
def test_plugin_config_errors_name_the_line_and_key(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "config.yaml")
    assert error in str(caught.value)


def test_the_deprecated_mig_strategy_still_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_config("version: v1\nkubernetes:\n  mig_strategy: mixed\n", "config.yaml")
    assert mig_strategy(config) == "mixed"
    assert "config.yaml:3: kubernetes.mig_strategy: deprecated: write mig.strategy: mixed instead" in caplog.text
    assert mig_strategy(parse_config("version: v1\n", "c")) == "none"


def test_sharing_labels_follow_gfd() -> None:
    four = plugin(sharing={"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}})
    labels = compute(EIGHT, True, "none", None, sharing(EIGHT, "none", four))
    assert labels["nvidia.com/gpu.replicas"] == "4" and labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    renamed = plugin(gpu_replicas={"0": 2, "1": 3}, sharing={"timeSlicing": {
        "renameByDefault": True, "resources": [{"name": "other", "replicas": 2}]}})
    labels = compute(EIGHT, True, "none", None, sharing(EIGHT, "none", renamed))
    assert labels["nvidia.com/gpu.replicas"] == "2" and labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    plain = compute(EIGHT, True, "none", None, sharing(EIGHT, "none", plugin()))
    assert plain["nvidia.com/gpu.replicas"] == "1" and plain["nvidia.com/gpu.sharing-strategy"] == "none"
