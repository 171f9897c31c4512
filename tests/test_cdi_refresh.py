"""The toolkit package's own CDI refresh beside the agent's CDI stage, and specs that define a device twice.

The units are laid out as nvidia-container-toolkit 1.18+'s packages lay them out (NVIDIA/nvidia-container-toolkit
packaging/debian/nvidia-container-toolkit-base.install at v1.20.0, commit f0c382c8: both unit files in
/lib/systemd/system, enabled by deployments/systemd/90-nvidia-container-toolkit.preset), with the udev rule of
commit cc6af05a (release-1.20, after v1.20.0) in /lib/udev/rules.d. Their contents here are our own stand-ins:
only their names, places and [Install] sections matter to the agent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from harness import SimNode, run_cli

from gpu_agent.host.paths import Root
from gpu_agent.toolkit import cdi_duplicates, cdi_refresh

PATH_UNIT, SERVICE = cdi_refresh.UNITS
SPEC = "var/run/cdi/nvidia.yaml"
# What `nvidia-ctk cdi generate` left before the agent came: the same kind and device names as the agent's.
REFRESHED = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
             "devices": [{"name": name, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
                         for name in ("0", "all")],
             "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]}}


@pytest.fixture
def node(root: Path) -> Path:
    """The toolkit 1.17.8 binaries (the stage's minimum) and Docker's daemon.json: a runtime that reads the spec."""
    for binary in ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-ctk",
                   "/usr/bin/nvidia-cdi-hook"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.20.0-1\n\n")
    (root / "etc/docker").mkdir(parents=True)
    (root / "etc/docker/daemon.json").write_text("{}\n")
    return root


def install_refresh(root: Path, enabled: bool = True, udev: bool = True) -> None:
    """The two units in /lib/systemd/system with an [Install] section, enabled as the preset leaves them."""
    for unit in cdi_refresh.UNITS:
        path = root / "lib/systemd/system" / unit
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# stand-in for the toolkit package's {unit}\n[Install]\nWantedBy=multi-user.target\n")
        if enabled:
            wants = root / "etc/systemd/system/multi-user.target.wants" / unit
            wants.parent.mkdir(parents=True, exist_ok=True)
            wants.symlink_to(f"/lib/systemd/system/{unit}")
    if udev:
        rule = root / "lib/udev/rules.d" / cdi_refresh.UDEV_RULE
        rule.parent.mkdir(parents=True, exist_ok=True)
        rule.write_text('ACTION=="add", SUBSYSTEM=="module", KERNEL=="nvidia", TAG+="systemd", '
                        'ENV{SYSTEMD_WANTS}+="nvidia-cdi-refresh.service"\n')


def write_spec(root: Path, relative: str, spec: dict) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec))
    return path


def units(sim: SimNode) -> dict[str, tuple[str, str]]:
    """Each refresh unit's (UnitFileState, ActiveState) as the simulated systemctl shows it."""
    from gpu_agent.sim.services import SimServices

    machine = sim.machine
    machine.ensure(sim.simulate)
    services = SimServices(machine, 5)
    return {unit: (state.file_state, state.active) for unit in cdi_refresh.UNITS
            if (state := services.state(unit)) is not None}


def calls(sim: SimNode) -> dict[str, list[str]]:
    machine = sim.machine
    machine.ensure(sim.simulate)
    services = machine.read().get("services", {})
    return {unit: services.get(unit, {}).get("calls", []) for unit in cdi_refresh.UNITS}


def ledger_units(root: Path) -> dict:
    path = root / "var/lib/gpu-agent/ledger.json"
    return json.loads(path.read_text()).get("units", {}) if path.exists() else {}


def test_the_enabled_refresh_is_taken_over_before_the_spec_is_written_and_put_back_exactly(node: Path) -> None:
    install_refresh(node)
    spec = write_spec(node, SPEC, REFRESHED)
    before = spec.read_bytes()
    sim = SimNode(node, "dgx-h100")
    assert units(sim) == {PATH_UNIT: ("enabled", "active"), SERVICE: ("enabled", "active")}

    done = sim.apply()
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    kinds = [(change.kind, getattr(change, "unit", None) or getattr(change, "path", None))
             for change in done.changes("cdi")]
    assert kinds == [("TakeOverUnit", PATH_UNIT), ("TakeOverUnit", SERVICE), ("WriteFile", "/var/run/cdi/nvidia.yaml")]
    assert units(sim) == {PATH_UNIT: ("masked", "inactive"), SERVICE: ("masked", "inactive")}
    assert calls(sim) == {PATH_UNIT: ["stop", "disable", "mask"], SERVICE: ["stop", "disable", "mask"]}
    assert ledger_units(node) == {unit: {"owner": "cdi", "file_state": "enabled", "active": True}
                                  for unit in cdi_refresh.UNITS}
    message = done.stage("cdi").message
    assert f"found the toolkit package's {PATH_UNIT} (masked, inactive), {SERVICE} (masked, inactive)" in message
    assert "writing /var/run/cdi/nvidia.yaml" in message
    assert f"udev rule /lib/udev/rules.d/{cdi_refresh.UDEV_RULE} starts the service" in message
    assert f"taken over: {PATH_UNIT}, {SERVICE} stopped, disabled and masked (put back at uninstall)" in message
    assert yaml.safe_load(spec.read_text())["devices"] != REFRESHED["devices"]  # the agent's spec now

    again = sim.apply()
    assert again.ok and not again.changes("cdi") and calls(sim)[SERVICE] == ["stop", "disable", "mask"]

    gone = sim.uninstall()
    assert gone.ok, gone.stage("owned-files").message
    assert [(c.kind, getattr(c, "unit", None)) for c in gone.changes("owned-files") if c.kind == "GiveBackUnit"] == [
        ("GiveBackUnit", SERVICE), ("GiveBackUnit", PATH_UNIT)]  # the path unit's service unmasked first
    assert units(sim) == {PATH_UNIT: ("enabled", "active"), SERVICE: ("enabled", "active")}
    assert calls(sim)[PATH_UNIT][3:] == ["unmask", "enable", "start"]
    assert spec.read_bytes() == before and ledger_units(node) == {}


def test_check_says_what_it_found_and_would_do_and_changes_nothing(node: Path) -> None:
    """The toolkit upgraded to 1.18+ under a running agent: its units appear."""
    assert SimNode(node, "dgx-h100").apply().ok
    install_refresh(node)
    result = run_cli("--simulate", "dgx-h100", "check", root=node)
    assert result.returncode == 2 and "[-] cdi: would make 2 change(s)" in result.stdout
    assert f"needs: take over {PATH_UNIT} (enabled, active): stop, disable, mask" in result.stdout
    assert f"needs: take over {SERVICE} (enabled, active): stop, disable, mask" in result.stdout
    assert f"found the toolkit package's {PATH_UNIT} (enabled, active)" in result.stdout
    sim = SimNode(node, "dgx-h100")
    assert calls(sim) == {PATH_UNIT: [], SERVICE: []} and ledger_units(node) == {}


def test_a_disabled_refresh_is_masked_and_given_back_disabled(node: Path) -> None:
    install_refresh(node, enabled=False, udev=False)
    sim = SimNode(node, "dgx-h100")
    sim.sim("fail", "stop", "--unit", "none.service", "--times", "1")  # a fault for another unit: no effect here
    assert units(sim)[SERVICE] == ("disabled", "active")
    assert sim.apply().ok
    assert calls(sim)[SERVICE] == ["stop", "mask"]  # nothing to disable
    assert sim.uninstall().ok
    assert units(sim)[SERVICE] == ("disabled", "active") and calls(sim)[SERVICE][2:] == ["unmask", "start"]


def test_a_refresh_the_admin_masked_is_left_alone(node: Path) -> None:
    install_refresh(node)
    for unit in cdi_refresh.UNITS:
        (node / "etc/systemd/system" / unit).symlink_to("/dev/null")
    sim = SimNode(node, "dgx-h100")
    done = sim.apply()
    assert done.ok and not any(c.kind == "TakeOverUnit" for c in done.changes("cdi"))
    assert ledger_units(node) == {} and calls(sim) == {PATH_UNIT: [], SERVICE: []}
    assert f"found the toolkit package's {PATH_UNIT} (masked, " in done.stage("cdi").message
    assert sim.uninstall().ok and units(sim)[SERVICE][0] == "masked"


def test_a_refresh_started_again_is_stopped_and_what_it_was_first_is_kept(node: Path) -> None:
    """A package upgrade's scripts unmask nothing, but an admin may: the next pass takes it over again."""
    install_refresh(node)
    sim = SimNode(node, "dgx-h100")
    assert sim.apply().ok
    from gpu_agent.sim.services import SimUnits

    SimUnits(sim.machine)("unmask", SERVICE)
    SimUnits(sim.machine)("start", SERVICE)
    done = sim.apply()
    assert done.ok and [c.unit for c in done.changes("cdi") if c.kind == "TakeOverUnit"] == [SERVICE]
    assert units(sim)[SERVICE] == ("masked", "inactive")
    assert ledger_units(node)[SERVICE] == {"owner": "cdi", "file_state": "enabled", "active": True}


def test_a_masked_refresh_refuses_to_start(node: Path) -> None:
    """The mask is what holds the udev rule's and the RPM's starts off (only a mask does)."""
    install_refresh(node)
    sim = SimNode(node, "dgx-h100")
    assert sim.apply().ok
    from gpu_agent.errors import AgentError
    from gpu_agent.sim.services import SimUnits

    with pytest.raises(AgentError, match=f"Unit {SERVICE} is masked"):
        SimUnits(sim.machine)("start", SERVICE)


def test_the_refresh_is_given_back_when_the_agent_stops_writing_the_spec(node: Path) -> None:
    install_refresh(node)
    sim = SimNode(node, "dgx-h100")
    assert sim.apply().ok and ledger_units(node)
    done = sim.apply({"toolkit": {"cdi": {"enabled": False}}})
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    assert {c.unit for c in done.changes("owned-files") if c.kind == "GiveBackUnit"} == set(cdi_refresh.UNITS)
    assert units(sim) == {PATH_UNIT: ("enabled", "active"), SERVICE: ("enabled", "active")}
    assert ledger_units(node) == {} and not (node / SPEC).exists()


def test_a_forged_unit_in_the_ledger_is_refused_and_left_alone(node: Path) -> None:
    sim = SimNode(node, "dgx-h100")
    assert sim.apply().ok
    ledger = node / "var/lib/gpu-agent/ledger.json"
    document = json.loads(ledger.read_text())
    document["units"] = {"ssh.service": {"owner": "cdi", "file_state": "enabled", "active": True}}
    ledger.write_text(json.dumps(document))
    gone = sim.uninstall()
    message = gone.stage("owned-files").message
    assert "unit ssh.service: not a unit gpu-agent takes over" in message and "left alone" in message
    assert "ssh.service" not in sim.machine.read().get("services", {}) and ledger_units(node) == {}


def test_the_refresh_output_is_read_from_its_env_file(root: Path) -> None:
    env = root / cdi_refresh.ENV_FILE.lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text(f"# {cdi_refresh.OUTPUT_VARIABLE}=/var/run/cdi/nvidia.yaml\n"
                   f"{cdi_refresh.OUTPUT_VARIABLE}='/etc/cdi/nvidia.yaml'\n")
    assert cdi_refresh.output(Root(root)) == "/etc/cdi/nvidia.yaml"
    env.write_text("OTHER=1\n")
    assert cdi_refresh.output(Root(root)) == cdi_refresh.DEFAULT_OUTPUT


# --- the same device in two specs --------------------------------------------------------------------


def test_a_spec_in_etc_cdi_defining_the_agents_devices_fails_the_stage_naming_both_files(node: Path) -> None:
    """`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`, as the toolkit's docs suggest, beside the agent's."""
    write_spec(node, "etc/cdi/nvidia.yaml", REFRESHED)
    done = SimNode(node, "dgx-h100").apply()
    run = done.stage("cdi")
    assert run.state == "failed"
    assert ("devices defined by more than one CDI spec, which CDI readers cannot tell apart: nvidia.com/gpu=0, "
            "nvidia.com/gpu=all in /var/run/cdi/nvidia.yaml and /etc/cdi/nvidia.yaml") in run.message
    assert (node / SPEC).exists()  # the agent's own spec is still written
    (node / "etc/cdi/nvidia.yaml").unlink()
    assert SimNode(node, "dgx-h100").apply().ok


def test_other_kinds_and_other_names_are_no_duplicates(node: Path) -> None:
    write_spec(node, "etc/cdi/other.yaml", {**REFRESHED, "kind": "example.com/gpu"})
    write_spec(node, "etc/cdi/nvidia-extra.json", {**REFRESHED, "devices": [
        {"name": "GPU-not-on-this-node", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}}]})
    (node / "etc/cdi/broken.yaml").write_text("kind: [unclosed\n")
    assert SimNode(node, "dgx-h100").apply().ok


def test_duplicates_between_two_specs_the_agent_did_not_write_are_named_too(root: Path) -> None:
    write_spec(root, "etc/cdi/a.yaml", {**REFRESHED, "kind": "example.com/nic"})
    write_spec(root, "var/run/cdi/b.json", {**REFRESHED, "kind": "example.com/nic"})
    found = cdi_duplicates.duplicates(cdi_duplicates.other_specs(Root(root), ()))
    assert found == {"example.com/nic=0": ["/etc/cdi/a.yaml", "/var/run/cdi/b.json"],
                     "example.com/nic=all": ["/etc/cdi/a.yaml", "/var/run/cdi/b.json"]}
    assert cdi_duplicates.describe(found, most=1) == (
        "example.com/nic=0 and 1 more in /etc/cdi/a.yaml and /var/run/cdi/b.json")


def test_var_run_linked_to_run_is_scanned_once(root: Path) -> None:
    (root / "run").mkdir()
    (root / "var").mkdir()
    (root / "var/run").symlink_to("/run")
    write_spec(root, "run/cdi/nvidia.yaml", REFRESHED)
    specs = cdi_duplicates.other_specs(Root(root), (), (*cdi_duplicates.SPEC_DIRS, "/run/cdi"))
    assert list(specs) == ["/run/cdi/nvidia.yaml"]
