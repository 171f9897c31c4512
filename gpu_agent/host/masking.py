"""Credentials masked out of text shown to people: diffs of runtime configs, in any of their formats.

One pass over the text, every step bounded or anchored where a run starts, so the work is linear in
the text's size whatever it holds (a 1 MB line of word characters, runs of quotes or backslashes,
deep nesting). What is masked:
- the value of a key naming a credential (`password = "..."`, `"X-Api-Key": "..."`, `token: ...`):
  a string, a bare value to the next separator, every scalar of an array (`Authorization =
  ["Bearer ..."]`, over several lines too), a YAML block scalar or sequence under the key; a value
  that opens a table is shown, its keys are judged one by one;
- the user information of a URL (`https://user:pass@mirror/`);
- the credential after `Bearer` or `Basic`, under whatever key;
- the body of a PEM private key block (`-----BEGIN ... PRIVATE KEY-----`).
"""
from __future__ import annotations

import re
MASK = "<redacted>"

# Words that make a key a credential's, compared lower-cased with '-', '_' and spaces taken out.
_WORDS = ("password", "passwd", "passphrase", "secret", "token", "auth", "credential", "apikey",
          "accesskey", "privatekey", "bearer", "cookie", "session")
_KEY_CHARS = 256  # a key longer than this is no key a runtime config has

# A key is looked at only where its run of key characters starts, and only if a credential word is
# in its first _KEY_CHARS characters: each character is scanned a bounded number of times.
_WORD = "(?:" + "|".join("[-_]?".join(word) for word in _WORDS) + ")"
_N = _KEY_CHARS
_PATTERN = re.compile(
    r"""(?P<pem>-----BEGIN[ A-Z0-9]{0,64}PRIVATE[ ]KEY-----)"""
    r"""|(?<=://)(?P<userinfo>[^\s/@?#"'<>\[\]{}\\]{1,1024})@"""
    r"""|(?<![\w.-])(?P<scheme>bearer|basic)[ \t]+(?=[\w~+/=.-])"""
    rf"""|(?:(?<![\w.-])(?=[\w.-]{{0,{_N}}}?{_WORD})(?P<bare>[\w.-]{{1,{_N}}})(?![\w.-])"""
    rf"""|(?P<quote>["'])(?=[^"'\\\r\n]{{0,{_N}}}?{_WORD})(?P<quoted>[^"'\\\r\n]{{1,{_N}}})(?P=quote))"""
    r"""[ \t]*(?:=|:(?![/:]))[ \t]*""",
    re.IGNORECASE,
)
_PEM_END = re.compile(r"-----END[ A-Z0-9]{0,64}PRIVATE KEY-----", re.IGNORECASE)
_SCHEME_VALUE = re.compile(r"[\w~+/=.-]+")
_STRING = re.compile(r'"""[\s\S]*?(?:"""|\Z)|\'\'\'[\s\S]*?(?:\'\'\'|\Z)|"(?:[^"\\\r\n]|\\.)*"?|\'[^\'\r\n]*\'?')
_BARE = re.compile(r"[^,}\]\r\n]+")
_LINE_REST = re.compile(r"[ \t]*(?:#[^\r\n]*)?(?=\r?\n|\Z)")
_BLOCK_SCALAR = re.compile(r"[|>][-+0-9]{0,3}[ \t]*(?:#[^\r\n]*)?(?=\r?\n|\Z)")
# Inside an array under a credential key: strings and bare scalars (masked), brackets (counted).
_ARRAY_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|\'[^\']*\'?|(?P<open>[\[{])|(?P<close>[\]}])|#[^\r\n]*'
                          r'|[^\s,\[\]{}"\'#:=]+')
_NOT_LINE = re.compile(r"[^\r\n]+")
_MAPPING_ENTRY = re.compile(rf"""(?:[\w.-]{{1,{_N}}}|"[^"\r\n]{{0,{_N}}}"|'[^'\r\n]{{0,{_N}}}')[ \t]*:(?:[ \t]|\r?$)""")


def masked(text: str) -> str:
    """`text` with every credential it holds replaced by MASK."""
    out: list[str] = []
    at = 0
    while True:
        found = _PATTERN.search(text, at)
        if found is None:
            out.append(text[at:])
            return "".join(out)
        out.append(text[at:found.start()])
        at = found.end()
        if found["pem"]:
            end = _PEM_END.search(text, at)
            stop = end.start() if end else len(text)
            out.append(found.group() + _NOT_LINE.sub(MASK, text[at:stop]))
            at = stop
        elif found["userinfo"]:
            out.append(MASK + "@")
        elif found["scheme"]:
            value = _SCHEME_VALUE.match(text, at)
            out.append(found.group() + (MASK if value else ""))
            at = value.end() if value else at
        else:
            out.append(found.group())
            if _is_credential(found["bare"] or found["quoted"]):
                at = _mask_value(text, at, found.start(), out)


def _is_credential(key: str) -> bool:
    last = key.rsplit(".", 1)[-1] or key
    name = last.lower().replace("-", "").replace("_", "").replace(" ", "")
    return any(word in name for word in _WORDS)


def _mask_value(text: str, at: int, key: int, out: list[str]) -> int:
    """Append the masked value, starting at `at`, of the credential key at `key`; where the text goes on."""
    if at >= len(text):
        return at
    first = text[at]
    if first == "{":
        return at  # a table: its own keys say what they hold
    if first == "[":
        return _mask_array(text, at, out)
    string = _STRING.match(text, at) if first in "\"'" else None
    if string:
        out.append(MASK if "\n" not in string.group() else _NOT_LINE.sub(MASK, string.group()))
        return string.end()
    block = _BLOCK_SCALAR.match(text, at) or _LINE_REST.match(text, at)
    if block:  # nothing on the key's line: a YAML block scalar or sequence may follow, more indented
        out.append(text[at:block.end()])
        column = key - (text.rfind("\n", 0, key) + 1)  # once a line: only a line's last key gets here
        return _mask_block(text, block.end(), column, out, scalar=block.group().startswith(("|", ">")))
    bare = _BARE.match(text, at)
    if bare:
        out.append(MASK)
        return bare.end()
    return at


def _mask_array(text: str, at: int, out: list[str]) -> int:
    depth = 0
    position = at
    for token in _ARRAY_TOKEN.finditer(text, at):
        out.append(text[position:token.start()])
        position = token.end()
        if token["open"]:
            depth += 1
            out.append(token.group())
        elif token["close"]:
            depth -= 1
            out.append(token.group())
            if depth == 0:
                return position
        elif token.group().startswith("#"):
            out.append(token.group())
        else:
            out.append(MASK)
    out.append(text[position:])
    return len(text)  # never closed: the rest of the text may all be the credential's


def _mask_block(text: str, at: int, column: int, out: list[str], scalar: bool) -> int:
    """Lines after a credential key with nothing on its own line: a block scalar's (`|`, `>`) lines,
    or a sequence's items, indented more than the key (items may be at its column); a mapping is
    left to the main pass."""
    position = at
    first = True
    while position < len(text):
        end = text.find("\n", position + 1)
        end = len(text) if end < 0 else end
        line = text[position:end]  # starts with the newline ending the line before
        content = line.lstrip("\r\n")
        body = content.lstrip(" \t")
        indent = len(content) - len(body)
        if body.strip() and not (indent > column or (not scalar and indent == column and body.startswith("- "))):
            break
        if body.strip() and first and not scalar and not body.startswith(("- ", "[", '"', "'")) \
                and _looks_like_mapping(body):
            break
        if body.strip():
            first = False
            item = "- " if not scalar and body.startswith("- ") else ""
            out.append(line[:len(line) - len(body)] + item + MASK + ("\r" if body.endswith("\r") else ""))
        else:
            out.append(line)
        position = end
    return position


def _looks_like_mapping(body: str) -> bool:
    return _MAPPING_ENTRY.match(body) is not None
