"""TOML as the runtimes read it: parsing with errors that name file, line and column, and merging."""
from __future__ import annotations

import copy
import re
from typing import Any

import tomlkit
from tomlkit.exceptions import ParseError

from gpu_agent.errors import StageError


def parse(text: str, name: str) -> dict[str, Any]:
    """TOML to plain data; a syntax error names the file, line and column."""
    try:
        return tomlkit.parse(text).unwrap()
    except ParseError as exc:
        reason = re.sub(r" at line \d+ col \d+$", "", str(exc))
        raise StageError(f"{name}:{exc.line}:{exc.col}: not valid TOML: {reason}; nothing was changed") from None


def deep_merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Merge `update` into `into` key by key, tables recursively (how CRI-O and containerd 2.x
    combine their drop-ins)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
