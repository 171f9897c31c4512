"""The agent's configuration: a `version: v1` YAML file, its schema frozen dataclasses (config/schema.py)
validated with pydantic by config/loader.py, in the process that runs with it.

The names below load on first use, so that what needs only the endpoint's address (config/endpoint.py:
`gpu-agent status`, `labels`) does not pay for pydantic."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpu_agent.config.text import DEFAULT_CONFIG_PATH

if TYPE_CHECKING:
    from gpu_agent.config.loader import LoadedConfig, load_config
    from gpu_agent.config.schema import AgentConfig

__all__ = ["AgentConfig", "DEFAULT_CONFIG_PATH", "LoadedConfig", "load_config"]

_LAZY = {"AgentConfig": "gpu_agent.config.schema", "LoadedConfig": "gpu_agent.config.loader",
         "load_config": "gpu_agent.config.loader"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
