"""The unit and tmpfiles files, checked by systemd's own tools."""
from __future__ import annotations

import os
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
    for expected in ("Type=notify", "WatchdogSec=30s", "Restart=on-failure", "Before=kubelet.service",
                     "ExecStart=/usr/bin/gpu-agent run"):
        assert expected in lines
    assert any(line.startswith("ExecReload=") and "HUP" in line for line in lines)


def test_tmpfiles_creates_the_runtime_directory(tmp_path: Path) -> None:
    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles missing")
    subprocess.run([tmpfiles, "--create", f"--root={tmp_path}", str(SYSTEMD / "gpu-agent.tmpfiles")],
                   check=True, timeout=60, capture_output=True)
    runtime = tmp_path / "run/gpu-agent"
    assert runtime.is_dir() and stat.S_IMODE(runtime.stat().st_mode) == 0o750
