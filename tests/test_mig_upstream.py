"""mig-parted's own test tables and examples, replayed on the agent's MIG config reader and planner:
NVIDIA/mig-parted at commit bd7160f43f16462eeb21e1eda5e67b5b6b03fd7d, api/spec/v1/spec_test.go (TestSpec,
TestMigConfigSpec, TestMarshallUnmarshall), api/spec/v1/helpers_test.go (TestMigConfigSpecMatchesDeviceFilter),
pkg/types/device_test.go (TestNewDeviceIDFromString, TestDeviceIDMatches), pkg/mig/config/known_configs_test.go
(TestValidConfiguration) and examples/dgx-station-80gb-config.yaml (read from ../shared/upstream). Each row
keeps upstream's description; where the agent deliberately refuses what mig-parted reads (docs/mig.md,
"Where the agent differs from mig-parted"), the row says so. These files are unchanged at v0.15.0 (commit
e2d5ad1fc72b9d298ea6d04b885cf2d7dbe56941, the version bump after bd7160f4): their subsystem-id filters are
v0.15's, checked here also on the real H200's ids (tests/data/captures/h200-580-vm)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from upstream_data import upstream_file
import yaml

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.mig.config import DeviceFilter, MigConfigError, entry_for, load_mig_config, parse_mig_config
from gpu_agent.mig.planner import NOT_SELECTED, plans_for
from gpu_agent.mig.profile import parse_profile
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Gpu
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState

WELL_FORMED = '"mig-configs": {"all-disabled": [{"devices": "all", "mig-enabled": false}]}'
REFUSED = "refused by the agent, read by mig-parted"  # a deliberate difference


# spec_test.go TestSpec: whole files (JSON is YAML). True: mig-parted reads it.
@pytest.mark.parametrize("description, text, accepted", [
    ("Empty", "", True),
    ("Well formed", '{"version": "v1", ' + WELL_FORMED + "}", True),
    ("Only version field", '{"version": "v1"}', True),
    ("Well formed - wrong version", '{"version": "v2", ' + WELL_FORMED + "}", False),
    ("Only version field - wrong versiomn", '{"version": "v2"}', False),
    ("Missing version field", "{" + WELL_FORMED + "}", False),
    ("Erroneous field", '{"bogus": "field", "version": "v1", ' + WELL_FORMED + "}", False),
    ("Empty 'mig-configs'", '{"version": "v1", "mig-configs": {}}', False),
])
def test_mig_parted_spec(description: str, text: str, accepted: bool) -> None:
    if accepted:
        parse_mig_config(text, "spec.yaml")
    else:
        with pytest.raises(MigConfigError, match=r"spec\.yaml"):
            parse_mig_config(text, "spec.yaml")


# spec_test.go TestMigConfigSpec: one entry, here inside a file so that the agent's reader takes it.
@pytest.mark.parametrize("description, entry, accepted", [
    ("Empty", "", REFUSED),  # a null entry, which mig-parted reads as one selecting no GPU
    ("Well formed", '{"devices": "all", "mig-enabled": true, "mig-devices": {"1g.5gb": 2}}', True),
    ("Well formed with filter",
     '{"device-filter": "MODEL", "devices": "all", "mig-enabled": true, "mig-devices": {"1g.5gb": 2}}', REFUSED),
    ("Well formed with multi-filter",
     '{"device-filter": ["MODEL1", "MODEL2"], "devices": "all", "mig-enabled": true, "mig-devices": {"1g.5gb": 2}}',
     REFUSED),
    ("Missing 'devices'", '{"mig-enabled": true, "mig-devices": {"1g.5gb": 2}}', False),
    ("Missing 'mig-enabled'", '{"devices": "all", "mig-devices": {"1g.5gb": 2}}', False),
    ("Missing 'mig-devices', enabled: false", '{"devices": "all", "mig-enabled": false,}', True),
    ("Missing 'mig-devices', enabled: true", '{"devices": "all", "mig-enabled": true,}', False),
    ("'mig-devices' formatted correctly", '{"devices": "all", "mig-enabled": true, "mig-devices": {"1g.5gb": 2}}',
     True),
    ("'mig-devices' formatted incorrectly", '{"devices": "all", "mig-enabled": true, "mig-devices": {"bogus": 2}}',
     False),
    ("Erroneous field", '{"bogus": "field", "devices": "all", "mig-enabled": false,}', False),
    ("'devices' string == all", '{"devices": "all", "mig-enabled": false,}', True),
    ("'devices' string != all", '{"devices": "bogus", "mig-enabled": false,}', False),
    ("'devices' []int", '{"devices": [0,1,2,3], "mig-enabled": false,}', True),
    ("'devices' not string for []int", '{"devices": {}, "mig-enabled": false,}', False),
])
def test_mig_parted_config_spec(description: str, entry: str, accepted: Any) -> None:
    text = f"version: v1\nmig-configs:\n  c:\n  - {entry}\n"
    if accepted is True:
        parse_mig_config(text, "mig.yaml")
    else:  # each refusal names the file, line and key
        with pytest.raises(MigConfigError, match=r"^mig\.yaml:4: mig-configs\.c\[0\]"):
            parse_mig_config(text, "mig.yaml")


def test_mig_parted_marshall_unmarshall_spec() -> None:
    """TestMarshallUnmarshall's spec as YAML: its A100 configs mean the same here with the PCI id the agent
    needs in device-filter (mig-parted's test writes the model name, which its matcher never matches), and
    its "valid-format-non-existent-devices" (0g.0gb: 100) is refused: no GPU has a 0-slice profile."""
    configs = {
        "all-disabled": [{"devices": "all", "mig-enabled": False}],
        "all-1-slice": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": 7}}],
        "all-balanced-slices": [{"devices": "all", "mig-enabled": True,
                                 "mig-devices": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}],
        "half-disabled-half-balanced-slices": [
            {"devices": [0, 1, 2, 3], "mig-enabled": False},
            {"devices": [4, 5, 6, 7], "mig-enabled": True, "mig-devices": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}],
        "multi-device-filter": [
            {"device-filter": ["0x20B010DE", "0x20F110DE"], "devices": [0, 1, 2, 3], "mig-enabled": False}],
    }
    read = parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": configs}), "spec.yaml")
    assert read.select("all-balanced-slices")[0].wanted == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    half = read.select("half-disabled-half-balanced-slices")
    assert [(e.devices, e.mig_enabled) for e in half] == [((0, 1, 2, 3), False), ((4, 5, 6, 7), True)]
    assert read.select("multi-device-filter")[0].device_filter == (DeviceFilter(0x20B010DE), DeviceFilter(0x20F110DE))
    bad = {"x": [{"devices": "all", "mig-enabled": True, "mig-devices": {"0g.0gb": 100}}]}
    with pytest.raises(MigConfigError, match=r"mig-devices\.0g\.0gb: '0g\.0gb': slice counts must be 1"):
        parse_mig_config(yaml.safe_dump({"version": "v1", "mig-configs": bad}), "spec.yaml")


H100 = (0x233010DE, 0x16C010DE)  # helpers_test.go: NewDeviceIDWithSubsystem(0x2330, 0x10DE, 0x16C0, 0x10DE)


# helpers_test.go TestMigConfigSpecMatchesDeviceFilter on an H100 with its subsystem id.
@pytest.mark.parametrize("description, device_filter, matches", [
    ("empty filter matches all devices", "", True),
    ("primary-only filter matches subsystem-aware hardware", "0x233010DE", True),
    ("matching subsystem filter matches hardware", "0x233010DE:0x16C010DE", True),
    ("sibling subsystem filter does not match hardware", "0x233010DE:0x16C110DE", False),
    ("multiple filters stop at a matching subsystem entry", ["0x233010DE:0x16C110DE", "0x233010DE:0x16C010DE"],
     True),
    ("malformed filters with extra separators do not match", "0x233010DE:0x16C010DE:extra", REFUSED),
])
def test_mig_parted_device_filter(description: str, device_filter: Any, matches: Any) -> None:
    text = yaml.safe_dump({"version": "v1", "mig-configs": {"c": [
        {"device-filter": device_filter, "devices": "all", "mig-enabled": False}]}})
    if matches == REFUSED:
        with pytest.raises(MigConfigError, match=r"mig\.yaml:\d+: mig-configs\.c\[0\]\.device-filter: .* is not a PCI"):
            parse_mig_config(text, "mig.yaml")
        return
    [entry] = parse_mig_config(text, "mig.yaml").select("c")
    assert entry.selects(0, *H100) is matches


# device_test.go TestNewDeviceIDFromString and TestDeviceIDMatches (A16 and A2 share 0x25B6).
@pytest.mark.parametrize("text, expected", [
    ("0x25B610DE", DeviceFilter(0x25B610DE)), ("0x25B610DE:0x14A910DE", DeviceFilter(0x25B610DE, 0x14A910DE)),
    ("not-a-device-id", None), ("0x25B610DE:not-a-subsystem", None), ("0x25B610DE:0x14A910DE:extra", None),
])
def test_mig_parted_device_id_from_string(text: str, expected: Any) -> None:
    file = yaml.safe_dump({"version": "v1", "mig-configs": {"c": [
        {"device-filter": text, "devices": "all", "mig-enabled": False}]}})
    if expected is None:
        with pytest.raises(MigConfigError, match="device-filter"):
            parse_mig_config(file, "mig.yaml")
    else:
        assert parse_mig_config(file, "mig.yaml").select("c")[0].device_filter == (expected,)


@pytest.mark.parametrize("description, device_filter, hardware, matches", [
    ("primary only filter matches same primary id", DeviceFilter(0x25B610DE), (0x25B610DE, 0x14A910DE), True),
    ("subsystem filter matches exact hardware", DeviceFilter(0x25B610DE, 0x14A910DE), (0x25B610DE, 0x14A910DE), True),
    ("subsystem filter rejects sibling subsystem", DeviceFilter(0x25B610DE, 0x14A910DE), (0x25B610DE, 0x157E10DE),
     False),
    ("subsystem filter does not match hardware with unknown subsystem", DeviceFilter(0x25B610DE, 0x14A910DE),
     (0x25B610DE, 0), False),
    ("zero subsystem filter matches hardware with unknown subsystem", DeviceFilter(0x25B610DE, 0), (0x25B610DE, 0),
     True),
    ("different primary id does not match", DeviceFilter(0x1E3010DE), (0x25B610DE, 0x14A910DE), False),
])
def test_mig_parted_device_id_matches(description: str, device_filter: DeviceFilter, hardware: tuple[int, int],
                                      matches: bool) -> None:
    assert device_filter.matches(*hardware) is matches


# go-nvlib's MIG profile grammar (vendored in mig-parted: pkg/nvlib/device/mig_profile.go parseMigProfile):
# names and their canonical form; the agent sorts attributes, as go-nvlib's Matches compares them sorted.
@pytest.mark.parametrize("text, canonical", [
    ("1g.10gb+me", "1g.10gb+me"), ("1c.2g.20gb", "1c.2g.20gb"), ("7g.80gb", "7g.80gb"), ("2c.2g.20gb", "2g.20gb"),
    ("01g.05gb", "1g.5gb"), ("1g.24gb-me", "1g.24gb-me"), ("1g.10gb+me.all", "1g.10gb+me.all"),
    ("1g.10gb+me,gfx", "1g.10gb+gfx,me"),
    ("1g.10gb+me-x", None), ("1g.10gb+1me", None), ("1g.10gb+.me", None), ("1g.10gb+me.", None),
    ("1g.10gb+me,me", None), ("1g.10gb+", None), ("1g.10gb+me,", None), ("1g.10gb+m e", None), (" 1g.10gb", None),
    ("1g", None), ("1g.10gb.1c", None), ("1G.10GB", None), ("1c.1g.2g.10gb", None),
])
def test_go_nvlib_profile_names(text: str, canonical: Any) -> None:
    if canonical is None:
        with pytest.raises(ValueError):
            parse_profile(text)
    else:
        assert str(parse_profile(text)) == canonical


def _gpus(directory: Path, spec: str) -> tuple[Gpu, ...]:
    state = MachineState(Root(directory))
    state.ensure(spec)
    SimModprobe(state, Root(directory)).load("nvidia")
    nvml = Nvml(FakeNvml(state), call_timeout=5)
    try:
        return nvml.inventory.read().gpus
    finally:
        nvml.close()


@pytest.fixture(scope="module")
def a100(tmp_path_factory: pytest.TempPathFactory) -> Gpu:
    """An A100-SXM4-40GB as the simulator's NVML describes it (GPU 0 of its DGX A100)."""
    return _gpus(tmp_path_factory.mktemp("dgx-a100"), "dgx-a100")[0]


# known_configs_test.go TestValidConfiguration on an A100-SXM4-40GB (the simulator's, as nvidia-smi lists it).
@pytest.mark.parametrize("description, devices, valid", [
    ("Empty config", {}, True),
    ("Single device (equal to max)", {"1g.5gb": 7}, True),
    ("Single device (greater than max)", {"1g.5gb": 8}, False),
    ("Single device (less than max)", {"1g.5gb": 6}, True),
    ("Mix of devices (all at max)", {"1g.5gb": 3, "2g.10gb": 2}, True),
    ("Mix of devices (one smaller than max)", {"1g.5gb": 2, "2g.10gb": 2}, True),
    ("Mix of devices (all smaller than max)", {"1g.5gb": 2, "2g.10gb": 1}, True),
    ("Mix of devices (one greater than max)", {"1g.5gb": 4, "2g.10gb": 2}, False),
    ("Invalid device type (with count > 0)", {"bogus": 1}, False),
])
def test_mig_parted_valid_configuration(a100: Gpu, description: str, devices: dict[str, int], valid: bool) -> None:
    text = yaml.safe_dump({"version": "v1", "mig-configs": {"c": [
        {"devices": "all", "mig-enabled": True, "mig-devices": devices}]}})
    try:
        entries = parse_mig_config(text, "mig.yaml").select("c")
    except MigConfigError as exc:  # a name that is no profile: refused when read, naming the key
        assert not valid and "mig-devices.bogus" in str(exc)
        return
    [plan] = plans_for([a100], entries)
    assert (plan.refused == "") is valid, plan.refused




def test_mig_parted_dgx_station_example_plans_on_its_gpus(tmp_path: Path) -> None:
    """examples/dgx-station-80gb-config.yaml on five A100-SXM4-80GB (0x20B210DE; the station's display GPU,
    0x1FB010DE, is not simulated, and balanced-k8s names GPU 4): every config plans without a refusal,
    each GPU to the geometry of the last entry selecting it; a GPU no entry selects is left as it is."""
    machine = tmp_path / "station.yaml"
    machine.write_text("gpus:\n  - model: A100-SXM4-80GB\n    count: 5\n")
    found = _gpus(tmp_path, str(machine))
    examples = load_mig_config(upstream_file("mig-parted", "examples/dgx-station-80gb-config.yaml"))
    assert len(examples.configs) == 9
    for name, entries in examples.configs.items():
        for gpu, plan in zip(found, plans_for(found, entries)):
            entry = entry_for(entries, gpu.index, gpu.pci_device_id, gpu.pci_subsystem_id)
            assert plan.refused == "", (name, plan)
            if entry is None:
                assert plan.target is None and plan.note == NOT_SELECTED and name == "balanced-k8s-dgx-station-80"
            else:
                assert plan.target == (entry.mig_enabled, tuple(sorted(entry.wanted.items()))), (name, plan)


CAPTURE = Path(__file__).resolve().parent / "data" / "captures" / "h200-580-vm"


@pytest.mark.parametrize("device_filter, selected", [
    ("0x233510DE", True), ("0x233510DE:0x18BF10DE", True), ("0x233510DE:0x18C010DE", False),
    (["0x233510DE:0x18C010DE", "0x233510DE:0x18BF10DE"], True), ("0x233010DE:0x18BF10DE", False),
])
def test_subsystem_device_filters_on_the_h200_capture(tmp_path: Path, device_filter: Any, selected: bool) -> None:
    """mig-parted v0.15 (pkg/types/device.go Matches, at e2d5ad1f, the same as at bd7160f4) matches a
    `0xDDDDVVVV:0xSSSSssss` filter on the subsystem ids it reads from sysfs; the agent reads NVML's
    pciSubSystemId, which on the real H200 is the same pair (0x18bf, 0x10de in its sysfs)."""
    files = json.loads((CAPTURE / "files.json").read_text())["files"]
    sysfs = {name.rsplit("/", 1)[1]: int(text, 16) for name, text in files.items()
             if name.startswith("/sys/bus/pci/devices/0000:00:06.0/subsystem_")}
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    runtime = Runtime.build(Root(tmp_path / "root"), load_config(config, required=True), str(CAPTURE))
    try:
        [gpu] = runtime.nvml.inventory.read().gpus
    finally:
        runtime.nvml.close()
    assert gpu.pci_subsystem_id == sysfs["subsystem_device"] << 16 | sysfs["subsystem_vendor"] == 0x18BF10DE
    text = yaml.safe_dump({"version": "v1", "mig-configs": {"c": [
        {"device-filter": device_filter, "devices": "all", "mig-enabled": True, "mig-devices": {"1g.18gb": 7}}]}})
    [plan] = plans_for([gpu], parse_mig_config(text, "mig.yaml").select("c"))
    assert (plan.note != NOT_SELECTED) is selected and (len(plan.changes) > 0) is selected
