"""The conftest guard itself: an unmarked test can neither start a process nor touch a host path."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def test_an_unmarked_test_cannot_start_a_process() -> None:
    with pytest.raises(RuntimeError, match="started a real process"):
        subprocess.run(["true"], check=False)


def test_an_unmarked_test_cannot_read_or_write_host_paths() -> None:
    with pytest.raises(RuntimeError, match="touched the host path /etc/hostname"):
        Path("/etc/hostname").read_text()
    with pytest.raises(RuntimeError, match="touched the host path /var/lib/gpu-agent"):
        Path("/var/lib/gpu-agent").mkdir()


def test_its_own_tmp_root_is_fine(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("ok")
    assert (tmp_path / "x").read_text() == "ok"


@pytest.mark.subprocess
def test_a_marked_test_may_start_a_process() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0


def test_a_file_beside_the_clone_is_outside_it() -> None:
    """Test data lives in tests/data: a checkout beside the clone (../shared) is a host path like any other."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "cdi" / "schema.json"
    with pytest.raises(RuntimeError, match="touched the host path"):
        beside.read_text()
