"""Read and validate the config file; every error names the file, the key path, the line and the reason."""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpu_agent.config.plugin import conflicting_keys, deprecated_keys
from gpu_agent.config.safe_yaml import load_yaml
from gpu_agent.config.schema import AgentConfig
from gpu_agent.config.text import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from gpu_agent.config.text import MAX_CONFIG_BYTES, read_config_text, shown
from gpu_agent.errors import ConfigError

log = logging.getLogger(__name__)
MAX_REPORTED_ERRORS = 20
# What to write instead, when YAML read a value as a string but the setting needs another type.
_TYPE_HINTS = {
    "float_type": "write a number without quotes, such as 5, 2.5 or 1.0e+3 (YAML needs the dot and the sign)",
    "int_type": "write a whole number without quotes",
    "bool_type": "write true or false without quotes",
}


@dataclass(frozen=True)
class LoadedConfig:
    config: AgentConfig
    source: str  # the file it came from, or "built-in defaults"
    digest: str


def load_config(path: Path, required: bool) -> LoadedConfig:
    """Load `path`; a missing file gives the built-in defaults unless `required`."""
    text = read_config_text(path)
    if text is None:
        if required:
            raise ConfigError(f"{path}: no such file")
        return _loaded(AgentConfig(), "built-in defaults")
    return _loaded(parse_config(text, str(path)), str(path))


def parse_config(text: str, name: str) -> AgentConfig:
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
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_describe(err, document, name) for err in errors[:MAX_REPORTED_ERRORS]]
        if len(errors) > MAX_REPORTED_ERRORS:
            lines.append(f"{name}: and {len(errors) - MAX_REPORTED_ERRORS} more errors")
        raise ConfigError("\n".join(lines)) from None
    conflicts = [f"{name}:{line_of(document, loc)}: {'.'.join(loc)}: {reason}"
                 for loc, reason in conflicting_keys(config)]
    if conflicts:
        raise ConfigError("\n".join(conflicts))
    for loc, reason in deprecated_keys(config):
        log.warning("%s:%s: %s: %s", name, line_of(document, loc), ".".join(loc), reason)
    return config


def _describe(error: Any, document: yaml.Node | None, name: str) -> str:
    loc = tuple(error["loc"])
    key = ".".join(_key_part(part) for part in loc) or "(top level)"
    line = line_of(document, loc)
    where = f"{name}:{line}" if line else name
    if error["type"] == "extra_forbidden":
        reason = "unknown key"
    else:
        reason = error["msg"].removeprefix("Value error, ")
        hint = _TYPE_HINTS.get(error["type"])
        if hint and isinstance(error.get("input"), str):
            reason += f" (got the string {shown(error['input'])}; {hint})"
    return f"{where}: {key}: {reason}"


def _key_part(part: str | int) -> str:
    text = str(part)
    return text if len(text) <= 60 else text[:57] + "..."


def line_of(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the key or list item at `loc`, or of its nearest parent in the file."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            continue
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(part):
                line = key_node.start_mark.line + 1
                node = value_node
                break
        else:
            break
    return line


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false"}.get(
        type(value), type(value).__name__)


def _loaded(config: AgentConfig, source: str) -> LoadedConfig:
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return LoadedConfig(config, source, "sha256:" + hashlib.sha256(canonical.encode()).hexdigest())
