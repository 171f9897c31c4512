"""Typed access to a parsed runtime config: a value of the wrong type is a StageError naming the
file, the key and (where known) its line, and saying what was expected and what was found; it
never quotes the value, which may be a credential."""
from __future__ import annotations

import datetime
import json
import re
from typing import Any, Callable, Optional, Sequence

from gpu_agent.errors import StageError

MAX_DEPTH = 100  # tables and arrays within each other; real configs nest fewer than 10

TABLE = "table"
STRING = "string"
STRINGS = "strings"
BOOLEAN = "boolean"
INTEGER = "integer"
ANY = "any"
Schema = Sequence[tuple[Sequence[str], str]]  # key paths ("*": every key of a table) and their kinds


class Document:
    def __init__(self, data: Any, name: str, line_of: Callable[[Sequence[str]], Optional[int]] = lambda path: None,
                 json_terms: bool = False) -> None:
        self.data = data
        self.name = name
        self.line_of = line_of
        self.json_terms = json_terms  # JSON calls a table an object
        if not isinstance(data, dict):
            raise self.error((), f"expected {self._expected(TABLE)} at the top level, found {self.type_of(data)}")

    # --- typed access ----------------------------------------------------------------------------

    def get(self, path: Sequence[str], kind: str) -> Any:
        """The value at `path` (None when it or a table on the way is absent) if it is of `kind`."""
        value: Any = self.data
        for depth, key in enumerate(path):
            if not isinstance(value, dict):
                self._fail(path[:depth], TABLE, value)
            if key not in value:
                return None
            value = value[key]
        if not _is(value, kind):
            self._fail(path, kind, value)
        return value

    def table(self, *path: str) -> dict[str, Any]:
        return self.get(path, TABLE) or {}

    def string(self, *path: str) -> Optional[str]:
        return self.get(path, STRING)

    def strings(self, *path: str) -> list[str]:
        return self.get(path, STRINGS) or []

    def check(self, schema: Schema, prefix: Sequence[str] = ()) -> None:
        """Every key the schema names that is present has its kind; list parents before children."""
        for path, kind in schema:
            for concrete in self._expand(tuple(prefix) + tuple(path)):
                self.get(concrete, kind)

    def _expand(self, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        paths: list[tuple[str, ...]] = [()]
        for key in path:
            grown = []
            for parent in paths:
                value = self._lookup(parent)
                if not isinstance(value, dict):
                    continue
                keys = list(value) if key == "*" else [key] if key in value else []
                grown += [parent + (k,) for k in keys]
            paths = grown
        return paths

    def _lookup(self, path: Sequence[str]) -> Any:
        value = self.data
        for key in path:
            value = value[key]
        return value

    # --- errors ----------------------------------------------------------------------------------

    def _fail(self, path: Sequence[str], kind: str, value: Any) -> None:
        found = self.type_of(value)
        if kind == STRINGS and isinstance(value, list):
            found = "an array holding something else"
        raise self.error(path, f"expected {self._expected(kind)}, found {found}")

    def error(self, path: Sequence[str], reason: str) -> StageError:
        line = self.line_of(path) if path else None
        where = f"{self.name}:{line}" if line else self.name
        key = f" {dotted(path)}:" if path else ""
        return StageError(f"{where}:{key} {reason}; nothing was changed")

    def _expected(self, kind: str) -> str:
        return {TABLE: "an object" if self.json_terms else "a table", STRING: "a string",
                STRINGS: "an array of strings", BOOLEAN: "true or false", INTEGER: "an integer"}[kind]

    def type_of(self, value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return "a number"
        if isinstance(value, str):
            return "a string"
        if isinstance(value, dict):
            return "an object" if self.json_terms else "a table"
        if isinstance(value, list):
            return "an array"
        if isinstance(value, (datetime.date, datetime.time)):
            return "a date or time"
        if value is None:
            return "null"
        return type(value).__name__


def _is(value: Any, kind: str) -> bool:
    if kind == TABLE:
        return isinstance(value, dict)
    if kind == STRING:
        return isinstance(value, str)
    if kind == STRINGS:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if kind == BOOLEAN:
        return isinstance(value, bool)
    if kind == INTEGER:
        return isinstance(value, int) and not isinstance(value, bool)
    return True


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def dotted(path: Sequence[str]) -> str:
    """A key path as TOML writes it: plugins."io.containerd.grpc.v1.cri".containerd."""
    return ".".join(key if _BARE.fullmatch(key) else json.dumps(key) for key in path)


def too_deep(data: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether tables and arrays nest more than `limit` levels (checked without recursion)."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack += [(item, depth + 1) for item in value.values()]
        elif isinstance(value, list):
            stack += [(item, depth + 1) for item in value]
    return False
