"""JSON from outside the agent, its integers bounded before they are converted.

Python refuses to convert an integer of more than 4,300 digits (ValueError, from deep inside the
json module) and converts one of a few thousand in quadratic time; no file or API answer the agent
reads holds an integer near MAX_DIGITS, so a longer one is refused, with its line and column.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DIGITS = 100


class NumberTooLong(ValueError):
    """An integer of more than MAX_DIGITS digits; `where` is "line:column" in the text."""

    def __init__(self, digits: int, where: str) -> None:
        super().__init__(f"{where}: an integer of {digits} digits (at most {MAX_DIGITS} are read)")
        self.digits = digits
        self.where = where


class _Long(Exception):
    def __init__(self, digits: int) -> None:
        super().__init__()
        self.digits = digits


def _bounded(digits: str) -> int:
    if len(digits) > MAX_DIGITS and len(digits.lstrip("-")) > MAX_DIGITS:
        raise _Long(len(digits.lstrip("-")))
    return int(digits)


def loads(text: str | bytes, **options: Any) -> Any:
    """json.loads, raising NumberTooLong for an integer longer than MAX_DIGITS (and whatever
    json.loads raises otherwise: ValueError, RecursionError, or what an `options` hook raises)."""
    try:
        return json.loads(text, parse_int=_bounded, **options)
    except _Long as exc:
        source = text.decode(errors="replace") if isinstance(text, bytes) else text
        raise NumberTooLong(exc.digits, _where_long(source)) from None


# Strings are skipped whole (unterminated: to the end), so digits inside one are never taken for a number.
_STRING_OR_LONG = re.compile(rf'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|(?<![\d.eE+-])-?\d{{{MAX_DIGITS + 1},}}', re.DOTALL)


def _where_long(text: str) -> str:
    for match in _STRING_OR_LONG.finditer(text):
        if not match.group().startswith('"'):
            offset = match.start()
            return f"{text.count(chr(10), 0, offset) + 1}:{offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"
    return "?"
