"""/etc/nvidia-container-runtime/config.toml: only the keys the agent's config asks for, the rest kept."""
from __future__ import annotations

from typing import Any, Optional

import tomlkit

from gpu_agent.errors import StageError
from gpu_agent.toolkit.tomldoc import parse

PATH = "/etc/nvidia-container-runtime/config.toml"


def desired(current: Optional[str], settings: dict[str, Any]) -> Optional[str]:
    """`settings` maps dotted keys (nvidia-container-runtime.mode) to values; None when there is nothing to set."""
    if not settings:
        return None
    if current is not None:
        parse(current, PATH)  # a clear error for a broken file
    document = tomlkit.parse(current or "")
    for dotted, value in sorted(settings.items()):
        table: Any = document
        *parents, key = dotted.split(".")
        for name in parents:
            if name not in table:
                table[name] = tomlkit.table()
            table = table[name]
            if not hasattr(table, "get"):
                raise StageError(f"{PATH}: {dotted}: {name} is a value, not a table")
        if table.get(key) != value:
            table[key] = value
    return tomlkit.dumps(document)
