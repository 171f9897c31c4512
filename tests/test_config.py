"""gpu_agent.config: loading, defaults, and error messages that name the file, line and key."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpu_agent.config import AgentConfig, load_config
from gpu_agent.config.loader import parse_config
from gpu_agent.errors import AgentError, ConfigError


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(text: str, name: str = "c.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, name)
    return str(info.value)


def test_missing_default_file_gives_builtin_defaults(tmp_path: Path) -> None:
    loaded = load_config(tmp_path / "absent.yaml", required=False)
    assert loaded.source == "built-in defaults"
    assert loaded.config == AgentConfig()
    assert loaded.config.reconcile.interval_seconds == 60
    assert loaded.config.http.listen == "127.0.0.1:9445"
    assert loaded.config.http.socket == "/run/gpu-agent/agent.sock"
    assert loaded.digest.startswith("sha256:")


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match="no such file") as info:
        load_config(path, required=True)
    assert str(path) in str(info.value)
    assert isinstance(info.value, AgentError)


def test_file_values_are_loaded(tmp_path: Path) -> None:
    path = write(tmp_path, "version: v1\nlog_level: debug\nreconcile:\n  interval_seconds: 15\n"
                           "http:\n  listen: '[::1]:9000'\n  socket: ''\n")
    loaded = load_config(path, required=True)
    assert loaded.source == str(path)
    assert loaded.config.log_level == "debug"
    assert loaded.config.reconcile.interval_seconds == 15
    assert loaded.config.http.host == "::1"
    assert loaded.config.http.port == 9000
    assert loaded.config.http.socket == ""


def test_empty_file_needs_a_version(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="version: missing"):
        load_config(write(tmp_path, ""), required=True)


def test_unknown_key_names_file_line_and_dotted_path() -> None:
    text = "version: v1\nhttp:\n  lissten: 127.0.0.1:1\n"
    assert error_of(text) == "c.yaml:3: http.lissten: unknown key"


def test_unknown_top_level_key() -> None:
    assert error_of("version: v1\nlog_level: info\nreconcil: {}\n") == "c.yaml:3: reconcil: unknown key"


def test_negative_interval_is_rejected() -> None:
    message = error_of("version: v1\nreconcile:\n  interval_seconds: -5\n")
    assert message.startswith("c.yaml:3: reconcile.interval_seconds: ")
    assert "greater than 0" in message


@pytest.mark.parametrize("listen", ["nope", ":9445", "host:", "host:99999", "host:port"])
def test_bad_http_listen_is_rejected(listen: str) -> None:
    message = error_of(f"version: v1\nhttp:\n  listen: '{listen}'\n")
    assert message.startswith("c.yaml:3: http.listen: expected HOST:PORT")
    assert repr(listen) in message


def test_relative_http_socket_is_rejected() -> None:
    message = error_of("version: v1\nhttp:\n  socket: run/agent.sock\n")
    assert message == "c.yaml:3: http.socket: must be an absolute path, got 'run/agent.sock'"


def test_every_bad_value_is_reported() -> None:
    message = error_of("version: v1\nhttp:\n  socket: x\n  listen: y\n")
    lines = message.splitlines()
    assert len(lines) == 2
    assert any(line.startswith("c.yaml:3: http.socket:") for line in lines)
    assert any(line.startswith("c.yaml:4: http.listen:") for line in lines)


def test_missing_version_is_rejected() -> None:
    message = error_of("log_level: info\n")
    assert message.startswith("c.yaml: version: missing")
    assert '"version: v1"' in message


@pytest.mark.parametrize("value", ["v2", "1"])
def test_unsupported_version_is_rejected(value: str) -> None:
    message = error_of(f"log_level: info\nversion: {value}\n")
    assert message.startswith("c.yaml:2: version: unsupported value")
    assert "v1" in message


def test_invalid_yaml_reports_a_line() -> None:
    message = error_of("version: v1\nhttp:\n\tlisten: x\nlog_level: info\n")
    assert message.startswith("c.yaml:3: not valid YAML: ")


def test_invalid_yaml_on_first_line() -> None:
    assert error_of("version: v1: v2\n").startswith("c.yaml:1: not valid YAML")


def test_top_level_must_be_a_mapping() -> None:
    assert "expected a mapping" in error_of("- version\n")


def test_digest_is_stable_for_equal_configs(tmp_path: Path) -> None:
    a = load_config(write(tmp_path, "version: v1\nreconcile: {interval_seconds: 30}\n", "a.yaml"), True)
    b = load_config(write(tmp_path, "# same\nreconcile:\n  interval_seconds: 30.0\nversion: v1\n", "b.yaml"), True)
    assert a.digest == b.digest
    assert load_config(tmp_path / "a.yaml", True).digest == a.digest


def test_explicit_defaults_match_builtin_digest(tmp_path: Path) -> None:
    explicit = load_config(write(tmp_path, "version: v1\nlog_level: info\n"), True)
    builtin = load_config(tmp_path / "absent.yaml", False)
    assert explicit.digest == builtin.digest


def test_digest_differs_for_different_configs(tmp_path: Path) -> None:
    a = load_config(write(tmp_path, "version: v1\nreconcile: {interval_seconds: 30}\n", "a.yaml"), True)
    b = load_config(write(tmp_path, "version: v1\nreconcile: {interval_seconds: 31}\n", "b.yaml"), True)
    c = load_config(write(tmp_path, "version: v1\nhealth: {ignored_xids: [13]}\n", "c.yaml"), True)
    assert len({a.digest, b.digest, c.digest}) == 3


def test_explicit_default_durations_match_builtin_digest(tmp_path: Path) -> None:
    explicit = load_config(write(tmp_path, "version: v1\nreconcile:\n  interval_seconds: 60\n"
                                           "nvml:\n  call_timeout_seconds: 5\n"), True)
    assert explicit.digest == load_config(tmp_path / "absent.yaml", False).digest


def test_an_unreadable_file_is_a_config_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.host import bounded

    path = write(tmp_path, "version: v1\n")

    def denied(*args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(bounded.os, "open", denied)
    with pytest.raises(ConfigError) as info:
        load_config(path, required=True)
    assert str(info.value) == f"{path}: cannot read: Permission denied"


def test_a_symlinked_config_is_read_through_the_link(tmp_path: Path) -> None:
    target = write(tmp_path, "version: v1\nlog_level: debug\n", "real.yaml")
    link = tmp_path / "config.yaml"
    link.symlink_to(target)
    assert load_config(link, required=True).config.log_level == "debug"


def test_a_number_given_as_a_string_says_how_to_write_it() -> None:
    message = error_of("version: v1\nnvml:\n  call_timeout_seconds: '5'\n")
    assert message.startswith("c.yaml:3: nvml.call_timeout_seconds: Input should be a valid number")
    assert "(got the string '5'; write a number without quotes" in message


RELOADED = "version: v1\nreconcile:\n  interval_seconds: 30\n"


def test_a_reload_of_the_same_text_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.config import loader

    config = write(tmp_path, RELOADED)
    running = load_config(config, required=True)
    monkeypatch.setattr(loader, "check_config", lambda *args: pytest.fail("an unchanged file was loaded again"))
    assert loader.reload_config(config, True, running) is None
    defaults = load_config(tmp_path / "absent.yaml", required=False)
    assert loader.reload_config(tmp_path / "absent.yaml", False, defaults) is None  # still absent


def test_a_reload_of_other_text_or_another_file_loads_it(tmp_path: Path) -> None:
    from gpu_agent.config.loader import reload_config

    config = write(tmp_path, RELOADED)
    running = load_config(config, required=True)
    config.write_text(RELOADED + "\n")  # one byte more, the same settings: still a file to load
    again = reload_config(config, True, running)
    assert again is not None and again.digest == running.digest and again.text_sha256 != running.text_sha256
    config.write_text(RELOADED.replace("30", "31"))
    changed = reload_config(config, True, running)
    assert changed is not None and changed.config.reconcile.interval_seconds == 31.0
    other = write(tmp_path, RELOADED, "other.yaml")  # the same text at another path: its messages name it
    elsewhere = reload_config(other, True, running)
    assert elsewhere is not None and elsewhere.source == str(other)


def test_a_reload_of_a_missing_or_broken_file_is_an_error_naming_it(tmp_path: Path) -> None:
    from gpu_agent.config.loader import reload_config

    config = write(tmp_path, RELOADED)
    running = load_config(config, required=True)
    config.write_text(RELOADED + "reconcile: {}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:4: duplicate key 'reconcile'"):
        reload_config(config, True, running)
    config.unlink()
    with pytest.raises(ConfigError, match="c.yaml: no such file"):
        reload_config(config, True, running)
    config.mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        reload_config(config, True, running)
