"""/etc/nvidia-container-runtime/config.toml: only the keys the agent's config asks for, the rest kept."""
from __future__ import annotations

from typing import Any, Optional

import tomlkit
from tomlkit.exceptions import ConvertError

from gpu_agent.errors import StageError
from gpu_agent.toolkit.document import TABLE
from gpu_agent.toolkit.tomldoc import load

PATH = "/etc/nvidia-container-runtime/config.toml"


def desired(current: Optional[str], settings: dict[str, Any], name: str = PATH) -> Optional[str]:
    """`settings` maps dotted keys (nvidia-container-runtime.mode) to values; None when there is nothing to set."""
    if not settings:
        return None
    if current is not None:
        checked = load(current, name)  # a clear error for a broken file
        for dotted in settings:
            parents = dotted.split(".")[:-1]
            for depth in range(1, len(parents) + 1):
                checked.get(parents[:depth], TABLE)
    document = tomlkit.parse(current or "")
    for dotted, value in sorted(settings.items()):
        table: Any = document
        *parents, key = dotted.split(".")
        for parent in parents:
            if parent not in table:
                table[parent] = tomlkit.table()
            table = table[parent]
        if table.get(key) != value:
            try:
                table[key] = value
            except (ConvertError, TypeError, ValueError):
                raise StageError(f"toolkit.runtime_config: {dotted}: a value TOML cannot hold "
                                 f"({type(value).__name__}); {name} was not changed") from None
    return tomlkit.dumps(document)
