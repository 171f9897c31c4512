"""MIG profile names as mig-parted and nvidia-smi write them: `[<c>c.]<g>g.<gb>gb[+attr,...|-attr,...]`.

`3g.40gb` is a MIG device that is a whole 3-slice GPU instance; `1c.3g.40gb` is a 1-slice compute
instance inside one; `1g.10gb+me` a GPU instance profile with the media extensions, `1g.24gb-me` one
without. The grammar is go-nvlib's (which mig-parted uses), so every file mig-parted reads reads here.

Which compute instance sizes a GPU instance offers cannot be asked of NVML before a GPU instance
exists; `compute_sizes` and `compute_starts` are the rule every MIG GPU so far follows (the same one
go-nvlib uses to list profiles): a c-slice compute instance fits a g-slice GPU instance when c == g, or
when c < g and 2c <= g + 1, at starts aligned to c rounded up to a power of two.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_FIELDS = re.compile(r"(?:([0-9]{1,6})c\.)?([0-9]{1,6})g\.([0-9]{1,6})gb")
_ATTRIBUTE = re.compile(r"[A-Za-z][A-Za-z0-9.]*")
MAX_SLICES = 64  # more than any GPU has; keeps numbers in a profile name small


@dataclass(frozen=True)
class ProfileName:
    """A parsed profile name. `c == g` when the name has no `<c>c.` part."""

    g: int
    gb: int
    c: int
    attributes: tuple[str, ...] = ()  # after '+', sorted
    negated: tuple[str, ...] = ()  # after '-', sorted

    @property
    def gpu_instance(self) -> str:
        """The GPU instance profile this MIG device lives in: `1c.3g.40gb` -> `3g.40gb`."""
        return f"{self.g}g.{self.gb}gb{self._suffix()}"

    def __str__(self) -> str:
        prefix = "" if self.c == self.g else f"{self.c}c."
        return prefix + self.gpu_instance

    def _suffix(self) -> str:
        if self.attributes:
            return "+" + ",".join(self.attributes)
        if self.negated:
            return "-" + ",".join(self.negated)
        return ""


def parse_profile(text: str) -> ProfileName:
    """`1c.3g.40gb` to a ProfileName; ValueError saying what is wrong (for a message naming the entry)."""
    if not isinstance(text, str) or not text:
        raise ValueError("a MIG profile is a non-empty string such as 3g.40gb")
    plus, minus = text.find("+"), text.find("-")
    if plus != -1 and minus != -1:
        raise ValueError(f"{text!r} has both '+' and '-' attributes")
    cut = plus if plus != -1 else minus
    fields, attributes = (text, "") if cut == -1 else (text[:cut], text[cut + 1:])
    match = _FIELDS.fullmatch(fields)
    if match is None:
        raise ValueError(f"{text!r} is not [<c>c.]<g>g.<gb>gb[+attribute|-attribute], e.g. 3g.40gb, 1c.3g.40gb, "
                         "1g.10gb+me")
    c_text, g_text, gb_text = match.groups()
    g, gb = int(g_text), int(gb_text)
    c = int(c_text) if c_text is not None else g
    if not (1 <= c <= MAX_SLICES and 1 <= g <= MAX_SLICES):
        raise ValueError(f"{text!r}: slice counts must be 1 to {MAX_SLICES}")
    if c > g:
        raise ValueError(f"{text!r}: a {c}-slice compute instance cannot be larger than its {g}-slice GPU instance")
    parsed: tuple[str, ...] = ()
    if cut != -1:
        names = attributes.split(",")
        for name in names:
            if not _ATTRIBUTE.fullmatch(name) or name.endswith("."):
                raise ValueError(f"{text!r}: attribute {name!r} is not a word such as me, me.all or gfx")
        if len(set(names)) != len(names):
            raise ValueError(f"{text!r}: an attribute is given twice")
        parsed = tuple(sorted(names))
    if plus != -1:
        return ProfileName(g, gb, c, attributes=parsed)
    return ProfileName(g, gb, c, negated=parsed)


def compute_sizes(gpu_instance_slices: int) -> tuple[int, ...]:
    """Compute instance sizes (in slices) a GPU instance of this many compute slices offers, largest first."""
    g = gpu_instance_slices
    return tuple(c for c in range(g, 0, -1) if c == g or 2 * c <= g + 1)


def compute_starts(gpu_instance_slices: int, size: int) -> tuple[int, ...]:
    """Where a compute instance of `size` slices may start inside a GPU instance."""
    if size not in compute_sizes(gpu_instance_slices):
        return ()
    step = 1
    while step < size:
        step *= 2
    return tuple(start for start in range(0, gpu_instance_slices, step) if start + size <= gpu_instance_slices)
