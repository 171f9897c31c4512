"""Docker: `runtimes.nvidia` merged into /etc/docker/daemon.json, every other key kept.

The file is read as Docker's Go parser reads it, and refused where a rewrite could change what
Docker sees: NaN and Infinity (Python's json writes them back, Docker rejects them), numbers too
large for a float64, and a key given twice in one object (Docker silently takes the last one; the
agent would keep only that one and lose the other's content). Errors name the file, the line and
column or the key, never a value: daemon.json can hold proxy or registry credentials.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from gpu_agent.errors import StageError
from gpu_agent.host import jsontext
from gpu_agent.toolkit.document import (
    BOOLEAN,
    MAX_DEPTH,
    STRING,
    STRINGS,
    TABLE,
    Document,
)

DAEMON_JSON = "/etc/docker/daemon.json"
SCHEMA = (
    (("runtimes",), TABLE),
    (("runtimes", "nvidia"), TABLE),
    (("runtimes", "nvidia", "path"), STRING),
    (("runtimes", "nvidia", "args"), STRINGS),
    (("runtimes", "nvidia", "runtimeArgs"), STRINGS),
    (("default-runtime",), STRING),
    (("features",), TABLE),
    (("features", "cdi"), BOOLEAN),
)
_UNCHANGED = "nothing was changed"


def desired(current: Optional[str], binary: str, enable_cdi: bool, set_as_default: bool,
            name: str = DAEMON_JSON) -> str:
    """The file with the nvidia runtime; `current` itself when nothing needs to change."""
    document = parse(current, name) if current is not None else Document({}, name, json_terms=True)
    document.check(SCHEMA)
    settings = document.data
    nvidia = settings.setdefault("runtimes", {}).get("nvidia", {})
    settings["runtimes"]["nvidia"] = {**nvidia, "path": binary, "args": nvidia.get("args", [])}
    if set_as_default:
        settings["default-runtime"] = "nvidia"
    elif settings.get("default-runtime") == "nvidia":
        del settings["default-runtime"]  # set by us earlier: back to Docker's own default (runc)
    if enable_cdi:
        settings.setdefault("features", {})["cdi"] = True
    # Unchanged content keeps the file exactly as it is, whatever its formatting.
    if current is not None and parse(current, name).data == settings:
        return current
    return json.dumps(settings, indent=4) + "\n"


class _Refused(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse(text: str, name: str = DAEMON_JSON) -> Document:
    """daemon.json as a checked document; an empty file is an empty object."""
    if not text.strip():
        return Document({}, name, json_terms=True)
    depth = _nesting(text)
    if depth is not None:
        raise StageError(f"{name}:{_position(text, depth)}: nested more than {MAX_DEPTH} levels deep; {_UNCHANGED}")
    try:
        data = jsontext.loads(text, parse_constant=_constant, parse_float=_finite, object_pairs_hook=_no_duplicates)
    except jsontext.NumberTooLong as exc:
        raise StageError(f"{name}:{exc.where}: an integer of {exc.digits} digits, larger than any setting of Docker's "
                         f"holds; write a smaller one; {_UNCHANGED}") from None
    except json.JSONDecodeError as exc:
        raise StageError(f"{name}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}; {_UNCHANGED}") from None
    except _Refused as exc:
        where = _first_constant(text) if "NaN or Infinity" in exc.reason else None
        raise StageError(f"{name}{':' + where if where else ''}: {exc.reason}; {_UNCHANGED}") from None
    except RecursionError:  # _nesting bounds this; kept for safety
        raise StageError(f"{name}: nested more than {MAX_DEPTH} levels deep; {_UNCHANGED}") from None
    return Document(data, name, json_terms=True)


def _constant(word: str) -> Any:
    raise _Refused("NaN or Infinity is not JSON (Docker refuses the file); write a number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused("a number too large for Docker (a float64); write a smaller one")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"the key {json.dumps(key)} appears twice in one object: Docker would use the last one "
                           "silently; remove the other")
        result[key] = value
    return result


# A string token runs to its closing quote or, unterminated, to the end: the scan stays linear.
_STRING = r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)'
_STRING_OR_BRACKET = re.compile(_STRING + r"|[\[\]{}]", re.DOTALL)
_STRING_OR_CONSTANT = re.compile(_STRING + r"|NaN|-?Infinity", re.DOTALL)


def _nesting(text: str) -> Optional[int]:
    """The offset where arrays and objects nest more than MAX_DEPTH deep, if they do (json's own
    parser would hit Python's recursion limit on deep enough input)."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return match.start()
        elif token in "]}":
            depth -= 1
    return None


def _first_constant(text: str) -> Optional[str]:
    for match in _STRING_OR_CONSTANT.finditer(text):
        if not match.group().startswith('"'):
            return _position(text, match.start())
    return None


def _position(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"{line}:{offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"
