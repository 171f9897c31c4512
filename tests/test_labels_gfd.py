"""GFD's own label tables, replayed on the agent's labels: NVIDIA/k8s-device-plugin at commit
1b826acc6af3079d8923bac395c3124b8861a9a6, internal/lm/mig-strategy_test.go (TestMigStrategyNoneLabels,
TestMigStrategySingleLabels) and internal/lm/resource_test.go (TestGPUResourceLabeler,
TestMigResourceLabeler; their MPS rows are the MPS work's), internal/lm/nvml_test.go (TestGPUModeLabeler,
TestMigCapabilityLabeler) and internal/vgpu's mock config spaces. Each row keeps upstream's description.

Upstream's mocks (internal/resource/testing/resource-testing.go) are rebuilt as inventories: NewFullGPU is
a MOCKMODEL with 300 MiB and compute capability 8.0, MIG off; NewMigEnabledDevice a MOCKMODEL with MIG on
and compute capability 0.0 (so GFD writes no family or compute labels for it); NewMigDevice(gi, ci, gb,
attributes) a MIG device named <gi>g.<gb>gb of gi GPU-instance slices and ci compute-instance slices.
Only the labels GFD's resource labeler writes are compared (not versions, machine, mode and the like)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Optional

import pytest
from upstream_data import upstream_file

from gpu_agent.config.loader import validated
from gpu_agent.config.plugin import PluginConfig
from gpu_agent.host.paths import Root
from gpu_agent.host.pci import Vgpu, vgpu_of
from gpu_agent.kube.labels import compute, with_timestamp
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, Inventory, MigProfile, MigState
from gpu_agent.plugin.devices import advertised, sharing
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState

Mig = tuple[int, int, int, dict[str, int]]
ARCH = {"nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.family": "ampere"}
ENGINES = ("engines.copy", "engines.decoder", "engines.encoder", "engines.jpeg", "engines.ofa")


def full() -> Gpu:
    return Gpu(0, "GPU-0", "0000:00:00.0", "MOCKMODEL", 300, (8, 0), 0, MigState(False))


def mig_device(gi: int, ci: int, gb: int, **attributes: int) -> Mig:
    return gi, ci, gb, attributes


def mig_enabled(*devices: Mig) -> Gpu:
    instances, profiles = [], []
    for n, (gi, ci, gb, attributes) in enumerate(devices):
        name = f"{gi}g.{gb}gb"
        engines = [attributes.get(key, 0) for key in ENGINES]
        profiles.append(MigProfile(name, n, gi, 1, 0, gb, *engines, ()))
        multiprocessors = attributes.get("multiprocessors", 0)
        device = ComputeInstance(0, 0, name, ci, (0, ci), multiprocessors, f"MIG-{n}", n)
        instances.append(GpuInstance(n + 1, n, name, gi, (n, 1), gb, (device,)))
    return Gpu(0, "GPU-0", "0000:00:00.0", "MOCKMODEL", 300, (0, 0), 0,
               MigState(True, True, True, tuple(instances), tuple(profiles)))


def renumbered(gpus: list[Gpu]) -> tuple[Gpu, ...]:
    """Each its own index, UUID and MIG device UUIDs, as on a node."""
    found = []
    for index, gpu in enumerate(gpus):
        instances = tuple(
            GpuInstance(gi.id, gi.profile_id, gi.profile, gi.slices, gi.placement, gi.memory_mib, tuple(
                ComputeInstance(ci.id, ci.profile_id, ci.profile, ci.slices, ci.placement, ci.multiprocessors,
                                f"{ci.uuid}-{index}", ci.device_index) for ci in gi.compute_instances))
            for gi in gpu.mig.gpu_instances)
        mig = MigState(gpu.mig.capable, gpu.mig.enabled, gpu.mig.pending_enabled, instances, gpu.mig.profiles)
        found.append(Gpu(index, f"GPU-{index}", f"0000:{index:02x}:00.0", gpu.product, gpu.memory_mib,
                         gpu.compute_capability, index, mig))
    return tuple(found)


def resource_labels(gpus: list[Gpu], strategy: str, resources: Optional[list[dict[str, Any]]] = None,
                    keep: tuple[str, ...] = ("gpu.", "mig-", "mig.strategy")) -> dict[str, str]:
    """The labels GFD's NewResourceLabeler writes (what `keep` starts with), for `resources` as
    timeSlicing.resources. GFD's labeler honours `rename`, which its binary and the device plugin's turn
    off (DisableResourceNamingInConfig): the agent's opt-in plugin.per_resource_sharing does the same."""
    settings = validated(PluginConfig, {"per_resource_sharing": True,
                                        "sharing": {"timeSlicing": {"resources": resources}}} if resources else {})
    inventory = Inventory("400.300", "8.0", renumbered(gpus))
    labels = compute(inventory, True, strategy, None, sharing(inventory, strategy, settings))
    ignored = ("nvidia.com/gpu.machine", "nvidia.com/gpu.mode", "nvidia.com/gpu.present")
    return {key: value for key, value in labels.items()
            if key.startswith(tuple(f"nvidia.com/{k}" for k in keep)) and key not in ignored}


def gpu_labels(count: str, replicas: str, strategy: str, memory: str, product: str) -> dict[str, str]:
    return {"nvidia.com/gpu.count": count, "nvidia.com/gpu.replicas": replicas,
            "nvidia.com/gpu.sharing-strategy": strategy, "nvidia.com/gpu.memory": memory,
            "nvidia.com/gpu.product": product}


def mig_attributes(key: str, gi: int, ci: int, memory: int, multiprocessors: int = 0,
                   engines: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)) -> dict[str, str]:
    return {f"nvidia.com/{key}.memory": str(memory), f"nvidia.com/{key}.multiprocessors": str(multiprocessors),
            f"nvidia.com/{key}.slices.gi": str(gi), f"nvidia.com/{key}.slices.ci": str(ci),
            **{f"nvidia.com/{key}.{name}": str(n) for name, n in zip(ENGINES, engines)}}


TWO = [{"name": "nvidia.com/gpu", "replicas": 2}]
SINGLE = {"nvidia.com/mig.strategy": "single"}
INVALID = {**gpu_labels("0", "0", "", "0", "MOCKMODEL-MIG-INVALID"), **SINGLE}
BUSY = {"multiprocessors": 12, "engines.copy": 13, "engines.decoder": 14, "engines.encoder": 15,
        "engines.jpeg": 16, "engines.ofa": 17}


@pytest.mark.parametrize("description, gpus, resources, expected", [
    ("no devices returns empty labels", [], None, {}),
    ("single non-mig device returns non-mig (none) labels", [full()], None,
     {**ARCH, **gpu_labels("1", "1", "none", "300", "MOCKMODEL")}),
    ("sharing is applied to single device", [full()], TWO,
     {**ARCH, **gpu_labels("1", "2", "time-slicing", "300", "MOCKMODEL-SHARED")}),
    ("sharing is applied to multiple devices", [full(), full()], TWO,
     {**ARCH, **gpu_labels("2", "2", "time-slicing", "300", "MOCKMODEL-SHARED")}),
    ("sharing is not applied to single MIG device; replicas is zero", [mig_enabled()], TWO,
     gpu_labels("1", "0", "none", "300", "MOCKMODEL")),
    ("sharing is not applied to multiple MIG device; replicas is zero", [mig_enabled(), mig_enabled()], TWO,
     gpu_labels("2", "0", "none", "300", "MOCKMODEL")),
    ("sharing is applied to MIG device and non-MIG device", [mig_enabled(), full()], TWO,
     {**ARCH, **gpu_labels("2", "2", "time-slicing", "300", "MOCKMODEL-SHARED")}),
])
def test_gfd_mig_strategy_none(description: str, gpus: list[Gpu], resources: Any, expected: dict[str, str]) -> None:
    assert resource_labels(gpus, "none", resources) == expected, description


@pytest.mark.parametrize("description, gpus, expected", [
    ("no devices returns empty labels", [], {}),
    ("single non-mig device returns non-mig (none) labels", [full()],
     {**ARCH, **gpu_labels("1", "1", "none", "300", "MOCKMODEL"), **SINGLE}),
    ("multiple non-mig device returns non-mig (none) labels", [full(), full()],
     {**ARCH, **gpu_labels("2", "1", "none", "300", "MOCKMODEL"), **SINGLE}),
    ("single mig-enabled device returns mig labels", [mig_enabled(mig_device(1, 2, 100))],
     {**gpu_labels("1", "1", "none", "100", "MOCKMODEL-MIG-1g.100gb"), **SINGLE, **mig_attributes("gpu", 1, 2, 100)}),
    ("multiple mig-enabled devices returns mig labels",
     [mig_enabled(mig_device(1, 2, 100, **BUSY)), mig_enabled(mig_device(1, 2, 100, **BUSY))],
     {**gpu_labels("2", "1", "none", "100", "MOCKMODEL-MIG-1g.100gb"), **SINGLE,
      **mig_attributes("gpu", 1, 2, 100, 12, (13, 14, 15, 16, 17))}),
    ("empty mig devices returns MIG invalid label", [mig_enabled()], INVALID),
    ("mixed mig config returns MIG invalid label", [mig_enabled(mig_device(1, 2, 100), mig_device(3, 4, 100))],
     INVALID),
    ("mixed mig enabled and disabled returns invalid config", [mig_enabled(mig_device(1, 2, 100)), full()],
     {**ARCH, **INVALID}),
    ("enabled, disabled, and empty returns invalid config",
     [mig_enabled(mig_device(1, 2, 100)), full(), mig_enabled()], {**ARCH, **INVALID}),
])
def test_gfd_mig_strategy_single(description: str, gpus: list[Gpu], expected: dict[str, str]) -> None:
    assert resource_labels(gpus, "single", None) == expected, description


@pytest.mark.parametrize("description, resources, expected", [
    ("no sharing", None, gpu_labels("1", "1", "none", "300", "MOCKMODEL")),
    ("time-slicing ignores non-matching resource", [{"name": "nvidia.com/not-gpu", "replicas": 2}],
     gpu_labels("1", "1", "none", "300", "MOCKMODEL")),
    ("time-slicing appends suffix and doubles count", TWO,
     gpu_labels("1", "2", "time-slicing", "300", "MOCKMODEL-SHARED")),
    ("time-slicing renamed does not append suffix and doubles count",
     [{"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu.shared", "replicas": 2}],
     gpu_labels("1", "2", "time-slicing", "300", "MOCKMODEL")),
])
def test_gfd_gpu_resource_labeler(description: str, resources: Any, expected: dict[str, str]) -> None:
    assert resource_labels([full()], "none", resources) == {**ARCH, **expected}, description


# Upstream hands NewMIGResourceLabeler the name mig-1g.1gb for a 1g.300gb device; the agent names a MIG
# resource after its device, as the plugin advertises it, so the mixed rows here use mig-1g.300gb.
@pytest.mark.parametrize("description, strategy, resources, key, replicas, product", [
    ("no sharing", "single", None, "gpu", "1", "MOCKMODEL-MIG-1g.300gb"),
    ("shared appends suffix and doubles count", "single", TWO, "gpu", "2", "MOCKMODEL-MIG-1g.300gb-SHARED"),
    ("renamed does not append suffix and doubles count", "single",
     [{"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu.shared", "replicas": 2}], "gpu", "2",
     "MOCKMODEL-MIG-1g.300gb"),
    ("mig mixed appends shared", "mixed",
     [{"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu.shared", "replicas": 2},
      {"name": "nvidia.com/mig-1g.300gb", "replicas": 2}], "mig-1g.300gb", "2", "MOCKMODEL-MIG-1g.300gb-SHARED"),
    ("mig mixed rename does not append", "mixed",
     [{"name": "nvidia.com/mig-1g.300gb", "rename": "nvidia.com/mig-1g.300gb.shared", "replicas": 2}],
     "mig-1g.300gb", "2", "MOCKMODEL-MIG-1g.300gb"),
])
def test_gfd_mig_resource_labeler(description: str, strategy: str, resources: Any, key: str, replicas: str,
                                  product: str) -> None:
    expected = {f"nvidia.com/{key}.count": "1", f"nvidia.com/{key}.replicas": replicas,
                f"nvidia.com/{key}.sharing-strategy": "time-slicing" if replicas != "1" else "none",
                f"nvidia.com/{key}.product": product, **mig_attributes(key, 1, 2, 300)}
    labels = resource_labels([mig_enabled(mig_device(1, 2, 300))], strategy, resources, keep=(f"{key}.",))
    assert labels == expected, description


def test_under_mig_strategy_none_the_plugin_still_replicates_a_mig_enabled_gpu() -> None:
    """GFD labels a MIG-enabled GPU replicas 0 under mig.strategy none, yet NVIDIA's plugin shares it:
    internal/rm/device_map.go buildGPUDeviceMap keeps MIG-enabled GPUs under none, and
    updateDeviceMapWithReplicas replicates every device of the resource. The agent does both as upstream."""
    inventory = Inventory("400.300", "8.0", renumbered([mig_enabled(mig_device(1, 1, 100)), mig_enabled()]))
    settings = validated(PluginConfig, {"sharing": {"timeSlicing": {"resources": TWO}}})
    served = advertised(inventory, {}, "none", settings)
    assert [device.id for device in served.resources["nvidia.com/gpu"].devices] == [
        "GPU-0::0", "GPU-0::1", "GPU-1::0", "GPU-1::1"]
    labels = compute(inventory, True, "none", None, sharing(inventory, "none", settings))
    assert labels["nvidia.com/gpu.replicas"] == "0" and labels["nvidia.com/gpu.product"] == "MOCKMODEL"


def test_a_sharing_resource_the_node_lacks_is_ignored_and_said_so() -> None:
    settings = validated(PluginConfig, {"sharing": {"timeSlicing": {"resources": [
        {"name": "not-gpu", "replicas": 2}, {"name": "nvidia.com/mig-1c.3g.40gb", "replicas": 3}, *TWO]}}})
    inventory = Inventory("400.300", "8.0", renumbered([full(), full()]))
    served = advertised(inventory, {}, "none", settings)
    assert list(served.resources) == ["nvidia.com/gpu"] and served.resources["nvidia.com/gpu"].replicas == 2
    assert sorted(served.ignored) == ["nvidia.com/mig-1c.3g.40gb", "nvidia.com/not-gpu"]
    assert "matches no device of this node with mig.strategy none" in served.ignored["nvidia.com/not-gpu"]


# GFD's expected label files for the MIG strategies (tests/expected-output-mig-*.txt, read from
# ../shared/upstream), checked both ways as test_labels.py checks the others.


@pytest.mark.parametrize("strategy, gpus", [
    ("single", [mig_enabled(mig_device(3, 3, 20)), mig_enabled(mig_device(3, 3, 20))]),
    ("mixed", [mig_enabled(mig_device(3, 3, 20), mig_device(1, 1, 5))]),
])
def test_the_labels_match_gfds_expected_mig_output(strategy: str, gpus: list[Gpu]) -> None:
    inventory = Inventory("550.90.07", "12.4", tuple(
        Gpu(g.index, g.uuid, g.pci_bus_id, "NVIDIA A100-SXM4-40GB", 40960, (8, 0), g.index, g.mig)
        for g in renumbered(gpus)))
    labels = with_timestamp(compute(inventory, True, strategy, "DGX A100"), {}, 1724632719.6)
    lines = [f"{k}={v}" for k, v in labels.items() if not k.startswith("nvidia.com/gpu-agent.")
             and k != "nvidia.com/gpu.present"]
    text = upstream_file("k8s-device-plugin", f"tests/expected-output-mig-{strategy}.txt").read_text()
    expected = [re.compile(line) for line in text.rstrip("\n").split("\n")]
    assert [line for line in lines if not any(r.search(line) for r in expected)] == []
    assert [r.pattern for r in expected if not any(r.search(line) for line in lines)] == []


# GFD's other labelers. internal/lm/nvml_test.go TestGPUModeLabeler: the PCI classes of the node's GPUs
# (its NewDeviceWithPCIClassMock) and the gpu.mode GFD writes (its rows' descriptions swap "compute" and
# "graphics"; the classes and values are what count). A class that cannot be read: GFD's "unknown".
@pytest.mark.parametrize("classes, mode", [
    ([0x030000], "graphics"), ([0x030200], "compute"), ([0x068000], "unknown"),
    ([0x030200] * 3, "compute"), ([0x030000] * 3, "graphics"), ([0x030000, 0x030200, 0x030000], "unknown"),
    ([0x030200, None], "unknown"),
])
def test_gfd_gpu_mode_labeler(classes: list[Optional[int]], mode: str) -> None:
    gpus = tuple(dataclasses.replace(gpu, pci_class=pci_class)
                 for gpu, pci_class in zip(renumbered([full()] * len(classes)), classes))
    assert compute(Inventory("400.300", "8.0", gpus), True, "none", None)["nvidia.com/gpu.mode"] == mode


# nvml_test.go TestMigCapabilityLabeler: mig.capable is true when any GPU can do MIG.
@pytest.mark.parametrize("gpus, capable", [
    ([full()], "false"), ([full(), full()], "false"), ([mig_enabled()], "true"), ([full(), mig_enabled()], "true"),
])
def test_gfd_mig_capability_labeler(gpus: list[Gpu], capable: str) -> None:
    labels = compute(Inventory("400.300", "8.0", renumbered(gpus)), True, "none", None)
    assert labels["nvidia.com/mig.capable"] == capable


def test_gpu_count_is_of_the_model_labeled() -> None:
    """mig-strategy.go newGPULabelers counts GPUs by name, MIG-enabled ones too, and each model's labeler
    writes its own count: on a node of two models gpu.count is the labeled model's, never the sum."""
    other = dataclasses.replace(full(), product="OTHERMODEL", memory_mib=100)
    labels = compute(Inventory("400.300", "8.0", renumbered([full(), other, full(), mig_enabled()])), True,
                     "none", None)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == ("MOCKMODEL", "3")


# GFD's internal/vgpu/pciutil.go NewMockNvidiaPCI (NVIDIA/k8s-device-plugin 1b826acc6af3079d8923bac395c3124b8861a9a6)
# holds two config spaces, read by its pciutil_test.go and vgpu_test.go. What those tests depend on, built
# here from the facts of its bytes: a passed-through GPU (device 0x118a; status 0x0010; capabilities at 0x60
# power management, 0x68 MSI, 0x78 PCI Express, 0xb4 vendor-specific of 20 bytes whose signature bytes are
# 01 00, not "VF") and a vGPU guest (device 0x1eb8; status 0x06ff; capabilities at 0xd0 vendor-specific of
# 27 bytes signed "VF", then 0x68 MSI ending the list; in the vendor capability, at offset 5, record 0 of
# 22 bytes whose two NUL-padded 10-byte fields are the host driver's version 460.16 and branch r460_00).
def _config_space(device: int, status: int, capabilities: dict[int, bytes], first: int) -> bytes:
    """256 bytes of config space: NVIDIA's vendor id, the device, the status, a 3D controller's class, and
    each capability's bytes (its id, its next pointer, its body) at its offset, the list starting at `first`."""
    space = bytearray(256)
    space[0:4] = (0x10DE).to_bytes(2, "little") + device.to_bytes(2, "little")
    space[6:8] = status.to_bytes(2, "little")
    space[0x0B] = 0x03
    space[0x34] = first
    for offset, body in capabilities.items():
        space[offset:offset + len(body)] = body
    return bytes(space)


def _vendor_capability(next_pointer: int, length: int, signature: bytes, records: bytes) -> bytes:
    return bytes([0x09, next_pointer, length]) + signature + records


PASSTHROUGH = _config_space(0x118A, 0x0010, {
    0x60: b"\x01\x68\x03\x00", 0x68: b"\x05\x78\x81\x00", 0x78: b"\x10\xb4\x02\x00",
    0xB4: _vendor_capability(0x00, 20, b"\x01\x00", b"")}, first=0x60)
VGPU_GUEST = _config_space(0x1EB8, 0x06FF, {
    0xD0: _vendor_capability(0x68, 27, b"VF", b"\x00\x16" + b"460.16".ljust(10, b"\0") + b"r460_00".ljust(10, b"\0")),
    0x68: b"\x05\x00\x81\x00"}, first=0xD0)


def test_gfd_vgpu_capability_from_pci_config_space() -> None:
    passthrough, guest = PASSTHROUGH, VGPU_GUEST
    assert len(passthrough) == len(guest) == 256
    assert vgpu_of(passthrough) == Vgpu(False)
    assert vgpu_of(guest) == Vgpu(True, "460.16", "r460_00")
    assert vgpu_of(guest[:64]) is None  # not all read (unprivileged): GFD writes no vgpu labels
    looping = bytearray(passthrough)
    looping[0x34], looping[0x60:0x62] = 0x60, b"\x01\x60"
    assert vgpu_of(bytes(looping)) == Vgpu(False)
    stuck = bytearray(guest)  # a record of length 0, on which GFD's walk never ends
    stuck[guest.index(b"VF") + 2:guest.index(b"VF") + 4] = b"\x01\x00"
    assert vgpu_of(bytes(stuck)) == Vgpu(True)


def test_gfd_vgpu_labels() -> None:
    """internal/lm/vgpu.go: vgpu.present on every node whose GPUs' config space could be read, and on a vGPU
    guest the version and branch of the host's vGPU manager."""
    def labels(*found: Optional[Vgpu]) -> dict[str, str]:
        gpus = tuple(dataclasses.replace(gpu, vgpu=v) for gpu, v in zip(renumbered([full()] * len(found)), found))
        return {k: v for k, v in compute(Inventory("400.300", "8.0", gpus), True, "none", None).items()
                if k.startswith("nvidia.com/vgpu.")}
    assert labels(Vgpu(False), Vgpu(False)) == {"nvidia.com/vgpu.present": "false"}
    assert labels(Vgpu(True, "460.16", "r460_00")) == {
        "nvidia.com/vgpu.present": "true", "nvidia.com/vgpu.host-driver-version": "460.16",
        "nvidia.com/vgpu.host-driver-branch": "r460_00"}
    assert labels(Vgpu(False), None) == {}


def test_the_simulated_gpus_are_3d_controllers_without_vgpu(tmp_path: Path) -> None:
    """The simulator's sysfs gives each GPU its class and config space; discovery reads both."""
    state = MachineState(Root(tmp_path))
    state.ensure("dgx-a100")
    root = Root(tmp_path).with_kernel(state.kernel_dir)
    SimModprobe(state, root).load("nvidia")
    gpus = Nvml(FakeNvml(state), root=root).inventory.read().gpus
    assert {(gpu.pci_class, gpu.vgpu) for gpu in gpus} == {(0x030200, Vgpu(False))}
    labels = compute(Inventory("550.90.07", "12.4", gpus), True, "none", None)
    assert (labels["nvidia.com/gpu.mode"], labels["nvidia.com/vgpu.present"]) == ("compute", "false")
