"""TOML as the runtimes read it: parsing with errors that name file, line and column (never the
content: a runtime config can hold registry credentials), finding a key's line, and merging."""
from __future__ import annotations

import copy
import re
from typing import Any, Optional, Sequence

import tomlkit
from tomlkit import exceptions

from gpu_agent.errors import StageError
from gpu_agent.toolkit.document import MAX_DEPTH, Document, too_deep

_REASONS: tuple[tuple[type, str], ...] = (
    (exceptions.EmptyKeyError, "an empty key"),
    (exceptions.EmptyTableNameError, "an empty table name"),
    (exceptions.InvalidCharInStringError, "a character a string may not hold"),
    (exceptions.InvalidControlChar, "a control character TOML does not allow there"),
    (exceptions.InvalidUnicodeValueError, "an invalid unicode escape"),
    (exceptions.InvalidNumberError, "an invalid number"),
    (exceptions.InvalidDateError, "an invalid date"),
    (exceptions.InvalidTimeError, "an invalid time"),
    (exceptions.InvalidDateTimeError, "an invalid date-time"),
    (exceptions.InvalidNumberOrDateError, "an invalid number or date"),
    (exceptions.MixedArrayTypesError, "an array that mixes types"),
    (exceptions.UnexpectedCharError, "an unexpected character"),
    (exceptions.UnexpectedEofError, "the file ends in the middle of something"),
)
# tomlkit's plain ParseError messages, some of which quote the input: only these words are shown.
_MESSAGES = (("already exists", "a key or table defined twice"), ("Redefinition", "a table defined twice"),
             ("nested more than", f"nested more than {MAX_DEPTH} levels deep"), ("Invalid key", "an invalid key"),
             ("array", "an invalid array"))


def parse(text: str, name: str) -> dict[str, Any]:
    """TOML to plain data; a syntax error names the file, line and column, and a reason of our own."""
    try:
        data = tomlkit.parse(text).unwrap()
    except exceptions.ParseError as exc:
        raise StageError(f"{name}:{exc.line}:{exc.col}: not valid TOML: {_reason(exc)}; nothing was changed") from None
    except RecursionError:
        raise StageError(f"{name}: not valid TOML: nested more than {MAX_DEPTH} levels deep; "
                         "nothing was changed") from None
    except Exception as exc:  # the parser failed on input it did not foresee: still the file's fault
        raise StageError(f"{name}: not valid TOML (the parser gave up: {type(exc).__name__}); "
                         "nothing was changed") from None
    if too_deep(data):
        raise StageError(f"{name}: nested more than {MAX_DEPTH} levels deep; nothing was changed")
    return data


def load(text: str, name: str) -> Document:
    """`parse`, with typed access whose errors name the key and its line."""
    return Document(parse(text, name), name, lambda path: line_of(text, path))


def _reason(exc: exceptions.ParseError) -> str:
    for kind, reason in _REASONS:
        if isinstance(exc, kind):
            return reason
    message = str(exc)
    return next((reason for words, reason in _MESSAGES if words in message), "a syntax error")


_HEADER = re.compile(r"\s*\[\[?(.+?)\]\]?\s*(?:#.*)?")
_ASSIGNMENT = re.compile(r"\s*([^\s=#\[][^=]*?)\s*=")


def line_of(text: str, path: Sequence[str]) -> Optional[int]:
    """The line defining the key at `path` (a table header or an assignment), or the line of the
    assignment whose inline value holds it; None when it cannot be told."""
    wanted = tuple(path)
    table: tuple[str, ...] = ()
    enclosing = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.fullmatch(line)
        if header:
            table = _key(header.group(1)) or table
            if table == wanted:
                return number
            continue
        assignment = _ASSIGNMENT.match(line)
        key = _key(assignment.group(1)) if assignment else None
        if key is None:
            continue
        full = table + key
        if full == wanted:
            return number
        if wanted[: len(full)] == full:
            enclosing = number
    return enclosing


def _key(text: str) -> Optional[tuple[str, ...]]:
    """A TOML key (dotted, quoted) as its parts; None when it is not one."""
    try:
        data: Any = tomlkit.parse(f"{text} = 0\n").unwrap()
    except Exception:
        return None
    parts = []
    while isinstance(data, dict) and len(data) == 1:
        key, data = next(iter(data.items()))
        parts.append(key)
    return tuple(parts) if data == 0 else None


def deep_merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Merge `update` into `into` key by key, tables recursively (how CRI-O and containerd 2.x
    combine their drop-ins)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
