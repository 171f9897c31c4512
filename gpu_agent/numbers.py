"""Numbers in text from outside the agent, their digits bounded before they are converted.

Python's int() raises ValueError past 4,300 digits (3.11 and later), converts a few thousand in
quadratic time, and takes more than a number should: signs, spaces, underscores and the digits of
every script. No count, size, identifier or version part the agent reads from a file, a command's
output or a peer has more than MAX_DIGITS digits, so anything else is not a number here: these
functions answer None (or, in version_numbers, no version) and the caller says whose text it was.
JSON has its own reader (host/jsontext.py). tests/test_numbers_guard.py keeps every int() of text
in the agent's modules going through here.
"""
from __future__ import annotations

import re
from typing import Optional

MAX_DIGITS = 19  # 2**63 - 1 has 19 digits; more than any count, size, pid or version part
_DECIMAL = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}")
_HEX = re.compile(rf"(?:0[xX])?[0-9a-fA-F]{{1,{MAX_DIGITS}}}")
# A version's leading numbers: `1.6.20~ds1` -> 1, 6, 20; `v1.29.3+k3s1` -> 1, 29, 3. A run of more
# digits is not a version part (the run is not cut: `12345678901234567890.1` has no version).
_VERSION = re.compile(rf"\s*v?([0-9]{{1,{MAX_DIGITS}}})((?:\.[0-9]{{1,{MAX_DIGITS}}})*)(?![0-9])")


def decimal(text: str, maximum: Optional[int] = None) -> Optional[int]:
    """`text` (surrounding whitespace ignored) as an unsigned decimal integer of ASCII digits, at most
    MAX_DIGITS of them and at most `maximum`; None for anything else."""
    text = text.strip()
    if _DECIMAL.fullmatch(text) is None:
        return None
    value = int(text)
    return value if maximum is None or value <= maximum else None


def hexadecimal(text: str) -> Optional[int]:
    """`text` (whitespace ignored) as an unsigned hexadecimal integer, `0x` allowed; None otherwise."""
    text = text.strip()
    return int(text, 16) if _HEX.fullmatch(text) else None


def version_numbers(text: Optional[str], parts: int = 3) -> Optional[tuple[int, ...]]:
    """The first `parts` numbers of a version at the start of `text` (at least major.minor); None when
    it starts with no version."""
    match = _VERSION.match(text or "")
    if match is None or not match.group(2):
        return None
    numbers = (match.group(1), *match.group(2).split(".")[1:])
    return tuple(int(number) for number in numbers[:parts])
