"""The daemon's config (config/validate.py): validated by a child, read back from the cache when the
file is unchanged, and the cache never trusted when it is not exactly what this agent wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable

import pytest

from gpu_agent.config import validate
from gpu_agent.config.cache import CACHE_PATH, _checksum
from gpu_agent.config.loader import load_config
from gpu_agent.errors import AgentError, ConfigError
from gpu_agent.host.paths import Root

REPO = Path(__file__).resolve().parent.parent

GOOD = "version: v1\nreconcile:\n  interval_seconds: 30\nkubernetes:\n  mig_strategy: mixed\n"


@pytest.fixture
def no_child(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail any validation child started; the list records the attempts."""
    started: list[str] = []

    def refuse(argv: Any, timeout: float, env: Any = None) -> None:
        started.append(argv[-1])
        raise AgentError("this test expected no validation child")

    monkeypatch.setattr(validate.proc, "start", refuse)
    return started


def load(root: Path, config: Path) -> Any:
    return validate.load_daemon_config(config, True, Root(root))


def cache_of(root: Path) -> Path:
    return root / CACHE_PATH.lstrip("/")


@pytest.mark.subprocess
def test_an_unchanged_file_is_read_back_without_a_child(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    first = load(root, config)
    assert first == load_config(config, required=True)  # the same config, source and digest as in-process
    assert first.config.reconcile.interval_seconds == 30.0
    assert oct(cache_of(root).stat().st_mode & 0o777) == "0o600"

    started: list[str] = []
    monkeypatch.setattr(validate.proc, "start", lambda argv, timeout, env: started.append(argv) or 1 / 0)
    caplog.clear()
    assert load(root, config) == first and started == []
    assert "kubernetes.mig_strategy: deprecated: write mig.strategy: mixed instead" in caplog.text  # logged again


@pytest.mark.subprocess
def test_an_edited_file_is_validated_again(root: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    load(root, config)
    config.write_text(GOOD.replace("30", "40"))
    assert load(root, config).config.reconcile.interval_seconds == 40.0
    assert json.loads(cache_of(root).read_text())["config"]["reconcile"]["interval_seconds"] == 40.0


def _rewrite(change: Callable[[dict[str, Any]], None], checksum: bool) -> Callable[[Path], None]:
    """A tampering: `change` the entry, with its checksum made to match again or not."""
    def tamper(path: Path) -> None:
        entry = json.loads(path.read_text())
        change(entry)
        if checksum:
            entry["checksum"] = _checksum(entry["key"], entry["config"], entry["warnings"])
        path.write_text(json.dumps(entry))
    return tamper


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


TAMPERINGS = {
    "garbage": lambda path: path.write_bytes(b"\x00\xff not json"),
    "truncated": lambda path: path.write_text(path.read_text()[:100]),
    "a value changed": _rewrite(lambda e: e["config"]["reconcile"].update(interval_seconds=1.0), checksum=False),
    "a warning added": _rewrite(lambda e: e["warnings"].append("forged"), checksum=False),
    "an unknown key, checksum matching": _rewrite(lambda e: e["config"]["reconcile"].update(extra=1), checksum=True),
    "a wrong type, checksum matching": _rewrite(lambda e: e["config"]["reconcile"].update(interval_seconds="1"),
                                                checksum=True),
    "a number as text, checksum matching": _rewrite(lambda e: e["config"]["nvml"].update(call_timeout_seconds=5),
                                                    checksum=True),
    "a section missing, checksum matching": _rewrite(lambda e: e["config"].pop("mig"), checksum=True),
    "a literal out of its choices, checksum matching": _rewrite(
        lambda e: e["config"]["health"].update(unready_when="some"), checksum=True),
    "NaN, checksum matching": lambda path: path.write_text(path.read_text().replace(
        '"interval_seconds": 30.0', '"interval_seconds": NaN')),
    "a FIFO": _fifo,
    "a directory": lambda path: (path.unlink(), path.mkdir()),
}


@pytest.mark.subprocess
@pytest.mark.parametrize("tamper", list(TAMPERINGS.values()), ids=list(TAMPERINGS))
def test_a_damaged_or_tampered_cache_is_ignored_and_the_file_validated_again(
        root: Path, tmp_path: Path, tamper: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    expected = load(root, config)
    tamper(cache_of(root))
    started: list[Any] = []
    real_start = validate.proc.start
    monkeypatch.setattr(validate.proc, "start",
                        lambda argv, timeout, env: started.append(argv) or real_start(argv, timeout, env))
    assert load(root, config) == expected
    assert len(started) == 1  # validated again, by a child


@pytest.mark.subprocess
def test_an_invalid_file_gets_the_loaders_own_message(root: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nreconcile:\n  interval_seconds: '30'\n  extra: 1\n")
    with pytest.raises(ConfigError) as in_process:
        load_config(config, required=True)
    with pytest.raises(ConfigError) as from_child:
        load(root, config)
    assert str(from_child.value) == str(in_process.value)
    assert "config.yaml:3: reconcile.interval_seconds" in str(from_child.value)
    assert not cache_of(root).exists()  # nothing remembered of an invalid file


def test_a_child_that_cannot_run_leaves_the_validation_to_this_process(root: Path, tmp_path: Path,
                                                                        no_child: list[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    assert load(root, config) == load_config(config, required=True)
    assert no_child == [str(config)]


def test_a_missing_optional_file_gives_the_defaults_without_a_child(root: Path, tmp_path: Path,
                                                                     no_child: list[str]) -> None:
    loaded = validate.load_daemon_config(tmp_path / "missing.yaml", False, Root(root))
    assert loaded == load_config(tmp_path / "missing.yaml", required=False)
    with pytest.raises(ConfigError, match="missing.yaml: no such file"):
        validate.load_daemon_config(tmp_path / "missing.yaml", True, Root(root))
    assert no_child == []


@pytest.mark.subprocess
def test_a_forked_child_answers_as_the_spawned_one(root: Path, tmp_path: Path) -> None:
    """What `gpu-agent run` does at start: the same config, message and cache as a spawned child."""
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    assert validate.start(config, True, Root(root), fork=True).result() == load_config(config, required=True)
    assert cache_of(root).exists()
    config.write_text("version: v1\nhttp:\n  listen: nowhere\n")
    with pytest.raises(ConfigError) as forked:
        validate.start(config, True, Root(root), fork=True).result()
    assert str(forked.value).endswith("config.yaml:3: http.listen: expected HOST:PORT such as 127.0.0.1:9445, "
                                      "got 'nowhere'")


@pytest.mark.subprocess
def test_a_forked_child_that_fails_leaves_the_validation_to_this_process(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)

    def crash(path: Path) -> tuple[int, str]:
        raise MemoryError("the child ran out")

    monkeypatch.setattr(validate, "_verdict", crash)  # the forked child inherits it
    assert validate.start(config, True, Root(root), fork=True).result() == load_config(config, required=True)
    assert "exit status 70" in caplog.text and "validating" in caplog.text


@pytest.mark.subprocess
def test_a_forked_child_past_its_timeout_is_killed() -> None:
    import time

    from gpu_agent.host import proc

    child = proc.fork("a slow answer", lambda: (time.sleep(30), (0, ""))[1], timeout=0.2)
    with pytest.raises(AgentError, match="a slow answer did not finish within 0.2 s and was killed"):
        child.wait()
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # reaped, not left a zombie


@pytest.mark.subprocess
def test_a_reload_child_imports_from_where_the_packaged_launcher_put_the_agent(tmp_path: Path) -> None:
    """As /usr/bin/gpu-agent runs: an interpreter outside any venv, the agent and its dependencies put on
    sys.path in-process. The reload's child interpreter must find them too, so that it validates and
    pydantic never enters the daemon."""
    base_python = os.path.realpath(sys.executable)  # a venv's python is a link to its base interpreter
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nlog_level: debug\n")
    (tmp_path / "root").mkdir()
    code = (f"import sys\nsys.path[:0] = [{str(REPO)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
            "from pathlib import Path\n"
            "from gpu_agent.config.validate import load_daemon_config\n"
            "from gpu_agent.host.paths import Root\n"
            f"loaded = load_daemon_config(Path({str(config)!r}), True, Root({str(tmp_path / 'root')!r}))\n"
            "print(loaded.config.log_level, 'pydantic' in sys.modules)\n")
    done = subprocess.run([base_python, "-I", "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["debug", "False"], done.stderr[-2000:]


def test_a_reload_of_the_same_text_loads_nothing(root: Path, tmp_path: Path, no_child: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    running = load_config(config, required=True)
    monkeypatch.setattr(validate, "read_cache", lambda *args: pytest.fail("an unchanged file was loaded again"))
    assert validate.reload_config(config, True, Root(root), running) is None
    assert no_child == []


@pytest.mark.subprocess
def test_a_reload_of_other_text_loads_it(root: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    running = load_config(config, required=True)
    config.write_text(GOOD + "\n")  # one byte more, the same settings: still a file to validate
    again = validate.reload_config(config, True, Root(root), running)
    assert again is not None and again.digest == running.digest and again.text_sha256 != running.text_sha256
    config.write_text(GOOD.replace("30", "31"))
    changed = validate.reload_config(config, True, Root(root), running)
    assert changed is not None and changed.config.reconcile.interval_seconds == 31.0


def test_a_reload_is_judged_by_the_file_and_its_text(root: Path, tmp_path: Path, no_child: list[str]) -> None:
    config = tmp_path / "config.yaml"
    defaults = load_config(config, required=False)
    assert validate.reload_config(config, False, Root(root), defaults) is None  # still absent
    config.write_text(GOOD)
    running = load_config(config, required=True)
    other = tmp_path / "other.yaml"
    other.write_text(GOOD)  # the same text at another path is another file (its messages name it)
    elsewhere = validate.reload_config(other, True, Root(root), running)  # validated (in-process: no child here)
    assert elsewhere is not None and elsewhere.source == str(other) and no_child == [str(other)]
    config.unlink()
    with pytest.raises(ConfigError, match="config.yaml: no such file"):
        validate.reload_config(config, True, Root(root), running)
    config.mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        validate.reload_config(config, True, Root(root), running)
