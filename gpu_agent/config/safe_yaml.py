"""YAML parsing with bounds: the cost of loading a file is proportional to its size, whatever it holds.

First one streaming pass over the parser's events, stopped at the first event past a bound: nesting
deeper than MAX_DEPTH (composing recurses), an alias inside its own anchor (a cycle), and aliases that
make the document expand to more than MAX_EXPANDED_BYTES (each alias counts the bytes of what it stands
for: a "billion laughs" file, or a long string aliased many times). Then the document is composed, and
its nodes walked before anything is built: duplicate keys, numbers too long to convert cheaply and
values Python cannot read (a 13th month) are refused. Every refusal is a ConfigError naming the line.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

import yaml

from gpu_agent.config.text import MAX_CONFIG_BYTES, shown
from gpu_agent.errors import ConfigError

MAX_DEPTH = 32
MAX_EXPANDED_BYTES = 4 * MAX_CONFIG_BYTES
MAX_NUMBER_LENGTH = 64

# The characters YAML 1.1 allows in a stream (its "printable" set); the parsers refuse the others,
# but without a line number.
_NOT_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_NUMERIC_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_MERGE_TAG = "tag:yaml.org,2002:merge"

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML was built with it


class _Refused(Exception):
    def __init__(self, at: Any, reason: str) -> None:  # at: a line number, or a mark (0-based)
        super().__init__(reason)
        self.line, self.reason = at if isinstance(at, int) else at.line + 1, reason


def load_yaml(text: str, name: str) -> tuple[Optional[yaml.Node], Any]:
    """The single document in `text`, as its node tree (for line numbers) and as Python data."""
    try:
        _check_characters(text)
        _check_events(text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, None
            _check_nodes(loader, node, set())
            return node, loader.construct_document(node)
        finally:
            loader.dispose()
    except _Refused as refused:
        raise ConfigError(f"{name}:{refused.line}: {refused.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(exc, text, name)) from None
    except (RecursionError, MemoryError) as exc:  # bounded above; kept as a last line
        raise ConfigError(f"{name}: cannot be read as YAML: {type(exc).__name__}") from None


def _check_characters(text: str) -> None:
    bad = _NOT_PRINTABLE.search(text)
    if bad is not None:
        raise _Refused(text.count("\n", 0, bad.start()) + 1, f"contains the control character "
                       f"U+{ord(bad.group()):04X}, which YAML does not allow; is this the right file?")
    bom = text.find("\ufeff", 1)
    if bom != -1:  # allowed only as the first character; elsewhere the parsers disagree on what it is
        raise _Refused(text.count("\n", 0, bom) + 1, "a byte order mark (U+FEFF) in the middle of the file; "
                                                      "remove it (files joined together?)")


def _check_events(text: str) -> None:
    """Nesting, cycles and the bytes the document expands to, before the rest is even scanned."""
    sizes: dict[str, Optional[int]] = {}  # anchor -> bytes it expands to; None while it is still open
    opened: list[tuple[Optional[str], int]] = []  # each open collection: its anchor, `expanded` when it opened
    expanded = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(opened) >= MAX_DEPTH:
                raise _Refused(event.start_mark, f"nested more than {MAX_DEPTH} levels deep; no setting needs that")
            if event.anchor is not None:
                sizes[event.anchor] = None
            opened.append((event.anchor, expanded))
            expanded += 2
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = opened.pop()
            if anchor is not None:
                sizes[anchor] = expanded - start
        elif isinstance(event, yaml.ScalarEvent):
            expanded += len(event.value) + 2
            if event.anchor is not None:
                sizes[event.anchor] = len(event.value) + 2
        elif isinstance(event, yaml.AliasEvent) and event.anchor in sizes:  # else the composer names it
            size = sizes[event.anchor]
            if size is None:
                raise _Refused(event.start_mark, f"alias *{event.anchor} is inside its own anchor "
                                                 f"&{event.anchor} (a cycle)")
            expanded += size
            if expanded > MAX_EXPANDED_BYTES:
                raise _Refused(event.start_mark, f"alias *{event.anchor} makes the file expand to more than "
                                                 f"{MAX_EXPANDED_BYTES} bytes; write the values out instead")


def _check_nodes(loader: Any, node: yaml.Node, seen: set[int]) -> None:
    """Every value readable, and no key twice in a mapping; what an alias shares is walked once."""
    if id(node) in seen or node.tag == _MERGE_TAG:  # `<<` is read with its mapping
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        if node.tag in _NUMERIC_TAGS and len(node.value) > MAX_NUMBER_LENGTH:
            raise _Refused(node.start_mark, f"a number {len(node.value)} characters long is out of range")
        try:
            loader.construct_object(node)  # kept by the loader for construct_document
        except yaml.YAMLError:
            raise
        except Exception:  # a 13th month, `!!bool maybe`, `!!int ''`: PyYAML's converters raise anything
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise _Refused(node.start_mark, f"not valid YAML: cannot read this value as {tag}: "
                                            f"{shown(node.value)}") from None
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_nodes(loader, item, seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            _check_nodes(loader, key_node, seen)
            _check_nodes(loader, value_node, seen)
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                key = loader.construct_object(key_node)
                if key in lines:
                    raise _Refused(key_node.start_mark, f"duplicate key {shown(key)}, first given on line "
                                                        f"{lines[key]}; keep only one of them")
                lines[key] = key_node.start_mark.line + 1


def _yaml_error(exc: yaml.YAMLError, text: str, name: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"{name}:{mark.line + 1}" if mark else name
    problem = getattr(exc, "problem", None) or type(exc).__name__
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    line = text.split("\n")[mark.line] if mark is not None and mark.line <= text.count("\n") else ""
    if mark is not None and line[mark.column:mark.column + 1] == "\t":
        problem = "a tab character; YAML indents with spaces only"
    elif context and not context.startswith("while") and context_mark is not None:
        problem = f"{context} (line {context_mark.line + 1}), {problem}"
    return f"{where}: not valid YAML: {problem}"


def line_of(node: Optional[yaml.Node], loc: Sequence[str | int]) -> Optional[int]:
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
