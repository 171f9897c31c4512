"""The conftest guard itself: an unmarked test can neither start a process nor touch a host path."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
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


def test_beside_the_clone_only_upstreams_data_may_be_read(tmp_path: Path) -> None:
    """../shared/upstream and ../shared/schemas are read by the tests that check the agent against
    upstream's files (tests/upstream_data.py); nothing there is written, and the rest of ../shared
    (hardware captures, hooks) is a host path like any other. The guard decides before the file system
    does, so it holds whether or not ../shared is there."""
    from upstream_data import SHARED

    schema = SHARED / "schemas" / "cdi" / "schema.json"
    if schema.is_file():
        assert "$schema" in schema.read_text()
    with pytest.raises(RuntimeError, match="touched the host path"):
        schema.with_name("planted.json").write_text("{}")
    with pytest.raises(RuntimeError, match="touched the host path"):
        (SHARED / "upstream" / "planted.yaml").open("a")
    with pytest.raises(RuntimeError, match="touched the host path"):
        (SHARED / "upstream" / "made").mkdir()
    with pytest.raises(RuntimeError, match="touched the host path"):
        (SHARED / "hardware" / "README.md").read_text()
    with pytest.raises(RuntimeError, match="touched the host path"):
        (SHARED / "DESIGN.md").read_text()


@pytest.mark.subprocess
def test_a_fast_suite_test_over_its_time_fails_and_a_slow_one_may_take_longer(tmp_path: Path) -> None:
    """conftest's limit, made 0.2 s, in a pytest of its own: the sleep of 0.5 s fails unless marked slow."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_sleeps.py").write_text(
        "import time\n\nimport conftest\nimport pytest\n\n"
        "conftest.CALL_LIMIT_S, conftest.CALL_HEADROOM, conftest._load_per_cpu = 0.2, 1.0, lambda: 0.0\n\n\n"
        "def test_fast():\n    pass\n\n\n"
        "def test_too_long():\n    time.sleep(0.5)\n\n\n"
        "def test_failing_too_long():\n    time.sleep(0.5)\n    assert 1 == 2\n\n\n"
        "@pytest.mark.slow\ndef test_slow():\n    time.sleep(0.5)\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                             "-rf", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "2 failed, 2 passed" in result.stdout, result.stdout + result.stderr
    assert re.search(r"FAILED test_sleeps.py::test_too_long - ", result.stdout)
    assert re.search(r"this test took 0\.\d s, over the 0.2 s a test may take at this load", result.stdout)
    assert "FAILED test_sleeps.py::test_failing_too_long - assert 1 == 2" in result.stdout  # its own error
