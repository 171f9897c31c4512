"""YAML parsing with bounds: the cost of loading a file is proportional to its size, whatever it holds.

Before anything is built, one streaming pass over the parser's events refuses what makes PyYAML (or
what runs on its result) slow or unbounded: nesting deeper than MAX_DEPTH (PyYAML's composer recurses,
and deep flow nesting is quadratic to scan), aliases that expand to more than MAX_ALIAS_NODES nodes
(a 500-byte "billion laughs" file), aliases inside their own anchor (cycles) and numbers too long to
convert cheaply. Building then refuses duplicate keys. Every refusal is a ConfigError naming the line.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from gpu_agent.config.text import shown
from gpu_agent.errors import ConfigError

MAX_DEPTH = 32
MAX_ALIAS_NODES = 10_000
MAX_NUMBER_LENGTH = 64

# The characters YAML 1.1 allows in a stream (its "printable" set); the parsers refuse the others,
# but without a line number.
_NOT_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_NUMERIC_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML was built with it


class _Refused(Exception):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line, self.reason = line, reason


class _StrictLoader(_Loader):
    """Refuses duplicate keys, and turns a value Python cannot convert into a YAML error at its line."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _Refused(line, f"duplicate key {shown(key)}, first given on line {seen[key]}; "
                                         "keep only one of them")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # int("9" * 5000), a 13th month in a timestamp
            raise ConstructorError(None, None, f"cannot read this value: {exc}", node.start_mark) from None


def load_yaml(text: str, name: str) -> tuple[yaml.Node | None, Any]:
    """The single document in `text`, as its node tree (for line numbers) and as Python data."""
    try:
        _check_characters(text)
        _check_events(text)
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except _Refused as refused:
        raise ConfigError(f"{name}:{refused.line}: {refused.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(exc, text, name)) from None
    except (RecursionError, MemoryError, UnicodeError) as exc:  # bounded above; kept as a last line
        raise ConfigError(f"{name}: cannot be read as YAML: {type(exc).__name__}") from None
    return node, data


def _yaml_error(exc: yaml.YAMLError, text: str, name: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"{name}:{mark.line + 1}" if mark else name
    problem = getattr(exc, "problem", None) or type(exc).__name__
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if mark is not None and _char_at(text, mark.line, mark.column) == "\t":
        problem = "a tab character; YAML indents with spaces only"
    elif context and not context.startswith("while") and context_mark is not None:
        problem = f"{context} (line {context_mark.line + 1}), {problem}"
    return f"{where}: not valid YAML: {problem}"


def _char_at(text: str, line: int, column: int) -> str:
    start = 0
    for _ in range(line):
        start = text.find("\n", start) + 1
        if start == 0:
            return ""
    return text[start + column : start + column + 1]


def _check_characters(text: str) -> None:
    bad = _NOT_PRINTABLE.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise _Refused(line, f"contains the control character U+{ord(bad.group()):04X}, which YAML does not "
                             "allow; is this the right file?")
    bom = text.find("\ufeff", 1)
    if bom != -1:  # allowed only as the first character; elsewhere the parsers disagree on what it is
        raise _Refused(text.count("\n", 0, bom) + 1, "a byte order mark (U+FEFF) in the middle of the file; "
                                                      "remove it (files joined together?)")


def _check_events(text: str) -> None:
    """One streaming pass that stops at the first event past a bound, before the rest is even scanned."""
    resolver = yaml.resolver.Resolver()
    sizes: dict[str, int | None] = {}  # anchor -> nodes it expands to; None while still open
    open_nodes: list[list[Any]] = [[None, 0]]  # [anchor, nodes so far] of each open collection
    aliased = 0
    for event in _events(text):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_nodes) > MAX_DEPTH:
                raise _Refused(line, f"nested more than {MAX_DEPTH} levels deep; no setting needs that")
            if event.anchor is not None:
                sizes[event.anchor] = None
            open_nodes.append([event.anchor, 1])
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, count = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = count
        elif isinstance(event, yaml.ScalarEvent):
            count = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
            if (event.implicit[0] and len(event.value) > MAX_NUMBER_LENGTH
                    and resolver.resolve(yaml.ScalarNode, event.value, event.implicit) in _NUMERIC_TAGS):
                raise _Refused(line, f"a number {len(event.value)} characters long is out of range")
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                continue  # the composer reports the undefined alias
            expanded = sizes[event.anchor]
            if expanded is None:
                raise _Refused(line, f"alias *{event.anchor} is inside its own anchor &{event.anchor} (a cycle)")
            aliased += expanded
            if aliased > MAX_ALIAS_NODES:
                raise _Refused(line, f"aliases expand to more than {MAX_ALIAS_NODES} values (at *{event.anchor}); "
                                     "no config needs that many: write the values out instead")
            count = expanded
        else:
            continue
        open_nodes[-1][1] += count


def _events(text: str) -> Iterator[yaml.Event]:
    loader = _Loader(text)
    try:
        while loader.check_event():
            yield loader.get_event()
    finally:
        loader.dispose()


def line_of(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the key or list item at `loc`, or of its nearest parent in the file."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            continue
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(part):
                line = key_node.start_mark.line + 1
                node = value_node
                break
        else:
            break
    return line
