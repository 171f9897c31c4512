"""Read and validate the config file with pydantic; every error names the file, the key path, the line
and the reason. The daemon (at start and on SIGHUP) and the CLI's commands all load it here."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

from gpu_agent.config.plugin import conflicting_keys, deprecated_keys, ignored_keys
from gpu_agent.config.safe_yaml import line_of, load_yaml
from gpu_agent.config.schema import AgentConfig
from gpu_agent.config.text import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from gpu_agent.config.text import MAX_CONFIG_BYTES, read_config_text, shown
from gpu_agent.errors import ConfigError
from gpu_agent.numbers import decimal

__all__ = ["DEFAULT_CONFIG_PATH", "LoadedConfig", "check_config", "line_of", "load_config", "parse_config",
           "reload_config", "validated"]
log = logging.getLogger(__name__)
T = TypeVar("T")
_ADAPTERS: dict[type, TypeAdapter[Any]] = {}  # building one costs milliseconds: once per section
MAX_REPORTED_ERRORS = 20
# What to write instead, when YAML read a value as a string but the setting needs another type.
_TYPE_HINTS = {
    "float_type": "write a number without quotes, such as 5, 2.5 or 1.0e+3 (YAML needs the dot and the sign)",
    "int_type": "write a whole number without quotes",
    "bool_type": "write true or false without quotes",
}
# A key the section does not have: pydantic's type for a model, then for a dataclass.
_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")
BUILT_IN = "built-in defaults"


@dataclass(frozen=True)
class LoadedConfig:
    config: AgentConfig
    source: str  # the file it came from, or "built-in defaults"
    digest: str
    text_sha256: Optional[str] = None  # of the file's text, when loaded from one


def canonical_json(config: AgentConfig) -> str:
    """Every setting, keys sorted, no spaces: equal configs give equal text (and digest)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True, separators=(",", ":"), default=_plain)


def loaded(config: AgentConfig, source: str, text_sha256: Optional[str] = None) -> LoadedConfig:
    return LoadedConfig(config, source, "sha256:" + hashlib.sha256(canonical_json(config).encode()).hexdigest(),
                        text_sha256)


def text_sha256(text: str) -> str:
    """What identifies a config file's text: a reload of the same text has nothing to load."""
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> str:
    """A YAML value JSON has no type for (a date in toolkit.runtime_config), as pydantic writes it."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def load_config(path: Path, required: bool) -> LoadedConfig:
    """Load `path`; a missing file gives the built-in defaults unless `required`."""
    return _load(path, required, read_config_text(path))


def reload_config(path: Path, required: bool, running: LoadedConfig) -> Optional[LoadedConfig]:
    """A SIGHUP's config: None when the file still holds exactly the text `running` came from (or is still
    absent, for the built-in defaults), as there is nothing to load; else load_config's answer."""
    text = read_config_text(path)
    if text is None and running.source == BUILT_IN:
        return None
    if text is not None and running.source == str(path) and running.text_sha256 == text_sha256(text):
        return None
    return _load(path, required, text)


def _load(path: Path, required: bool, text: Optional[str]) -> LoadedConfig:
    if text is None:
        if required:
            raise ConfigError(f"{path}: no such file")
        return loaded(AgentConfig(), BUILT_IN)
    return loaded(parse_config(text, str(path)), str(path), text_sha256(text))


def parse_config(text: str, name: str) -> AgentConfig:
    """The config `text` (from the file `name`) says; its deprecated keys are logged as warnings."""
    config, warnings = check_config(text, name)
    for warning in warnings:
        log.warning("%s", warning)
    return config


def validated(cls: type[T], data: Any) -> T:
    """`data` validated as the config section `cls` (a dataclass of config/); raises ValidationError."""
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter.validate_python(data)


def check_config(text: str, name: str) -> tuple[AgentConfig, list[str]]:
    """The config `text` says, and a warning for each deprecated key it uses; ConfigError when invalid."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name}: more than {MAX_CONFIG_BYTES} characters is too large for a config file")
    document, data = load_yaml(text, name)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}:{line_of(document, ())}: expected a mapping of settings at the top level, "
                          f"got {_kind(data)}")
    if "version" not in data:
        raise ConfigError(f'{name}: version: missing; add "version: v1" as the first line')
    if data["version"] != "v1":
        raise ConfigError(
            f"{name}:{line_of(document, ('version',))}: version: unsupported value {shown(data['version'])}; "
            "this agent reads version v1"
        )
    try:
        config = validated(AgentConfig, data)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_describe(err, document, name) for err in errors[:MAX_REPORTED_ERRORS]]
        if len(errors) > MAX_REPORTED_ERRORS:
            lines.append(f"{name}: and {len(errors) - MAX_REPORTED_ERRORS} more errors")
        raise ConfigError("\n".join(lines)) from None
    conflicts = [f"{name}:{_line(document, loc)}: {'.'.join(loc)}: {reason}"
                 for loc, reason in conflicting_keys(config)]
    if conflicts:
        raise ConfigError("\n".join(conflicts))
    warnings = [f"{name}:{_line(document, loc)}: {'.'.join(loc)}: {reason}"
                for loc, reason in deprecated_keys(config) + ignored_keys(config)]
    return config, warnings


def _index(part: str) -> str | int:
    """A key path's part as line_of takes it: a list index as a number."""
    index = decimal(part)
    return part if index is None or part != part.strip() else index


def _line(document: yaml.Node | None, loc: tuple[str, ...]) -> int | None:
    """A key path's line, its digits as list indices."""
    return line_of(document, tuple(_index(part) for part in loc))


def _describe(error: Any, document: yaml.Node | None, name: str) -> str:
    loc = tuple(error["loc"])
    key = ".".join(_key_part(part) for part in loc) or "(top level)"
    line = line_of(document, loc)
    where = f"{name}:{line}" if line else name
    if error["type"] in _UNKNOWN_KEY:
        reason = "unknown key"
    elif error["type"] == "dataclass_type":  # a section given as a list or a value: as pydantic says it of a model
        reason = f"Input should be a valid dictionary or instance of {error['ctx']['class_name']}"
    else:
        reason = error["msg"].removeprefix("Value error, ")
        hint = _TYPE_HINTS.get(error["type"])
        if hint and isinstance(error.get("input"), str):
            reason += f" (got the string {shown(error['input'])}; {hint})"
    return f"{where}: {key}: {reason}"


def _key_part(part: str | int) -> str:
    text = str(part)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false"}.get(
        type(value), type(value).__name__)
