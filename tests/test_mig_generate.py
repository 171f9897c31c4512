"""gpu-agent mig generate-config against mig-parted v0.15's generator.

Two kinds of evidence. Upstream's own test tables (tests/facts/mig_parted_generate.py) replayed on the
agent's generator. And whole outputs: tests/data/mig-generate/*.yaml (and .json) are what
`nvidia-mig-parted generate-config` v0.15.0 printed for the same GPUs (tests/data/mig-generate/README.md
says how they were made); the agent must print them byte for byte, on the simulated machines, on the H200
capture and on GPUs with Blackwell's profile kinds. Each generated config then applies on the simulator.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import pytest
import yaml

from facts import mig_parted_generate as facts
from gpu_agent.cli import main
from gpu_agent.mig.generate import (
    Discovered,
    GenerateError,
    discover,
    generate,
    profile_gb,
    render,
)
from gpu_agent.mig.planner import NOT_SELECTED
from gpu_agent.nvml.model import IDENTITY, Gpu, MigProfile, MigState
from gpu_agent.sim.profiles import MODELS

DATA = Path(__file__).resolve().parent / "data"
OUTPUTS = DATA / "mig-generate"
CAPTURE = DATA / "captures" / "h200-580-vm"

# Simulated nodes: a built-in profile, or a machine file's text.
MIXED_A100_H100_T4 = ("gpus:\n  - model: A100-SXM4-40GB\n  - model: H100-80GB-HBM3\n  - model: T4\n"
                      "  - model: A100-SXM4-80GB\n")
MIXED_A30_H200 = "gpus:\n  - model: H200\n  - model: A30\n"
MIXED_A100_80_40 = "gpus:\n  - model: A100-SXM4-80GB\n  - model: A100-SXM4-40GB\n"
NODES: dict[str, str] = {
    "dgx-a100": "dgx-a100", "dgx-h100": "dgx-h100", "dgx-h200": "dgx-h200", "a30": "a30",
    "h200-capture": str(CAPTURE), "mixed-a100-h100-t4": MIXED_A100_H100_T4, "mixed-a30-h200": MIXED_A30_H200,
    "mixed-a100-40-80": MIXED_A100_80_40,
}

# GPUs with Blackwell's profile kinds (+gfx, -me, +me.all), none of them simulated: device id, memory in
# MiB, and per NVML_GPU_INSTANCE_PROFILE_* constant the most instances and the memory in MiB. Their
# profiles are those of builder_test.go's RTX-PRO-6000 and RTX-PRO-5000; the memory sizes are ours, chosen
# so that go-nvlib's names come out as that table's.
SYNTHETIC: dict[str, tuple[int, int, tuple[tuple[str, int, int], ...]]] = {
    "rtx-pro-6000": (0x2BB510DE, 97887, (
        ("1_SLICE", 4, 24000), ("1_SLICE_REV1", 1, 24000), ("1_SLICE_GFX", 4, 24000), ("1_SLICE_NO_ME", 4, 24000),
        ("1_SLICE_ALL_ME", 1, 24000), ("2_SLICE", 2, 48000), ("2_SLICE_GFX", 2, 48000), ("2_SLICE_NO_ME", 2, 48000),
        ("2_SLICE_ALL_ME", 1, 48000), ("4_SLICE", 1, 96000), ("4_SLICE_GFX", 1, 96000))),
    "rtx-pro-5000": (0x2BB410DE, 48953, (
        ("1_SLICE", 1, 12000), ("1_SLICE_REV1", 1, 12000), ("1_SLICE_GFX", 1, 12000), ("1_SLICE_NO_ME", 3, 12000),
        ("2_SLICE_NO_ME", 1, 24000), ("4_SLICE", 1, 48000), ("4_SLICE_GFX", 1, 48000))),
}


def _gpu(index: int, device_id: int, memory_mib: int, profiles: tuple[MigProfile, ...], **more: Any) -> Gpu:
    return Gpu(index, f"GPU-{index}", f"00000000:{index + 1:02X}:00.0", "test GPU", memory_mib, (10, 0), index,
               MigState(capable=True, profiles=profiles), pci_device_id=device_id, **more)


def _synthetic(index: int, key: str) -> Gpu:
    device_id, memory_mib, table = SYNTHETIC[key]
    profiles = tuple(MigProfile(f"MIG {constant}", number, int(constant[0]), count, 0, memory, 0, 0, 0, 0, 0, (),
                                constant=constant) for number, (constant, count, memory) in enumerate(table))
    return _gpu(index, device_id, memory_mib, profiles)


def _found(gpus: list[Union[str, tuple[str, tuple[facts.Profile, ...]]]]) -> dict[int, tuple[Discovered, ...]]:
    """Upstream's DeviceProfiles for a case: by GPU index, a GPU_PROFILES name or (device id, profiles)."""
    found = {}
    for index, gpu in enumerate(gpus):
        device_id, table = facts.GPU_PROFILES[gpu] if isinstance(gpu, str) else gpu
        found[index] = tuple(Discovered(name, slices, not any(c in name for c in "+-"), count, device_id)
                             for name, slices, count in table)
    return found


def _cli(tmp_path: Path, node: str, *argv: str, capsys: Any) -> tuple[int, str, str]:
    simulate = node
    if "\n" in node:
        simulate = str(tmp_path / "machine.yaml")
        Path(simulate).write_text(node)
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\ntoolkit: {enabled: false}\n")
    code = main(["--root", str(tmp_path / "root"), "--config", str(config), "--simulate", simulate, *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def node(tmp_path: Path, capsys: Any) -> Any:
    """A simulated node with its driver loaded: run(name, *argv) -> (exit code, stdout, stderr)."""
    started: set[str] = set()

    def run(name: str, *argv: str) -> tuple[int, str, str]:
        where = tmp_path / name
        where.mkdir(exist_ok=True)
        if name not in started and NODES[name] != str(CAPTURE):  # a capture's driver was loaded when taken
            assert _cli(where, NODES[name], "apply", "--once", capsys=capsys)[0] == 0
        started.add(name)
        return _cli(where, NODES[name], *argv, capsys=capsys)

    return run


# --- upstream's tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize("description, gpus, wanted", facts.BUILD_CASES, ids=[c[0] for c in facts.BUILD_CASES])
def test_mig_parted_build_config_spec(description: str, gpus: list[Any], wanted: list[facts.Want]) -> None:
    configs, _ = generate(_found(gpus))
    assert configs["all-disabled"] == [{"devices": "all", "mig-enabled": False, "mig-devices": None}]
    assert configs["all-enabled"] == [{"devices": "all", "mig-enabled": True, "mig-devices": {}}]
    for config, profile, count, device_filter in wanted:
        entries = [e for e in configs[config] if sorted(e.get("device-filter") or ()) == sorted(device_filter or ())]
        assert len(entries) == 1, (config, device_filter, configs[config])
        assert (entries[0]["devices"], entries[0]["mig-enabled"]) == ("all", True)
        assert entries[0]["mig-devices"][profile] == count, (config, entries[0])
    assert set(configs) == {"all-disabled", "all-enabled"} | {w[0] for w in wanted}


@pytest.mark.parametrize("description, gpus, entries", facts.BALANCED_CASES, ids=[c[0] for c in facts.BALANCED_CASES])
def test_mig_parted_build_all_balanced(description: str, gpus: list[Any],
                                       entries: list[tuple[Any, dict[str, int]]]) -> None:
    configs, notes = generate(_found(gpus))
    if not entries:
        assert "all-balanced" not in configs
        # a GPU with no profile without attributes is not considered at all, as upstream does
        assert len(notes) == (0 if "only attributed" in description else 1)
        assert all("no all-balanced entry" in note for note in notes)
        return
    wanted = [({"device-filter": [f]} if f else {}) | {"devices": "all", "mig-enabled": True, "mig-devices": d}
              for f, d in entries]
    assert sorted(map(json.dumps, configs["all-balanced"])) == sorted(map(json.dumps, wanted))


@pytest.mark.parametrize("gpu", sorted(facts.EXPECTED_BALANCED))
def test_mig_parted_expected_balanced(gpu: str) -> None:
    configs, _ = generate(_found([gpu]))
    expected = facts.EXPECTED_BALANCED[gpu]
    assert [e["mig-devices"] for e in configs.get("all-balanced", [])] == ([expected] if expected else [])


@pytest.mark.parametrize("profile, name", facts.NORMALIZED)
def test_mig_parted_normalize_profile_name(profile: str, name: str) -> None:
    configs, _ = generate({0: (Discovered(profile, int(profile[0]), False, 1, "0x233010DE"),)})
    assert configs["all-" + name] == [{"devices": "all", "mig-enabled": True, "mig-devices": {profile: 1}}]


def test_mig_parted_a30_profiles_whatever_nvml_says() -> None:
    """discovery_test.go TestGetHardcodedA30Profiles: an A30's profiles are mig-parted's table, even where
    NVML reports other instance counts (its reason: NVML's counts for the A30 are wrong)."""
    wrong = tuple(MigProfile(f"MIG {n}g.6gb", n, n, 7, 0, 5952 * n, 0, 0, 0, 0, 0, (), constant=f"{n}_SLICE")
                  for n in (1, 2, 4))
    [profiles] = discover([_gpu(0, 0x20B710DE, 24576, wrong)]).values()
    assert {p.name: p.max_count for p in profiles} == facts.A30_HARDCODED
    assert {p.name for p in profiles if p.base} == {"1g.6gb", "2g.12gb", "4g.24gb"}


# --- go-nvlib's names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [m for m in MODELS.values() if m.mig_capable], ids=lambda m: m.key)
def test_go_nvlib_names_are_nvml_names_on_every_simulated_gpu(model: Any) -> None:
    """go-nvlib names a profile from its memory share; on each simulated GPU that gives NVML's own name, so
    the generated configs name profiles the agent's planner finds."""
    for profile in model.mig_profiles:
        nvml_size = profile.name.removeprefix("MIG ").split(".")[1].split("+")[0]
        assert f"{profile_gb(profile.memory_mib, model.memory_mib << 20)}gb" == nvml_size, profile


def test_go_nvlib_rounds_half_away_from_zero() -> None:
    """The H200's 3g profile is exactly 70.5 GB by go-nvlib's formula: Go rounds it to 71 (nvidia-smi's
    3g.71gb); Python's round() would say 70."""
    assert profile_gb(71424, 143771 << 20) == 71
    assert profile_gb(4864, 40960 << 20) == 5 and profile_gb(143360, 143771 << 20) == 141


def test_a_profile_go_nvlib_does_not_know_is_named_as_nvml_does() -> None:
    """3_SLICE_GFX: go-nvlib v0.12.0 (mig-parted v0.15.0) fails on a GPU that has it; the agent names it
    with its attribute, as NVML does (docs/mig.md)."""
    profile = MigProfile("MIG 3g.36gb+gfx", 17, 3, 1, 0, 36000, 0, 0, 0, 0, 0, (), constant="3_SLICE_GFX")
    [found] = discover([_gpu(0, 0x2BB510DE, 97887, (profile,))]).values()
    assert [(p.name, p.base) for p in found] == [("3g.36gb+gfx", False)]


# --- whole outputs, as mig-parted prints them -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NODES))
def test_output_is_mig_parteds(node: Any, name: str) -> None:
    code, out, err = node(name, "mig", "generate-config")
    assert (code, err) == (0, "")
    assert out == (OUTPUTS / f"{name}.yaml").read_text()


@pytest.mark.parametrize("name", ["a30", "mixed-a30-h200"])
def test_json_output_is_mig_parteds(node: Any, name: str) -> None:
    code, out, _ = node(name, "mig", "generate-config", "-o", "json")
    assert code == 0 and out == (OUTPUTS / f"{name}.json").read_text()


@pytest.mark.parametrize("name, gpus", [("rtx-pro-6000", ["rtx-pro-6000"]),
                                        ("rtx-mixed", ["rtx-pro-6000", "rtx-pro-5000", "rtx-pro-6000"])])
def test_blackwell_profile_kinds_as_mig_parted_writes_them(name: str, gpus: list[str]) -> None:
    configs, notes = generate(discover([_synthetic(i, key) for i, key in enumerate(gpus)]))
    assert render(configs) == (OUTPUTS / f"{name}.yaml").read_text()
    assert notes == ([] if name == "rtx-pro-6000" else
                     ["GPUs 0x2BB410DE: no all-balanced entry (it needs 1g, 2g and 3g profiles without attributes "
                      "on a 7-slice GPU, 1g and 2g on a 4-slice one)"])


# --- each generated config applies ------------------------------------------------------------------------


# The H200 capture's configs stand for the eight simulated H200s' (the same profiles), a30 for the reboot path.
@pytest.mark.parametrize("name", [pytest.param("dgx-h200", marks=pytest.mark.slow), "a30", "h200-capture",
                                  pytest.param("mixed-a100-h100-t4", marks=pytest.mark.slow)])
def test_each_generated_config_applies(node: Any, tmp_path: Path, name: str) -> None:
    code, out, _ = node(name, "mig", "generate-config")
    assert code == 0
    generated = tmp_path / f"{name}-generated.yaml"
    generated.write_text(out)
    configs = yaml.safe_load(out)["mig-configs"]
    for config in sorted(configs, key=lambda c: c != "all-enabled"):  # Ampere: the mode first, then a reset
        code, out, err = node(name, "mig", "apply", "-f", str(generated), "-c", config)
        if code == 2:  # pending an Ampere GPU's reset, which only a (simulated) reboot gives on a sandbox root
            assert node(name, "sim", "reboot")[0] == 0
            code, out, err = node(name, "mig", "apply", "-f", str(generated), "-c", config)
        assert code == 0, (config, out, err)
        code, out, _ = node(name, "mig", "assert", "-f", str(generated), "-c", config)
        if code == 0:
            assert out == f"MIG config {config} is applied\n"
        else:  # on a mixed node, a profile's config leaves out the GPUs without it: mig-parted's assert fails too
            reasons = out.splitlines()[1:]
            assert code == 1 and name.startswith("mixed") and reasons, (config, out)
            assert all(reason.endswith(NOT_SELECTED) for reason in reasons), (config, out)


# --- what cannot be generated -----------------------------------------------------------------------------


def test_a_node_without_mig_capable_gpus_has_no_configs(tmp_path: Path, capsys: Any) -> None:
    assert _cli(tmp_path, "gpus:\n  - model: T4\n", "apply", "--once", capsys=capsys)[0] == 0
    code, out, err = _cli(tmp_path, "gpus:\n  - model: T4\n", "mig", "generate-config", capsys=capsys)
    assert (code, out) == (1, "") and "no MIG-capable GPU on this node" in err and "Traceback" not in err


def test_a_gpu_nvml_cannot_read_stops_it_as_mig_parted_stops() -> None:
    lost = _gpu(1, 0x233010DE, 81559, (), unreadable="nvmlDeviceGetHandleByIndex: GPU is lost", known_from=IDENTITY)
    with pytest.raises(GenerateError, match=r"GPU 1 \(test GPU\): cannot read its MIG profiles: .*GPU is lost"):
        discover([_synthetic(0, "rtx-pro-6000"), lost])


def test_mig_capable_gpus_without_profiles() -> None:
    with pytest.raises(GenerateError, match="no MIG profile for any"):
        discover([_gpu(0, 0x233010DE, 81559, ())])
