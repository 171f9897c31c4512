"""Read and validate the config file; every error names the file, the key path, the line and the reason."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml
from pydantic import ValidationError

from gpu_agent.config.schema import AgentConfig
from gpu_agent.errors import ConfigError

DEFAULT_CONFIG_PATH = "/etc/gpu-agent/config.yaml"


@dataclass(frozen=True)
class LoadedConfig:
    config: AgentConfig
    source: str  # the file it came from, or "built-in defaults"
    digest: str


def load_config(path: Path, required: bool) -> LoadedConfig:
    """Load `path`; a missing file gives the built-in defaults unless `required`."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return _loaded(AgentConfig(), "built-in defaults")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); is this the right file?") from None
    return _loaded(parse_config(text, str(path)), str(path))


def parse_config(text: str, name: str) -> AgentConfig:
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark else name
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping of settings at the top level, got {type(data).__name__}")
    if "version" not in data:
        raise ConfigError(f'{name}: version: missing; add "version: v1" as the first line')
    if data["version"] != "v1":
        raise ConfigError(
            f"{name}:{_line(document, ('version',))}: version: unsupported value {data['version']!r}; "
            "this agent reads version v1"
        )
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(err, document, name) for err in exc.errors())) from None


def _describe(error: Any, document: Optional[yaml.Node], name: str) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(part) for part in loc) or "(top level)"
    line = _line(document, loc)
    where = f"{name}:{line}" if line else name
    if error["type"] == "extra_forbidden":
        reason = "unknown key"
    else:
        reason = error["msg"]
        if reason.startswith("Value error, "):
            reason = reason[len("Value error, ") :]
    return f"{where}: {key}: {reason}"


def _line(node: Optional[yaml.Node], loc: Sequence[Union[str, int]]) -> Optional[int]:
    """The 1-based line of the key at `loc`, or of its nearest parent that exists in the file."""
    if node is None:
        return None
    line = None
    for part in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == str(part):
                line = key_node.start_mark.line + 1
                node = value_node
                break
        else:
            break
    return line


def _loaded(config: AgentConfig, source: str) -> LoadedConfig:
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return LoadedConfig(config, source, "sha256:" + hashlib.sha256(canonical.encode()).hexdigest())
