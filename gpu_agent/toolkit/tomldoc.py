"""TOML as the runtimes read it: parsing with errors that name file, line and column (never the
content: a runtime config can hold registry credentials), finding a key's line, and merging.

tomlkit (0.7 MiB resident) is imported by the functions that parse or write TOML, here and in the other
toolkit modules: the device-path stage imports them all, and an agent that reads no runtime's config
(the toolkit off, or no runtime installed) does without it."""
from __future__ import annotations

import copy
import hashlib
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from gpu_agent.errors import StageError
from gpu_agent.toolkit.document import MAX_DEPTH, Document, too_deep

if TYPE_CHECKING:
    from tomlkit import exceptions

_REASONS = (  # tomlkit.exceptions by name: tomlkit is imported when a file is parsed
    ("EmptyKeyError", "an empty key"),
    ("EmptyTableNameError", "an empty table name"),
    ("InvalidCharInStringError", "a character a string may not hold"),
    ("InvalidControlChar", "a control character TOML does not allow there"),
    ("InvalidUnicodeValueError", "an invalid unicode escape"),
    ("InvalidNumberError", "an invalid number"),
    ("InvalidDateError", "an invalid date"),
    ("InvalidTimeError", "an invalid time"),
    ("InvalidDateTimeError", "an invalid date-time"),
    ("InvalidNumberOrDateError", "an invalid number or date"),
    ("MixedArrayTypesError", "an array that mixes types"),
    ("UnexpectedCharError", "an unexpected character"),
    ("UnexpectedEofError", "the file ends in the middle of something"),
)
# tomlkit's plain ParseError messages, some of which quote the input: only these words are shown.
_MESSAGES = (("already exists", "a key or table defined twice"), ("Redefinition", "a table defined twice"),
             ("nested more than", f"nested more than {MAX_DEPTH} levels deep"), ("Invalid key", "an invalid key"),
             ("array", "an invalid array"))


# tomlkit takes seconds for a large file (ten for 1 MiB of tables, configfile's limit), and a pass reads
# the same files again: what a large text parsed to, or the error it gave, is kept for the next pass.
CACHED_FROM = 64 << 10  # bytes of text; real runtime configs are a few KiB and parse in milliseconds
_KEEP = 4  # texts; a parsed 1 MiB config holds a few MiB
_parsed: OrderedDict[tuple[str, bytes], Union[dict[str, Any], str]] = OrderedDict()
_parsed_lock = threading.Lock()


def parse(text: str, name: str) -> dict[str, Any]:
    """TOML to plain data (the caller's own copy); a syntax error names the file, line and column, and a
    reason of our own."""
    if len(text) < CACHED_FROM:
        return _parse(text, name)
    key = (name, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    with _parsed_lock:
        found = _parsed.get(key)
        if found is not None:
            _parsed.move_to_end(key)
    if found is None:
        try:
            found = _parse(text, name)
        except StageError as exc:
            found = str(exc)
        with _parsed_lock:
            _parsed[key] = found
            while len(_parsed) > _KEEP:
                _parsed.popitem(last=False)
    if isinstance(found, str):
        raise StageError(found)
    return copy.deepcopy(found)


def _parse(text: str, name: str) -> dict[str, Any]:
    import tomlkit

    try:
        data = tomlkit.parse(without_bom(text)).unwrap()
    except tomlkit.exceptions.ParseError as exc:
        raise StageError(f"{name}:{exc.line}:{exc.col}: not valid TOML: {_reason(exc)}; nothing was changed") from None
    except tomlkit.exceptions.KeyAlreadyPresent:  # raised by tomlkit without a position
        line = _redefined_line(text)
        raise StageError(f"{name}{f':{line}' if line else ''}: not valid TOML: a key or table defined twice; "
                         "nothing was changed") from None
    except RecursionError:
        raise StageError(f"{name}: not valid TOML: nested more than {MAX_DEPTH} levels deep; "
                         "nothing was changed") from None
    except Exception as exc:  # the parser failed on input it did not foresee: the file is at fault
        raise StageError(f"{name}: not valid TOML (the parser gave up: {type(exc).__name__}); "
                         "nothing was changed") from None
    if too_deep(data):
        raise StageError(f"{name}: nested more than {MAX_DEPTH} levels deep; nothing was changed")
    return data


def without_bom(text: str) -> str:
    """The text without a byte order mark before its first line, which containerd's and CRI-O's parsers
    skip and tomlkit refuses (a file the agent rewrites loses it)."""
    return text[1:] if text.startswith("\ufeff") else text


def load(text: str, name: str) -> Document:
    """`parse`, with typed access whose errors name the key and its line."""
    return Document(parse(text, name), name, lambda path: line_of(text, path))


def _reason(exc: exceptions.ParseError) -> str:
    import tomlkit

    for kind, reason in _REASONS:
        if isinstance(exc, getattr(tomlkit.exceptions, kind)):
            return reason
    message = str(exc)
    return next((reason for words, reason in _MESSAGES if words in message), "a syntax error")


_LONGEST_LINE = 4096
_HEADER = re.compile(r"\s*\[\[?(.+?)\]\]?\s*(?:#.*)?")
_ASSIGNMENT = re.compile(r"\s*([^\s=#\[][^=]*?)\s*=")


def line_of(text: str, path: Sequence[str]) -> Optional[int]:
    """The line defining the key at `path` (a table header or an assignment), or the line of the
    assignment whose inline value holds it; None when it cannot be told."""
    wanted = tuple(path)
    enclosing = None
    for number, full, kind in _definitions(text):
        if full == wanted:
            return number
        if kind == "=" and wanted[: len(full)] == full:
            enclosing = number
    return enclosing


def _redefined_line(text: str) -> Optional[int]:
    """The first line that defines a key (or a table) a line before it defined already."""
    seen: set[tuple[str, ...]] = set()
    for number, full, kind in _definitions(text):
        if kind == "[[":
            continue  # an array of tables grows by repeating its header
        if full in seen:
            return number
        seen.add(full)
    return None


def _definitions(text: str) -> Iterator[tuple[int, tuple[str, ...], str]]:
    """(line, full key path, "[" or "[[" or "=") of every table header and assignment, read line by
    line (a multi-line string can fool this: it only points at lines)."""
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.split("\n"), start=1):
        if len(line) > _LONGEST_LINE:
            continue  # no key line is this long; the patterns below would be slow on it
        header = _HEADER.fullmatch(line)
        if header:
            table = _key(header.group(1)) or table
            yield number, table, "[[" if line.lstrip().startswith("[[") else "["
            continue
        assignment = _ASSIGNMENT.match(line)
        key = _key(assignment.group(1)) if assignment else None
        if key is not None:
            yield number, table + key, "="


_SIMPLE_PART = re.compile(r'\s*(?:([A-Za-z0-9_-]+)|"([^"\\]*)"|\'([^\']*)\')\s*')


def _key(text: str) -> Optional[tuple[str, ...]]:
    """A TOML key (dotted, quoted) as its parts; None when it is not one."""
    simple = [_SIMPLE_PART.fullmatch(part) for part in text.split(".")]
    if all(simple):  # the common case, without a parser (no escapes, no dots inside quotes)
        return tuple(next(group for group in match.groups() if group is not None) for match in simple if match)
    import tomlkit

    try:
        data: Any = tomlkit.parse(f"{text} = 0\n").unwrap()
    except Exception:  # not a key, whatever the parser makes of it
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
