"""The unit and tmpfiles files, checked by systemd's own tools."""
from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"

# In CI a missing systemd-analyze is a failure (.ci/run installs it), not a skip.
pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.host_paths,  # systemd's own units, for systemd-analyze verify
    pytest.mark.skipif(shutil.which("systemd-analyze") is None and not os.environ.get("CI"),
                       reason="systemd-analyze missing: .ci/run installs systemd"),
]


def _unit_root(tmp_path: Path, unit_text: str) -> Path:
    """A root holding systemd's own units, the programs the unit runs, and our unit."""
    root = tmp_path / "root"
    units = root / "usr/lib/systemd/system"
    units.mkdir(parents=True)
    for unit in Path("/usr/lib/systemd/system").iterdir():
        if unit.is_file() and not unit.is_symlink():
            shutil.copy(unit, units)
    for program in ("usr/bin/gpu-agent", "bin/sh"):
        (root / program).parent.mkdir(parents=True, exist_ok=True)
        (root / program).write_text("#!/bin/sh\n")
        (root / program).chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/gpu-agent.service").write_text(unit_text)
    return root


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", "/etc/systemd/system/gpu-agent.service"],
        capture_output=True, text=True, timeout=60,
    )


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    result = _verify(_unit_root(tmp_path, (SYSTEMD / "gpu-agent.service").read_text()))
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr


def test_verify_does_catch_a_broken_unit(tmp_path: Path) -> None:
    broken = (SYSTEMD / "gpu-agent.service").read_text().replace("Type=notify", "Type=notifyy")
    result = _verify(_unit_root(tmp_path, broken))
    assert "Failed to parse service type" in result.stderr


def test_unit_declares_the_daemon_contract() -> None:
    lines = (SYSTEMD / "gpu-agent.service").read_text().splitlines()
    for expected in ("Type=notify", "WatchdogSec=30s", "Restart=on-failure", "ExecStart=/usr/bin/gpu-agent run"):
        assert expected in lines
    assert any(line.startswith("ExecReload=") and "HUP" in line for line in lines)


def _writable(unit: str) -> list[str]:
    """The folders ProtectSystem=strict leaves the service writable: ReadWritePaths and StateDirectory."""
    found = []
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key == "ReadWritePaths":
            found += [path.lstrip("-") for path in value.split()]
        elif key == "StateDirectory":
            found += [f"/var/lib/{name}" for name in value.split()]
    return found


def test_every_place_the_agent_writes_is_writable_under_the_unit() -> None:
    """Each file a stage may own, the kubelet's device-plugin folders (the plugin's socket) and the MPS
    control daemons' folder, under ProtectSystem=strict: one missing is a stage that works in the tests
    and fails on every installed node."""
    from gpu_agent.config.plugin import DEVICE_PLUGIN_DIR, MICROK8S_DEVICE_PLUGIN_DIR
    from gpu_agent.host.owned import OWNABLE
    from gpu_agent.mps.layout import MPS_ROOT

    writable = _writable((SYSTEMD / "gpu-agent.service").read_text())
    needed = [posixpath.dirname(pattern) for pattern in OWNABLE]
    needed += [DEVICE_PLUGIN_DIR, MICROK8S_DEVICE_PLUGIN_DIR, MPS_ROOT]
    needed = [re.sub(r"^/var/run/", "/run/", path) for path in needed]  # /var/run is a link to /run
    missing = [path for path in needed
               if not any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in writable)]
    assert not missing, f"add ReadWritePaths=-<folder> to systemd/gpu-agent.service for: {missing}"


def test_the_vfio_switch_may_write_every_sysfs_path_it_writes() -> None:
    """host/vfio.py's writes (driver_override, a driver's bind and unbind, drivers_probe) under the unit's writable
    folders."""
    from gpu_agent.host import vfio

    writable = _writable((SYSTEMD / "gpu-agent.service").read_text())
    written = [vfio.override_path("0000:9a:00.0"), vfio.driver_file("nvidia", "unbind"),
               vfio.driver_file("vfio-pci", "bind"), vfio.driver_file("", "bind"), vfio.PROBE]
    missing = [path for path in written if not any(path.startswith(folder.rstrip("/") + "/") for folder in writable)]
    assert not missing, f"add ReadWritePaths= to systemd/gpu-agent.service for: {missing}"


def test_tmpfiles_creates_the_runtime_directory(tmp_path: Path) -> None:
    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles missing")
    subprocess.run([tmpfiles, "--create", f"--root={tmp_path}", str(SYSTEMD / "gpu-agent.tmpfiles")],
                   check=True, timeout=60, capture_output=True)
    runtime = tmp_path / "run/gpu-agent"
    assert runtime.is_dir() and stat.S_IMODE(runtime.stat().st_mode) == 0o750
    # ReadWritePaths=-/run/nvidia/mps makes it writable only when it is there as the unit starts: a node booted
    # without it could not make its MPS daemons' folders (ProtectSystem=strict leaves /run read-only)
    from gpu_agent.mps.layout import MPS_ROOT

    mps = tmp_path / MPS_ROOT.lstrip("/")
    assert mps.is_dir() and stat.S_IMODE(mps.stat().st_mode) == 0o755
    assert f"ReadWritePaths=-{MPS_ROOT}" in (SYSTEMD / "gpu-agent.service").read_text().splitlines()


def test_the_directories_that_may_appear_late_are_the_units_and_so_is_the_exit_status() -> None:
    """host/sandbox.py lists the ReadWritePaths=-... entries (writable only when they exist as the unit starts)
    rather than read the unit at run time; the unit restarts the agent on the status it exits with for them."""
    from gpu_agent.host.sandbox import EXIT_RESTART, LATE_WRITABLE

    unit = (SYSTEMD / "gpu-agent.service").read_text()
    optional = [path[1:] for line in unit.splitlines() if line.startswith("ReadWritePaths=")
                for path in line.partition("=")[2].split() if path.startswith("-")]
    assert sorted(optional) == sorted(LATE_WRITABLE)
    assert f"RestartForceExitStatus={EXIT_RESTART}" in unit.splitlines()


MPS_TEMPLATE = SYSTEMD / "gpu-agent-mps@.service"
SHM_MOUNT = SYSTEMD / "run-nvidia-mps-shm.mount"


def _settings(unit: str) -> dict[str, list[str]]:
    """Each key of a unit file, with every value it is given, in order."""
    found: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def _verify_mps_units(tmp_path: Path, template: str) -> subprocess.CompletedProcess[str]:
    root = _unit_root(tmp_path, (SYSTEMD / "gpu-agent.service").read_text())
    (root / "usr/bin/nvidia-cuda-mps-control").write_text("#!/bin/sh\n")  # systemd-analyze looks in /usr/bin only
    (root / "usr/bin/nvidia-cuda-mps-control").chmod(0o755)
    (root / "etc/systemd/system/gpu-agent-mps@.service").write_text(template)
    shutil.copy(SHM_MOUNT, root / "etc/systemd/system")
    return subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                           "/etc/systemd/system/gpu-agent-mps@nvidia.com-gpu.service",
                           "/etc/systemd/system/run-nvidia-mps-shm.mount"], capture_output=True, text=True, timeout=60)


def test_the_mps_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    result = _verify_mps_units(tmp_path / "good", MPS_TEMPLATE.read_text())
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr
    broken = _verify_mps_units(tmp_path / "broken", MPS_TEMPLATE.read_text().replace("Type=forking", "Type=forkin"))
    assert "Failed to parse service type" in broken.stderr


def test_the_mps_template_is_what_the_agent_expects() -> None:
    """ExecStart= fixed and found where the agent looks for the binary; the directories, pid file and record
    derived from the instance (%I: the resource) as gpu_agent.mps.layout derives them; the tmpfs as /dev/shm
    and required; systemd's limits the agent waits out; nothing that ties a daemon to gpu-agent.service, so
    that `systemctl restart gpu-agent` leaves it running; nothing that enables or restarts it on its own."""
    from gpu_agent.mps.control import BINARY, BINARY_DIRS, START_LIMIT_S
    from gpu_agent.mps.layout import LOG_ENV, PID_FILE, PIPE_ENV, SHM_DIR, SHM_UNIT, log_dir, pipe_dir, record_path

    unit = _settings(MPS_TEMPLATE.read_text())
    assert unit["ExecStart"] == [f"{BINARY} -d"] and unit["Type"] == ["forking"]
    assert unit["ExecSearchPath"] == [":".join(BINARY_DIRS)]
    assert unit["PIDFile"] == [f"{pipe_dir('%I')}/{PID_FILE}"]
    assert unit["Environment"] == [f"{PIPE_ENV}={pipe_dir('%I')} {LOG_ENV}={log_dir('%I')}"]
    assert unit["EnvironmentFile"] == [record_path("%I")]  # CUDA_VISIBLE_DEVICES, written before each start
    assert unit["ReadWritePaths"] == [pipe_dir("%I").rsplit("/", 1)[0]] and unit["ProtectSystem"] == ["strict"]
    assert unit["BindPaths"] == [f"{SHM_DIR}:/dev/shm"]
    assert unit["Requires"] == [SHM_UNIT] and unit["After"] == [SHM_UNIT]
    assert unit["TimeoutStartSec"] == unit["TimeoutStopSec"] == [f"{START_LIMIT_S:g}s"]
    for absent in ("Restart", "PartOf", "BindsTo", "WantedBy", "RequiredBy"):
        assert absent not in unit, absent
    assert "[Install]" not in MPS_TEMPLATE.read_text() + SHM_MOUNT.read_text()
    mount = _settings(SHM_MOUNT.read_text())
    assert SHM_MOUNT.name == SHM_UNIT and mount["Where"] == [SHM_DIR] and mount["Type"] == ["tmpfs"]
    assert mount["LazyUnmount"] == ["yes"] and mount["TimeoutSec"] == [f"{START_LIMIT_S:g}s"]
    # the options gpu-agent itself mounts with (without systemd), the size as a share of the memory
    from gpu_agent.host.paths import Root
    from gpu_agent.mps import shm

    ours = shm.options(Root("/nonexistent")).split(",")
    assert mount["Options"][0].split(",")[:-1] == ours[:-1] and mount["Options"][0].endswith(",size=50%")


def test_the_agent_may_write_the_mps_records_and_the_units_are_packaged() -> None:
    """The record lies in the resource's directory, writable to the agent's unit; the packages carry both
    MPS units beside the agent's."""
    from gpu_agent.mps.layout import MPS_ROOT, record_path

    writable = _writable((SYSTEMD / "gpu-agent.service").read_text())
    assert any(record_path("nvidia.com/gpu").startswith(folder + "/") for folder in writable) and MPS_ROOT in writable
    build = (SYSTEMD.parent / "packaging/build.py").read_text()
    for unit in (MPS_TEMPLATE, SHM_MOUNT):
        assert f'"/usr/lib/systemd/system/{unit.name}"' in build, unit.name


# k3s's unit as its install script writes it (k3s-io/k3s install.sh, create_systemd_service_file), reduced to
# what orders it: our own text with its keys.
K3S_UNIT = """[Unit]
Description=Lightweight Kubernetes
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
ExecStart=/usr/local/bin/k3s agent
KillMode=process
Restart=always

[Install]
WantedBy=multi-user.target
"""


def _verify_with_k3s(tmp_path: Path, drop_in: str = "") -> subprocess.CompletedProcess[str]:
    root = _unit_root(tmp_path, (SYSTEMD / "gpu-agent.service").read_text())
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/bin/k3s").write_text("#!/bin/sh\n")
    (root / "usr/local/bin/k3s").chmod(0o755)
    (root / "etc/systemd/system/k3s-agent.service").write_text(K3S_UNIT)
    if drop_in:
        (root / "etc/systemd/system/k3s-agent.service.d").mkdir()
        (root / "etc/systemd/system/k3s-agent.service.d/order.conf").write_text(drop_in)
    return subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                           "/etc/systemd/system/gpu-agent.service", "/etc/systemd/system/k3s-agent.service"],
                          capture_output=True, text=True, timeout=60)


def test_the_kubelets_units_start_after_the_agent_and_no_ordering_cycle_follows(tmp_path: Path) -> None:
    """The units whose kubelet waits for the agent's first pass are those the agent's restarts take care
    not to wait for (toolkit/services.py); with k3s's own unit installed, systemd finds no cycle. A k3s
    ordered before the agent as well would be one: the check sees it."""
    from gpu_agent.toolkit.services import ORDERED_AFTER_AGENT

    before = [unit for value in _settings((SYSTEMD / "gpu-agent.service").read_text())["Before"]
              for unit in value.split()]
    assert before == list(ORDERED_AFTER_AGENT)
    result = _verify_with_k3s(tmp_path / "ok")
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr
    cycle = _verify_with_k3s(tmp_path / "cycle", "[Unit]\nBefore=gpu-agent.service\n")
    assert "ordering cycle" in cycle.stdout + cycle.stderr
