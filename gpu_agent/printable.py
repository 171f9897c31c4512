"""Text from outside (the driver, NVML, sysfs, file names) made fit for a log line, a status line or an HTTP
answer: a newline in a GPU name could forge a log line or a `[+]check ok` line of /readyz?verbose, an escape
sequence could rewrite an operator's terminal, a bidirectional override could make a line read backwards."""
from __future__ import annotations

import re

# C0 controls and DEL, C1 controls, the bidirectional embeddings, overrides and isolates, and lone
# surrogates (from bytes that were not UTF-8, kept by surrogateescape).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with every such character written as an escape (\\n, \\x1b, \\u202e); a byte that was not
    UTF-8 as \\xNN. Text without them comes back as it is."""
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x80:
        return repr(match.group())[1:-1]  # \n, \t, \x1b as Python writes them
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"
