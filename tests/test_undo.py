"""The agent owns what it writes: what the config stops asking for is undone on the next pass, and
`gpu-agent uninstall` returns the node to its pre-install bytes (in-process, on the simulator)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.plan import CreateLink, RemoveFile, RemoveLink, RestartService, RestoreFile
from harness import SimNode
from test_toolkit import CONTAINERD_V2, CONTAINERD_V3

# Debian's containerd validates every containerd config the toolkit stage writes: a real process.
pytestmark = pytest.mark.subprocess

TOOLKIT_BINARIES = ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook",
                    "/usr/bin/nvidia-ctk", "/usr/bin/nvidia-cdi-hook")
CONTAINERD_V1 = '[plugins.cri]\n  sandbox_image = "registry.k8s.io/pause:3.6"\n'
RUNTIME_CONFIGS: dict[str, dict[str, str]] = {
    "containerd-v1": {"/etc/containerd/config.toml": CONTAINERD_V1},
    "containerd-v2": {"/etc/containerd/config.toml": CONTAINERD_V2},
    "containerd-v3": {"/etc/containerd/config.toml": CONTAINERD_V3},
    "docker": {"/etc/docker/daemon.json": '{\n  "log-driver": "journald",\n  "data-root": "/srv/docker"\n}\n'},
    "crio": {"/etc/crio/crio.conf": '[crio.runtime]\ndefault_runtime = "runc"\n'},
    "all three": {"/etc/containerd/config.toml": CONTAINERD_V2, "/etc/docker/daemon.json": '{"debug": true}\n',
                  "/etc/crio/crio.conf": '[crio.runtime]\ndefault_runtime = "crun"\n'},
}
TOOLKIT_ON = {"toolkit": {"runtime_config": {"nvidia-container-runtime": {"log-level": "debug"}}}}


@pytest.fixture
def node(tmp_path: Path) -> SimNode:
    (tmp_path / "root").mkdir()
    sim = SimNode(tmp_path / "root", "dgx-h100")
    sim.sim("show")  # the machine and its driver userspace exist before anything of ours
    for binary in TOOLKIT_BINARIES:
        (sim.root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (sim.root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = sim.root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n")
    return sim


def host_files(sim: SimNode, *trees: str) -> dict[str, tuple[bytes, int]]:
    """Every file under the root (bytes and mode), but the agent's own state; or only under `trees`."""
    found = {}
    for path in sorted(sim.root.rglob("*")):
        relative = "/" + str(path.relative_to(sim.root))
        if path.is_file() and not path.is_symlink() and (
                any(relative.startswith(tree) for tree in trees) if trees
                else not relative.startswith("/var/lib/gpu-agent")):
            found[relative] = (path.read_bytes(), os.stat(path).st_mode & 0o7777)
    return found


def write(sim: SimNode, files: dict[str, str]) -> None:
    for host_path, text in files.items():
        path = sim.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def restarts(sim: SimNode, unit: str) -> int:
    return int(sim.machine.read().get("services", {}).get(unit, {}).get("restarts", 0))


def _half(first: bool) -> list[Any]:
    """The runtime configs, each in make test once across the two undo tests below (the other half of each in
    make test-slow): every config's undo is checked fast by one of them."""
    names = sorted(RUNTIME_CONFIGS)
    return [name if (n % 2 == 0) == first else pytest.param(name, marks=pytest.mark.slow)
            for n, name in enumerate(names)]


@pytest.mark.parametrize("fixture", _half(True))
def test_toolkit_off_removes_exactly_what_it_wrote_and_restores_what_it_replaced(node: SimNode, fixture: str) -> None:
    write(node, RUNTIME_CONFIGS[fixture])
    node.apply({"toolkit": {"enabled": False}})  # the driver converges first: only the toolkit is compared
    before = host_files(node)
    installed = node.apply(TOOLKIT_ON)
    assert installed.stage("toolkit").state == "ok", installed.stage("toolkit").message
    assert host_files(node) != before
    restarted = {unit: restarts(node, unit) for unit in ("containerd.service", "docker.service", "crio.service")}

    undone = node.apply({"toolkit": {"enabled": False}})
    assert undone.stage("owned-files").state == "ok", undone.stage("owned-files").message
    assert host_files(node) == before
    changes = undone.changes("owned-files")
    assert {c.path for c in changes if isinstance(c, RestoreFile)} <= set(RUNTIME_CONFIGS[fixture]) | {
        "/etc/nvidia-container-runtime/config.toml"}
    assert any(isinstance(c, RemoveFile) and c.path == "/var/run/cdi/nvidia.yaml" for c in changes)
    for unit in [c.unit for c in changes if isinstance(c, RestartService)]:
        assert restarts(node, unit) == restarted[unit] + 1  # once, for all its files
    assert Ledger(Root(node.root)).owned() == {}
    assert node.apply({"toolkit": {"enabled": False}}).changes("owned-files") == []  # nothing left to undo


@pytest.mark.parametrize("fixture", _half(False))
def test_uninstall_returns_the_node_to_its_pre_install_bytes(node: SimNode, fixture: str) -> None:
    write(node, RUNTIME_CONFIGS[fixture])
    before = host_files(node, "/etc", "/usr", "/var/run")
    settings: dict[str, Any] = {**TOOLKIT_ON, "driver": {"blacklist_nouveau": True,
                                                         "parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}}
    assert node.apply(settings).stage("toolkit").state == "ok"
    dry = node.uninstall(dry_run=True)
    assert dry.changes("owned-files") and host_files(node, "/etc", "/usr", "/var/run") != before
    done = node.uninstall()
    assert done.stage("owned-files").state == "ok", done.stage("owned-files").message
    assert host_files(node, "/etc", "/usr", "/var/run") == before
    assert not node.kernel("/etc/modprobe.d/gpu-agent-nvidia.conf").exists()
    assert not node.kernel("/etc/modprobe.d/blacklist-nouveau.conf").exists()
    assert node.uninstall().changes("owned-files") == []


def test_uninstall_removes_the_device_links_it_created_and_only_those(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    node = SimNode(tmp_path / "root", "t4")
    node.sim("show")
    theirs = node.kernel("/dev/char/195:255")  # udev's, made before the agent ran: not ours to remove
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.symlink_to("../nvidiactl")
    done = node.apply()
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    created = {c.path for c in done.changes("driver") if isinstance(c, CreateLink)}
    assert "/dev/char/195:0" in created and "/dev/char/195:255" not in created
    ledger = Ledger(Root(node.root))
    assert {path: link.target for path, link in ledger.links().items()} == {
        path: os.readlink(node.kernel(path)) for path in created}
    assert not any(isinstance(c, RemoveLink) for c in node.apply().changes("owned-files"))  # still wanted

    repointed = sorted(created - {"/dev/char/195:0"})[0]  # someone pointed one of ours elsewhere since
    node.kernel(repointed).unlink()
    node.kernel(repointed).symlink_to("../null")
    ours = created - {repointed}
    dry = node.uninstall(dry_run=True)
    assert {c.path for c in dry.changes("owned-files") if isinstance(c, RemoveLink)} == ours
    assert all(node.kernel(path).is_symlink() for path in created)  # a dry run changes nothing
    uninstalled = node.uninstall()
    assert uninstalled.stage("owned-files").state == "ok", uninstalled.stage("owned-files").message
    assert not any(os.path.lexists(node.kernel(path)) for path in ours)
    assert os.readlink(theirs) == "../nvidiactl" and os.readlink(node.kernel(repointed)) == "../null"
    assert repointed in uninstalled.stage("owned-files").message  # left as it is, and said so
    assert node.kernel("/dev/nvidia0").exists()  # the device nodes are the driver's, not undone
    assert ledger.links() == {} and node.uninstall().changes("owned-files") == []


@pytest.mark.parametrize("setting, file", [
    ({"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}, "/etc/modprobe.d/gpu-agent-nvidia.conf"),
    ({"blacklist_nouveau": True}, "/etc/modprobe.d/blacklist-nouveau.conf"),
])
def test_a_driver_setting_removed_removes_its_modprobe_d_file(node: SimNode, setting: dict[str, Any],
                                                              file: str) -> None:
    other = node.kernel("/etc/modprobe.d/local.conf")
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("options snd_hda_intel power_save=1\n")
    node.apply({"driver": setting, "toolkit": {"enabled": False}})
    assert node.kernel(file).exists()
    undone = node.apply({"toolkit": {"enabled": False}})
    assert undone.changes("owned-files") == [RemoveFile(file)]
    assert not node.kernel(file).exists() and other.read_text() == "options snd_hda_intel power_save=1\n"


def test_a_replaced_file_gets_its_original_back_with_its_mode(node: SimNode) -> None:
    mine = node.kernel("/etc/modprobe.d/blacklist-nouveau.conf")
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("# the admin's own\nblacklist nouveau\n")
    mine.chmod(0o600)
    node.apply({"driver": {"blacklist_nouveau": True}, "toolkit": {"enabled": False}})
    assert "Written by gpu-agent" in mine.read_text()
    undone = node.apply({"toolkit": {"enabled": False}})
    [restore] = undone.changes("owned-files")
    assert isinstance(restore, RestoreFile) and restore.path == "/etc/modprobe.d/blacklist-nouveau.conf"
    assert mine.read_text() == "# the admin's own\nblacklist nouveau\n" and mine.stat().st_mode & 0o777 == 0o600


def test_a_file_changed_since_it_was_written_is_left_and_named(node: SimNode) -> None:
    node.apply({"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}, "toolkit": {"enabled": False}})
    conf = node.kernel("/etc/modprobe.d/gpu-agent-nvidia.conf")
    conf.write_text("options nvidia NVreg_EnableGpuFirmware=1  # the admin took it over\n")
    undone = node.apply({"toolkit": {"enabled": False}})
    assert "left as they are, changed since gpu-agent wrote them: /etc/modprobe.d/gpu-agent-nvidia.conf" \
        in undone.stage("owned-files").message
    assert conf.read_text().endswith("# the admin took it over\n")
    assert Ledger(Root(node.root)).owned() == {}


def test_a_stage_that_cannot_tell_what_it_wants_undoes_nothing(node: SimNode) -> None:
    write(node, RUNTIME_CONFIGS["docker"])
    node.apply(TOOLKIT_ON)
    owned = set(Ledger(Root(node.root)).owned())
    (node.root / "etc/docker/daemon.json").write_text('{"broken": ')  # the toolkit cannot read its runtime now
    result = node.apply(TOOLKIT_ON)
    assert result.stage("toolkit").state == "failed" and result.changes("owned-files") == []
    assert set(Ledger(Root(node.root)).owned()) == owned


def test_the_ledger_records_the_original_before_the_first_write(node: SimNode) -> None:
    write(node, RUNTIME_CONFIGS["docker"])
    node.apply(TOOLKIT_ON)
    entry = Ledger(Root(node.root)).owned()["/etc/docker/daemon.json"]
    assert (entry.owner, entry.restart) == ("toolkit", "docker.service") and entry.original is not None
    assert (node.root / entry.original.lstrip("/")).read_text() == RUNTIME_CONFIGS["docker"]["/etc/docker/daemon.json"]
    created = Ledger(Root(node.root)).owned()["/var/run/cdi/nvidia.yaml"]
    assert created.original is None and created.restart is None



def test_backups_keep_the_last_five_changes_of_a_file(tmp_path: Path) -> None:
    from gpu_agent.host.files import BACKUP_DIR, KEEP_BACKUPS, backup

    root = Root(tmp_path)
    config = tmp_path / "etc/docker/daemon.json"
    config.parent.mkdir(parents=True)
    for n in range(8):
        config.write_text(f'{{"n": {n}}}\n')
        backup(root, "/etc/docker/daemon.json")
    kept = sorted(root(BACKUP_DIR).iterdir())
    assert len(kept) == KEEP_BACKUPS == 5
    assert sorted(path.read_text() for path in kept) == [f'{{"n": {n}}}\n' for n in range(3, 8)]


def test_uninstall_removes_the_cdi_specs_of_dra_claims_never_unprepared_and_only_those(tmp_path: Path) -> None:
    from gpu_agent.dra import claim_cdi

    (tmp_path / "root").mkdir()
    node = SimNode(tmp_path / "root", "t4")
    node.sim("show")
    root = Root(node.root)
    edits = {"gpu-0": claim_cdi.mps_edits("k8s.gpu.nvidia.com/claim/x")}
    claim_cdi.write(root, Ledger(root), "9f0a1b2c-3d4e-4f60-8a1b-2c3d4e5f6071", edits)
    ours = root("/var/run/cdi/k8s.gpu.nvidia.com-claim_9f0a1b2c-3d4e-4f60-8a1b-2c3d4e5f6071.json")
    theirs = root("/var/run/cdi/k8s.gpu.nvidia.com-claim_0e1d2c3b-4a59-4687-9a0b-1c2d3e4f5a6b.json")
    theirs.write_text("{}\n")  # NVIDIA's DRA driver's, say: not in the ledger
    assert ours.is_file()
    dry = node.uninstall(dry_run=True)
    assert RemoveFile("/var/run/cdi/k8s.gpu.nvidia.com-claim_9f0a1b2c-3d4e-4f60-8a1b-2c3d4e5f6071.json") in \
        dry.changes("owned-files")
    assert ours.is_file()  # a dry run: nothing
    done = node.uninstall()
    assert done.stage("owned-files").state == "ok", done.stage("owned-files").message
    assert not ours.exists() and theirs.read_text() == "{}\n" and Ledger(root).claim_specs() == {}
    assert node.uninstall().changes("owned-files") == []
