"""The shipped /etc/gpu-agent/config.yaml: every setting at its default, commented out, with its meaning."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

from gpu_agent.config.schema import AgentConfig

HEADER = """\
# gpu-agent configuration. Every setting below is shown at its built-in default, commented out:
# uncomment and change what you need, then `systemctl reload gpu-agent`. An invalid file is
# rejected with the line and key at fault, and the agent keeps running its previous settings.
version: v1
"""


def render_defaults() -> str:
    lines = [HEADER.rstrip("\n")]
    defaults = AgentConfig()
    for field in dataclasses.fields(AgentConfig):
        if field.name != "version":
            lines.append("")
            lines += _setting(field.name, getattr(defaults, field.name), field.metadata.get("description"), depth=0)
    return "\n".join(lines) + "\n"


def _setting(key: str, value: Any, description: str | None, depth: int) -> list[str]:
    """`#` then the YAML line at its depth; descriptions as comments inside the commented block."""
    indent = "#" + "  " * depth
    lines = [f"{indent}# {line}" for line in textwrap.wrap(description or "", 92)]
    if dataclasses.is_dataclass(value):
        lines.append(f"{indent}{key}:")
        for field in dataclasses.fields(value):
            lines += _setting(field.metadata.get("alias", field.name), getattr(value, field.name),
                              field.metadata.get("description"), depth + 1)
    else:
        lines.append(f"{indent}{key}: {_yaml(value)}")
    return lines


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value) if isinstance(value, (str, list)) else str(value)
