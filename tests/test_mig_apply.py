"""MIG geometry applied in-process to simulated A100-40GB, A100-80GB, H100, H200 and A30 GPUs: the
geometry matches, re-applying makes no NVML mutation, one GPU's change touches only it, impossible
geometries and busy GPUs are refused with nothing changed, an NVML failure mid-apply puts the GPU's
previous geometry back, dry runs change nothing, and an export applies back unchanged."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from upstream_data import upstream_file
import yaml

from gpu_agent.host.paths import Root
from gpu_agent.host.ledger import Ledger
from gpu_agent.mig.apply import FAILED, PENDING, REBOOTING, SUCCESS, Applier, GpuResult, node_state
from gpu_agent.mig.checkpoint import Checkpoint, CheckpointStore
from gpu_agent.mig.config import MigConfigFile, load_mig_config, parse_mig_config
from gpu_agent.mig.export import export, geometry
from gpu_agent.mig.hooks import Hooks
from gpu_agent.mig.planner import not_applied, plans_for
from gpu_agent.mig.profile import parse_profile
from gpu_agent.mig.reset import NvidiaSmiReset, ResetImpossible
from gpu_agent.nvml.client import Nvml
from gpu_agent.plan import CreateComputeInstance, CreateGpuInstance, DestroyComputeInstance, DestroyGpuInstance
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mig import SimGpuReset, reboot, reload_driver
from gpu_agent.sim.services import SimUnits, install_unit
from gpu_agent.sim.profiles import MODELS

SHIPPED = Path(__file__).resolve().parent.parent / "packaging" / "mig.yaml"
MUTATIONS = ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
             "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
             "nvmlGpuInstanceDestroy", "nvmlComputeInstanceDestroy")
# One GPU of each MIG model the simulator knows: the shipped device filters pick each one's entries.
MIG_MODELS = ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-80GB-HBM3", "H200", "A30")
EVERY_MODEL = "".join(f"  - model: {model}\n" for model in MIG_MODELS)
EVERY_MODEL_NODE = "gpus:\n" + EVERY_MODEL + "  - model: T4\n"
H100_X4 = "gpus:\n  - model: H100-80GB-HBM3\n    count: 4\n"  # DGX H100's GPUs, fewer of them (faster)


@dataclass
class Node:
    machine: MachineState
    fake: FakeNvml
    nvml: Nvml
    root: Root

    def mutations(self) -> int:
        return sum(self.fake.calls[name] for name in MUTATIONS)

    def gpus(self) -> Any:
        return self.nvml.inventory.read().gpus

    def apply(self, file: MigConfigFile, name: str, dry_run: bool = False, force: bool = False,
              hooks: Optional[Hooks] = None) -> list[GpuResult]:
        applier = Applier(self.nvml, SimGpuReset(self.machine), CheckpointStore(self.root), self.root, force=force)
        gpus = self.gpus()
        return applier.apply_all(gpus, plans_for(gpus, file.select(name)), dry_run=dry_run, hooks=hooks)

    def layout(self, index: int) -> tuple[Any, ...]:
        """A GPU's geometry by placements and profiles (MIG device UUIDs change when instances are remade)."""
        mig = self.gpus()[index].mig
        return (mig.enabled, tuple((gi.profile, gi.placement, tuple((ci.profile, ci.placement) for ci in
                                                                    gi.compute_instances))
                                   for gi in mig.gpu_instances))

    def uuids(self, index: int) -> list[str]:
        return [device.uuid for device in self.gpus()[index].mig.devices]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Nvml] = []

    def make(spec: str) -> Node:
        home = tmp_path / f"node{len(made)}"  # each node its own root
        home.mkdir()
        if "\n" in spec:
            (home / "machine.yaml").write_text(spec)
            spec = str(home / "machine.yaml")
        machine = MachineState(Root(home))
        machine.ensure(spec)
        root = Root(home).with_kernel(machine.kernel_dir)
        SimModprobe(machine, root).load("nvidia")
        fake = FakeNvml(machine)
        nvml = Nvml(fake, call_timeout=10)
        made.append(nvml)
        return Node(machine, fake, nvml, root)

    yield make
    for nvml in made:
        nvml.close()


def config(devices: dict[str, int], gpus: Any = "all", enabled: bool = True, name: str = "test") -> MigConfigFile:
    entry = {"devices": gpus, "mig-enabled": enabled}
    if enabled:
        entry["mig-devices"] = devices
    return parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {name: [entry]}}), "test.yaml")


def fits(gpu: Any, wanted: dict[str, int]) -> bool:
    have = {p.name for p in gpu.mig.profiles}
    return all(parse_profile(name).gpu_instance in have for name in wanted)


@pytest.mark.slow  # a sweep; the other tests here apply configs to each kind of GPU
def test_every_shipped_config_on_every_gpu_it_fits(node: Any) -> None:
    n = node(EVERY_MODEL_NODE)
    shipped = load_mig_config(SHIPPED)
    for name, entries in shipped.configs.items():
        gpus = n.gpus()
        results = n.apply(shipped, name)
        after = n.gpus()
        for gpu, result in zip(gpus, results):
            entry = next((e for e in reversed(entries) if e.selects(gpu.index, gpu.pci_device_id, 0)), None)
            if entry is None:
                assert result.action == "unchanged" and result.mutations == 0, (name, result)
                continue
            if not gpu.mig.capable:  # every shipped entry enabling MIG selects `devices: all`: skipped
                assert result.state == SUCCESS and result.mutations == 0, (name, result)
                assert result.action == ("skipped" if entry.mig_enabled else "unchanged"), (name, result)
                continue
            if entry.mig_enabled and not fits(gpu, entry.wanted):
                assert result.state == FAILED and "no MIG profile" in result.reason and result.mutations == 0
                assert result.reason.startswith(f"GPU {gpu.index} ({gpu.product.removeprefix('NVIDIA ')}): ")
                continue
            assert result.state == SUCCESS, (name, result.reason)
            assert geometry(after[gpu.index]) == (entry.mig_enabled, tuple(sorted(entry.wanted.items()))), name
        if all(r.state == SUCCESS and "no entry" not in r.reason for r in results):  # skipped GPUs included
            assert not_applied(plans_for(after, entries)) == []
        before = n.mutations()
        again = n.apply(shipped, name)
        assert n.mutations() == before, f"{name}: re-applying made NVML mutations"
        assert all(r.mutations == 0 and r.action in ("unchanged", "failed", "skipped") for r in again)


def test_hopper_changes_mode_without_a_reset_ampere_resets_only_its_own_gpus(node: Any) -> None:
    h100 = node("dgx-h100")
    h100.apply(config({"7g.80gb": 1}), "test")
    assert "resets" not in h100.machine.read()
    a100 = node("dgx-a100")
    a100.apply(config({"7g.40gb": 1}, gpus=[1, 5]), "test")
    assert a100.machine.read()["resets"] == [1, 5]
    assert [gpu.mig.enabled for gpu in a100.gpus()] == [False, True, False, False, False, True, False, False]


def test_one_changed_gpu_touches_only_that_gpu_and_keeps_what_fits(node: Any) -> None:
    n = node(H100_X4)
    balanced = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    n.apply(config(balanced), "test")
    before = {index: (n.layout(index), n.uuids(index)) for index in range(4)}
    three = n.layout(2)
    both = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"mixed": [
        {"devices": "all", "mig-enabled": True, "mig-devices": balanced},
        {"devices": [2], "mig-enabled": True, "mig-devices": {"3g.40gb": 1, "2g.20gb": 2}},
    ]}}), "mixed.yaml")
    results = n.apply(both, "mixed")
    assert [r.action for r in results] == ["unchanged"] * 2 + ["created"] + ["unchanged"]
    assert all(r.mutations == 0 for i, r in enumerate(results) if i != 2)
    assert {i: (n.layout(i), n.uuids(i)) for i in range(4) if i != 2} == {i: v for i, v in before.items() if i != 2}
    kinds = [type(change) for change in results[2].changes]
    # the 3g and 2g stay; only the two 1g in the way of the second 2g go
    assert kinds == [DestroyComputeInstance] * 2 + [DestroyGpuInstance] * 2 + [CreateGpuInstance, CreateComputeInstance]
    kept = [gi for gi in three[1] if gi[0] in ("3g.40gb", "2g.20gb")]
    assert all(gi in n.layout(2)[1] for gi in kept)
    assert len(set(before[2][1]) & set(n.uuids(2))) == 2  # the kept MIG devices keep their UUIDs


def test_an_impossible_geometry_is_refused_before_any_change(node: Any) -> None:
    n = node("dgx-a100")
    state = copy.deepcopy(n.machine.read()["gpus"])
    results = n.apply(config({"3g.20gb": 3}, gpus=[2]), "test")
    assert results[2].reason == "GPU 2 (A100-SXM4-40GB): 3x 3g.20gb needs 12 of 8 memory slices"
    assert results[2].state == FAILED and n.mutations() == 0 and n.machine.read()["gpus"] == state
    for wanted, reason in (({"4g.20gb": 1, "2g.10gb": 2}, "needs 8 of 7 compute slices"),
                           ({"1g.5gb+me": 2}, "2x 1g.5gb+me asked for, at most 1"),
                           ({"1g.10gb+me": 1}, "no MIG profile 1g.10gb+me; this GPU has 1g.5gb, 1g.5gb+me"),
                           ({"5c.7g.40gb": 1}, "5c.7g.40gb: a 7-slice GPU instance has compute instances of 7, 4, 3")):
        result = n.apply(config(wanted, gpus=[2]), "test")[2]
        assert reason in result.reason and result.state == FAILED
    assert n.mutations() == 0 and n.machine.read()["gpus"] == state


def test_a_busy_gpu_is_refused_naming_its_processes(node: Any) -> None:
    n = node(H100_X4)
    with n.machine.edit() as state:
        state["gpus"][1]["processes"].append({"pid": 4242, "name": "trainer", "used_mib": 1000})
    results = n.apply(config({"7g.80gb": 1}), "test")
    assert results[1].state == FAILED and "4242 (trainer)" in results[1].reason and "mig.force" in results[1].reason
    assert results[1].mutations == 0 and not n.gpus()[1].mig.enabled
    assert all(r.state == SUCCESS for i, r in enumerate(results) if i != 1)
    assert node_state(results) == FAILED


def test_an_nvml_failure_mid_apply_restores_the_previous_geometry(node: Any) -> None:
    n = node(H100_X4)
    n.apply(config({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}), "test")
    before = [n.layout(i) for i in range(4)]
    with n.machine.edit() as state:  # the first compute instance on GPU 2 fails, as a real driver may
        state["faults"].append({"id": 1, "call": "nvmlGpuInstanceCreateComputeInstanceWithPlacement", "gpu": 2,
                                "error": "InsufficientResources", "times": 1})
    results = n.apply(config({"4g.40gb": 1, "3g.40gb": 1}), "test")
    assert results[2].action == "restored" and results[2].state == FAILED
    assert "previous MIG geometry is restored" in results[2].reason
    assert "nvmlGpuInstanceCreateComputeInstanceWithPlacement" in results[2].reason
    assert n.layout(2) == before[2]
    assert all(r.state == SUCCESS for i, r in enumerate(results) if i != 2)
    assert CheckpointStore(n.root).load(n.gpus()[2].uuid) is None  # the checkpoint went with the rollback


def test_a_failed_mode_change_is_restored_too(node: Any) -> None:
    n = node(H100_X4)
    with n.machine.edit() as state:
        state["faults"].append({"id": 1, "call": "nvmlDeviceCreateGpuInstanceWithPlacement", "gpu": 0,
                                "error": "Unknown", "times": 1})
    result = n.apply(config({"7g.80gb": 1}, gpus=[0]), "test")[0]
    assert result.action == "restored" and not n.gpus()[0].mig.enabled  # back to MIG off, as it was


def test_a_dry_run_makes_no_mutation(node: Any) -> None:
    n = node("dgx-a100")
    state = copy.deepcopy(n.machine.read()["gpus"])
    results = n.apply(load_mig_config(SHIPPED), "all-balanced", dry_run=True)
    assert all(r.action == "would-change-mode" and r.mutations == 0 and r.changes for r in results)
    assert n.mutations() == 0 and n.machine.read()["gpus"] == state


def test_export_applies_back_without_a_change(node: Any) -> None:
    n = node(H100_X4)
    mixed = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"mixed": [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"1c.7g.80gb": 3, "4c.7g.80gb": 1}},
        {"devices": [2], "mig-enabled": True, "mig-devices": {"1g.20gb": 2, "3g.40gb": 1}},
        {"devices": [3], "mig-enabled": True, "mig-devices": {}},
    ]}}), "mixed.yaml")
    assert node_state(n.apply(mixed, "mixed")) == SUCCESS
    exported = parse_mig_config(export(n.gpus(), "current"), "export.yaml")
    before = n.mutations()
    assert all(r.action == "unchanged" for r in n.apply(exported, "current"))
    assert n.mutations() == before
    fresh = node(H100_X4)
    assert node_state(fresh.apply(exported, "current")) == SUCCESS
    assert [geometry(gpu) for gpu in fresh.gpus()] == [geometry(gpu) for gpu in n.gpus()]


def test_a_reset_blocked_by_nvidia_drm_is_rebooting_until_the_reboot_applies_it(node: Any) -> None:
    n = node("dgx-a100")
    SimModprobe(n.machine, n.root).load("nvidia_drm")
    install_unit(n.machine.root, "nvidia-dcgm.service", "/usr/bin/nv-hostengine")
    hooks = Hooks(["nvidia-dcgm.service"], SimUnits(n.machine))
    results = n.apply(config({"7g.40gb": 1}, gpus=[0]), "test", hooks=hooks)
    assert results[0].state == REBOOTING and results[0].action == "mode-changed" and results[0].mutations == 1
    assert "pending a GPU reset" in results[0].reason and "nvidia_drm is loaded" in results[0].reason
    assert results[0].reason.startswith("GPU 0 (A100-SXM4-40GB): ")
    gpu = n.gpus()[0]
    assert (gpu.mig.enabled, gpu.mig.pending_enabled) == (False, True)
    assert node_state(results) == REBOOTING
    before = n.mutations()
    # The next pass sees that only a reboot helps: no NVML change, and the units are not stopped again.
    again = n.apply(config({"7g.40gb": 1}, gpus=[0]), "test", hooks=hooks)
    assert again[0].state == REBOOTING and again[0].mutations == 0 and n.mutations() == before
    assert "nvidia_drm is loaded" in again[0].reason
    assert n.machine.read()["services"]["nvidia-dcgm.service"]["calls"] == ["stop", "start"]
    with n.machine.edit() as state:
        reboot(state["gpus"][0], MODELS["A100-SXM4-40GB"])  # the pending mode takes effect at boot
    after = n.apply(config({"7g.40gb": 1}, gpus=[0]), "test")
    assert after[0].state == SUCCESS and after[0].action == "created" and n.fake.calls["nvmlDeviceSetMigMode"] == 1
    assert geometry(n.gpus()[0]) == (True, (("7g.40gb", 1),))


def test_a_passed_through_gpu_is_rebooting_and_a_forced_busy_one_pending_until_its_processes_exit(
        node: Any) -> None:
    vm = node("passthrough: true\ngpus:\n  - model: A100-SXM4-40GB\n    count: 2\n")  # a VM, its GPUs passed through
    result = vm.apply(config({"7g.40gb": 1}, gpus=[1]), "test")[1]
    assert result.state == REBOOTING and "passed through into this VM" in result.reason
    assert "reboot the VM" in result.reason and "resets" not in vm.machine.read()
    assert (vm.gpus()[1].mig.enabled, vm.gpus()[1].mig.pending_enabled) == (False, True)
    n = node("dgx-a100")
    with n.machine.edit() as state:
        state["gpus"][2]["processes"].append({"pid": 4242, "name": "trainer", "used_mib": 1000})
    refused = n.apply(config({}, gpus=[2]), "test")[2]
    assert refused.state == FAILED and "4242 (trainer)" in refused.reason and refused.mutations == 0
    with n.machine.edit() as state:  # the mode was asked for before the process started
        state["gpus"][2]["mig"]["pending"] = 1
    forced = n.apply(config({}, gpus=[2]), "test", force=True)[2]
    assert forced.state == PENDING and forced.mutations == 0
    assert "compute processes use it: 4242 (trainer); it is reset once they exit" in forced.reason
    with n.machine.edit() as state:
        state["gpus"][2]["processes"] = []
    done = n.apply(config({}, gpus=[2]), "test")[2]
    assert done.state == SUCCESS and n.machine.read()["resets"] == [2] and n.gpus()[2].mig.enabled


def test_a_reset_on_another_root_is_pending_and_needs_no_reboot(tmp_path: Path) -> None:
    with pytest.raises(ResetImpossible) as impossible:
        NvidiaSmiReset(Root(tmp_path), timeout=5).reset(0, "00000000:07:00.0")
    assert not impossible.value.until_reboot and str(tmp_path) in str(impossible.value)


def test_a_driver_reload_clears_hopper_mig_mode_and_every_gpus_instances(node: Any) -> None:
    for machine, model, keeps_mode in (("dgx-h100", "H100-80GB-HBM3", False), ("dgx-a100", "A100-SXM4-40GB", True)):
        n = node(machine)
        wanted = {"3g.40gb": 1, "1g.10gb": 1} if keeps_mode is False else {"3g.20gb": 1, "1g.5gb": 1}
        n.apply(config(wanted, gpus=[0, 1]), "test")
        before = n.layout(0)
        with n.machine.edit() as state:
            for gpu in state["gpus"]:
                reload_driver(gpu, MODELS[model])
        mig = n.gpus()[0].mig
        assert (mig.enabled, mig.gpu_instances) == (keeps_mode, ())
        modes = n.fake.calls["nvmlDeviceSetMigMode"]
        results = n.apply(config(wanted, gpus=[0, 1]), "test")
        assert [r.state for r in results[:2]] == [SUCCESS, SUCCESS] and n.layout(0) == before
        assert n.fake.calls["nvmlDeviceSetMigMode"] - modes == (0 if keeps_mode else 2)


def test_the_checkpoint_is_in_the_ledger_and_one_an_interrupted_change_left_is_restored(node: Any) -> None:
    n = node(H100_X4)
    n.apply(config({"3g.40gb": 2}, gpus=[2]), "test")
    original, uuid = n.layout(2), n.gpus()[2].uuid
    checkpoint = Checkpoint.of(n.gpus()[2].mig)
    n.apply(config({"7g.80gb": 1}, gpus=[2]), "test")
    store, ledger = CheckpointStore(n.root), Ledger(n.root)
    assert ledger.mig_checkpoint(uuid) is None  # cleared once the change was made
    whole = n.layout(2)
    fail_once = {"id": 1, "call": "nvmlGpuInstanceCreateComputeInstanceWithPlacement", "gpu": 2, "error": "Unknown",
                 "times": 1}
    # A change that finished but was killed before clearing its checkpoint: the GPU is what it was
    # making, so the next change records a new one, and a failure puts back the GPU as it is now.
    store.save(uuid, 2, checkpoint, (True, (("7g.80gb", 1),)))
    with n.machine.edit() as state:
        state["faults"].append(dict(fail_once))
    result = n.apply(config({"1g.10gb": 7}, gpus=[2]), "test")[2]
    assert result.action == "restored" and n.layout(2) == whole and ledger.mig_checkpoint(uuid) is None
    # A change killed midway: the GPU is not what it was making, so the next change keeps its checkpoint,
    # and a failure puts back the geometry from before both, not the half-made one.
    store.save(uuid, 2, checkpoint, (True, (("1g.10gb", 7),)))
    with n.machine.edit() as state:
        state["faults"].append(dict(fail_once))
    result = n.apply(config({"1g.10gb": 7}, gpus=[2]), "test")[2]
    assert result.action == "restored" and n.layout(2) == original and ledger.mig_checkpoint(uuid) is None
    # Recorded before the first change, with placements and compute instances: a restore that fails
    # too leaves it in the ledger, and says where.
    n.apply(config({"2g.20gb": 2, "1c.2g.20gb": 2}, gpus=[1]), "test")
    before = Checkpoint.of(n.gpus()[1].mig)
    with n.machine.edit() as state:
        state["faults"].append({"id": 2, "call": "nvmlDeviceCreateGpuInstanceWithPlacement", "gpu": 1,
                                "error": "Unknown"})
    failed = n.apply(config({"4g.40gb": 1}, gpus=[1]), "test")[1]
    assert failed.state == FAILED and "restoring its previous MIG geometry failed too" in failed.reason
    assert f"ledger.json (mig_checkpoints.{n.gpus()[1].uuid})" in failed.reason
    assert store.load(n.gpus()[1].uuid) == before
    entry = ledger.mig_checkpoint(n.gpus()[1].uuid)
    assert entry is not None and entry["gpu"] == 1 and entry["checkpoint"]["gpu_instances"][0]["placement"] == [0, 2]
    assert entry["toward"] == {"mig-enabled": True, "mig-devices": {"4g.40gb": 1}}
    assert [len(gi.compute_instances) for gi in before.gpu_instances] == [1, 1, 2]


def test_hooks_stop_units_before_and_always_start_them_after(node: Any) -> None:
    n = node(H100_X4)
    install_unit(n.machine.root, "nvidia-dcgm.service", "/usr/bin/nv-hostengine")
    units = SimUnits(n.machine)
    with n.machine.edit() as state:
        state["faults"].append({"id": 1, "call": "nvmlDeviceSetMigMode", "gpu": 0, "error": "Unknown", "times": 1})
    results = n.apply(config({"7g.80gb": 1}, gpus=[0]), "test",
                      hooks=Hooks(["nvidia-dcgm.service", "nvidia-persistenced.service"], units))
    assert results[0].state == FAILED
    services = n.machine.read()["services"]
    assert services["nvidia-dcgm.service"]["calls"] == ["stop", "start"]
    assert services["nvidia-persistenced.service"]["calls"] == ["stop", "start"]
    assert all(service["active_state"] == "active" for service in services.values())
    quiet = node(H100_X4)
    quiet.apply(config({}, enabled=False), "test", hooks=Hooks(["nvidia-dcgm.service"], SimUnits(quiet.machine)))
    assert "services" not in quiet.machine.read()  # nothing to change: nothing stopped
    missing = node(H100_X4)  # a unit without its unit file: systemctl's words, the start still tried
    results = missing.apply(config({"7g.80gb": 1}, gpus=[0]), "test",
                            hooks=Hooks(["nvidia-dcgm.service"], SimUnits(missing.machine)))
    assert results[0].state == FAILED and "Unit nvidia-dcgm.service not loaded" in results[0].reason, results[0].reason


def test_a_geometry_that_fits_by_count_but_not_by_placement_is_refused() -> None:
    from gpu_agent.mig.config import MigConfigEntry
    from gpu_agent.mig.planner import plan_gpu
    from gpu_agent.nvml.model import Gpu, MigProfile, MigState

    def profile(name: str, pid: int, slices: int, placements: tuple[tuple[int, int], ...]) -> MigProfile:
        return MigProfile(name, pid, slices, len(placements), 10, 1000, 1, 0, 0, 0, 0, placements)

    # a made-up table: 2g only at 0 or 2, 1g.big anywhere in the upper half
    table = (profile("2g.10gb", 14, 2, ((0, 2), (2, 2))), profile("1g.20gb", 15, 1, ((4, 2), (6, 2))),
             profile("7g.40gb", 0, 7, ((0, 8),)))
    gpu = Gpu(0, "GPU-x", "0000:01:00.0", "NVIDIA Test", 40960, (8, 0), 0, MigState(True, True, True, (), table))
    entry = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"x": [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"2g.10gb": 2, "1g.20gb": 1}}]}}), "x").select("x")[0]
    assert isinstance(entry, MigConfigEntry)
    assert plan_gpu(gpu, entry).changes  # 2g at 0 and 2, the 1g.20gb at 4
    three = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"x": [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"2g.10gb": 3}}]}}), "x").select("x")[0]
    refused = plan_gpu(replace_instances(gpu, table), three).refused
    assert refused == "GPU 0 (Test): 3x 2g.10gb asked for, at most 2"
    wide = (profile("2g.10gb", 14, 2, ((0, 2), (2, 2), (4, 2))), profile("3g.20gb", 9, 3, ((2, 4),)),
            profile("7g.40gb", 0, 7, ((0, 8),)))
    blocked = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"x": [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"2g.10gb": 2, "3g.20gb": 1}}]}}), "x").select("x")[0]
    assert plan_gpu(replace_instances(gpu, wide), blocked).refused == (
        "GPU 0 (Test): no placement fits 1x 3g.20gb + 2x 2g.10gb (3g.20gb starts at 2; 2g.10gb starts at 0, 2, 4)")


def replace_instances(gpu: Any, profiles: Any) -> Any:
    from dataclasses import replace

    return replace(gpu, mig=replace(gpu.mig, profiles=profiles))


# mig-parted's own example configs (NVIDIA/mig-parted, examples/config.yaml, read from ../shared/upstream):
# its apply skips a GPU that cannot do MIG when `devices: all` selects it ("Skipping -- non MIG-capable GPU",
# cmd/nvidia-mig-parted/apply/mode.go and config.go) and fails one named by index ("cannot set MIG mode on
# non MIG-capable GPU").


def test_devices_all_skips_a_gpu_that_cannot_do_mig_as_mig_parted_does(node: Any) -> None:
    n = node("gpus:\n  - model: A100-SXM4-40GB\n  - model: T4\n")
    examples = load_mig_config(upstream_file("mig-parted", "examples/config.yaml"))
    for name in ("all-enabled", "all-1g.5gb", "all-balanced", "all-disabled"):
        results = n.apply(examples, name)
        assert [r.state for r in results] == [SUCCESS, SUCCESS], (name, results)
        t4 = results[1]
        assert t4.mutations == 0 and not t4.changes
        if name == "all-disabled":
            assert t4.action == "unchanged"
        else:
            assert t4.action == "skipped" and t4.reason.startswith("GPU 1 (Tesla T4): not MIG-capable; ")
            assert "config.yaml:" in t4.reason and "(devices: all)" in t4.reason
        wanted = tuple(sorted(examples.select(name)[-1].wanted.items()))
        assert geometry(n.gpus()[0]) == (name != "all-disabled", wanted)
        # assert agrees with apply: the skipped GPU is as configured
        assert not_applied(plans_for(n.gpus(), examples.select(name))) == [], name
    dry = n.apply(examples, "all-1g.5gb", dry_run=True)
    assert dry[1].action == "skipped" and dry[0].action == "would-change-mode"


def test_a_gpu_named_by_index_that_cannot_do_mig_is_still_refused(node: Any) -> None:
    n = node("gpus:\n  - model: A100-SXM4-40GB\n    count: 5\n  - model: T4\n")
    examples = load_mig_config(upstream_file("mig-parted", "examples/config.yaml"))
    results = n.apply(examples, "custom-config")  # its `devices: [5]` entry asks GPU 5 for 3x 2g.10gb
    assert [r.state for r in results[:5]] == [SUCCESS] * 5
    assert results[5].state == FAILED and results[5].mutations == 0
    assert results[5].reason.startswith("GPU 5 (Tesla T4) is not MIG-capable; its entry (")
    assert geometry(n.gpus()[4]) == (True, (("1g.5gb", 7),))
    assert not_applied(plans_for(n.gpus(), examples.select("custom-config"))) == [results[5].reason]
    # disabling MIG on it is no error (mig-parted: "Skipping -- non MIG-capable GPU with MIG mode disabled")
    off = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": {"off": [
        {"devices": [5], "mig-enabled": False}]}}), "off.yaml")
    assert n.apply(off, "off")[5].state == SUCCESS
