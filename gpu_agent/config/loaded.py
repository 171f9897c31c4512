"""A config as the agent runs it, and its canonical JSON: what every way of loading one returns (the
validating loader, a validation child, the validated-config cache), and none of them needs pydantic."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.config.build import NotAConfig, build
from gpu_agent.config.schema import AgentConfig

BUILT_IN = "built-in defaults"


@dataclass(frozen=True)
class LoadedConfig:
    config: AgentConfig
    source: str  # the file it came from, or "built-in defaults"
    digest: str
    text_sha256: Optional[str] = None  # of the file's text, when the daemon loaded it from one


def canonical_json(config: AgentConfig) -> str:
    """Every setting, keys sorted, no spaces: equal configs give equal text (and digest)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True, separators=(",", ":"), default=_plain)


def from_canonical(settings: Any) -> AgentConfig:
    """The config that a validation's canonical JSON (parsed) describes. NotAConfig unless it has the
    schema's shape and reads back to exactly that JSON: such JSON came from this agent's validation only."""
    config = build(AgentConfig, settings)
    if canonical_json(config) != json.dumps(settings, sort_keys=True, separators=(",", ":")):
        raise NotAConfig("the settings do not read back the same")
    return config


def loaded(config: AgentConfig, source: str, text_sha256: Optional[str] = None) -> LoadedConfig:
    return LoadedConfig(config, source, "sha256:" + hashlib.sha256(canonical_json(config).encode()).hexdigest(),
                        text_sha256)


def text_sha256(text: str) -> str:
    """What identifies a config file's text: a reload of the same text has nothing to load."""
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> str:
    """A YAML value JSON has no type for (a date in toolkit.runtime_config), as pydantic writes it."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
