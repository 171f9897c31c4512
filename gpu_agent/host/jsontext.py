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
OWN_DIGITS = 40  # in files the agent writes itself (the ledger, captures): more than any 128-bit number


class NumberTooLong(ValueError):
    """An integer of more digits than `limit`; `where` is "line:column" in the text."""

    def __init__(self, digits: int, limit: int, where: str) -> None:
        super().__init__(f"{where}: an integer of {digits} digits (at most {limit} are read)")
        self.digits = digits
        self.limit = limit
        self.where = where


class _Long(Exception):
    def __init__(self, digits: int) -> None:
        super().__init__()
        self.digits = digits


def loads(text: str | bytes, max_digits: int = MAX_DIGITS, **options: Any) -> Any:
    """json.loads, raising NumberTooLong for an integer longer than `max_digits` (and whatever
    json.loads raises otherwise: ValueError, RecursionError, or what an `options` hook raises)."""
    def bounded(digits: str) -> int:
        length = len(digits) - digits.startswith("-")
        if length > max_digits:
            raise _Long(length)
        return int(digits)

    try:
        return json.loads(text, parse_int=bounded, **options)
    except _Long as exc:
        source = text.decode(errors="replace") if isinstance(text, bytes) else text
        raise NumberTooLong(exc.digits, max_digits, _where_long(source, max_digits)) from None


def _where_long(text: str, max_digits: int) -> str:
    # Strings are skipped whole (unterminated: to the end), so digits inside one are never taken for a number.
    pattern = re.compile(rf'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|(?<![\d.eE+-])-?\d{{{max_digits + 1},}}', re.DOTALL)
    for match in pattern.finditer(text):
        if not match.group().startswith('"'):
            offset = match.start()
            return f"{text.count(chr(10), 0, offset) + 1}:{offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"
    return "?"
