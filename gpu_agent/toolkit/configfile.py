"""Reading a container runtime's config files from the host, whatever is there.

Every path is a host path resolved under the Root. Symbolic links are followed the way the kernel
would follow them inside a chroot at the Root, so a link never leads outside it; the agent then
reads and writes the link's target (write-through: the link stays a link, and its target is the
file that changes). A link to nothing, a directory, a FIFO, a device, an unreadable or oversized
file, or bytes that are not UTF-8 are refused with a message that names the file and the reason,
never its content (runtime configs can hold registry credentials).
"""
from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from typing import Optional, Sequence

from gpu_agent.errors import StageError
from gpu_agent.host import paths
from gpu_agent.host.bounded import NotRegular, TooLarge, kind_of, read_bounded_file
from gpu_agent.host.paths import Root
from gpu_agent.printable import printable

MAX_BYTES = 1 << 20  # real runtime configs are a few KiB; parsing is slow beyond this
_UNCHANGED = "nothing was changed"


@dataclass(frozen=True)
class ConfigFile:
    path: str  # the host path as the runtime names it
    target: str  # where it really is: links followed under the Root (== path when no link is involved)
    text: Optional[str]  # None: the file does not exist
    mode: Optional[int] = None  # permission bits of an existing file

    @property
    def shown(self) -> str:
        """How messages name the file: the path, and where a link leads."""
        return describe(self.path, self.target)


def describe(path: str, target: str) -> str:
    return printable(path) if path == target else f"{printable(path)} (a link to {printable(target)})"


def resolve(root: Root, host_path: str) -> str:
    """`host_path` with every symbolic link in it followed, the Root acting as `/` (as in a chroot).
    A part that does not exist ends the walk; the rest is joined as written."""
    return _walk(root, host_path)[0]


def _walk(root: Root, host_path: str) -> tuple[str, bool]:
    """resolve()'s path, and whether the walk ended at a part a link named (a link that leads to nothing)."""
    if "\0" in host_path:
        raise StageError(f"{printable(host_path)}: a path cannot hold a NUL character; {_UNCHANGED}")
    try:
        done, rest, dangling = paths.walk(root, host_path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StageError(f"{printable(host_path)}: too many levels of symbolic links (a loop?); "
                             f"{_UNCHANGED}") from None
        raise StageError(f"{printable(host_path)}: cannot look up {printable(str(exc.filename or host_path))}: "
                         f"{exc.strerror or exc}; {_UNCHANGED}") from None
    return posixpath.normpath(posixpath.join(done, *rest)), dangling


def read(root: Root, host_path: str, why: str = "") -> ConfigFile:
    """The file's text, or None for a file that does not exist; a StageError for anything else
    that is not a readable UTF-8 text file of at most MAX_BYTES. `why` (such as "imported by
    /etc/containerd/config.toml") follows the file's name in messages."""
    target, dangling = _walk(root, host_path)
    name = describe(host_path, target)
    shown = name + (f" ({why})" if why else "")
    try:
        found = read_bounded_file(root(target), MAX_BYTES, follow=False)
    except NotRegular as exc:
        raise StageError(f"{shown}: is {kind_of(exc.mode)}, not a file; {_UNCHANGED}") from None
    except TooLarge as exc:
        if exc.size is None:
            raise StageError(f"{shown}: is more than the {MAX_BYTES} bytes a runtime config may have; "
                             f"{_UNCHANGED}") from None
        raise StageError(f"{shown}: is {exc.size} bytes, more than the {MAX_BYTES} a runtime config "
                         f"may have; {_UNCHANGED}") from None
    except OSError as exc:
        reason = "a symbolic link changed while it was read" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        try:
            kind = os.stat(root(target)).st_mode
        except OSError:
            kind = stat.S_IFREG
        if not stat.S_ISREG(kind):  # a socket, say, cannot even be opened
            raise StageError(f"{shown}: is {kind_of(kind)}, not a file; {_UNCHANGED}") from None
        raise StageError(f"{shown}: cannot be read: {reason}; {_UNCHANGED}") from None
    if found is None:
        if dangling:
            raise StageError(f"{shown}: the link leads to nothing: point it at a file or remove it; "
                             f"{_UNCHANGED}")
        return ConfigFile(host_path, target, None)
    data, info = found
    return ConfigFile(host_path, target, decode(data, name), stat.S_IMODE(info.st_mode))


def decode(data: bytes, shown: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise StageError(f"{shown}:{line}:{column}: not UTF-8 text (runtime configs are UTF-8); {_UNCHANGED}") from None


# --- directory listings as Go's filepath package makes them (containerd and CRI-O are Go) -----------

_META = re.compile(r"[*?\[\\]")


class BadPattern(ValueError):
    """A glob pattern Go's filepath.Match rejects (ErrBadPattern)."""


def glob(root: Root, pattern: str, assume: Sequence[str] = ()) -> list[str]:
    """Go's filepath.Glob of an absolute host pattern: `*` and `?` match dot files too, the names
    of each directory are sorted, links are followed, directories match like files. The paths in
    `assume` count as existing (a file about to be written). Raises BadPattern for a pattern Go
    rejects."""
    for part in pattern.split("/"):
        _go_pattern(part)
    if not _META.search(pattern):
        return [pattern] if pattern in assume or _lexists(root, pattern) else []
    directory, name = posixpath.split(pattern)
    directory = directory.rstrip("/") or "/"
    if not _META.search(directory):
        return _glob_in(root, directory, _go_pattern(name), assume)
    if directory == pattern:
        raise BadPattern(pattern)
    return [match for parent in glob(root, directory, assume)
            for match in _glob_in(root, parent, _go_pattern(name), assume)]


def _glob_in(root: Root, directory: str, matcher: re.Pattern[str], assume: Sequence[str]) -> list[str]:
    real = root(resolve(root, directory))
    prefix = directory.rstrip("/") + "/"
    names = {path[len(prefix):].split("/")[0] for path in assume if path.startswith(prefix)}  # and their directories
    try:
        names.update(os.listdir(real) if real.is_dir() else ())
    except OSError:
        pass  # Go's Glob ignores I/O errors reading directories
    return [posixpath.join(directory, name) for name in sorted(names) if matcher.fullmatch(name)]


def _lexists(root: Root, host_path: str) -> bool:
    parent, name = posixpath.split(posixpath.normpath(host_path))
    try:
        os.lstat(root(resolve(root, parent)) / name if name else root(parent))
    except OSError:
        return False
    return True


def walk(root: Root, directory: str) -> list[str]:
    """Every file under `directory`, as Go's filepath.Walk visits them (sorted names, depth first,
    links not followed into directories): how CRI-O reads its drop-in directory."""
    real = root(resolve(root, directory))
    if not real.is_dir():
        return []
    files: list[str] = []
    try:
        names = sorted(os.listdir(real))
    except OSError as exc:
        raise StageError(f"{printable(directory)}: cannot be listed: {exc.strerror or exc}; {_UNCHANGED}") from None
    for name in names:
        path = posixpath.join(directory, name)
        try:
            info = os.lstat(real / name)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISDIR(info.st_mode):
            files += walk(root, path)
        else:
            files.append(path)
    return files


def _go_pattern(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match syntax as a regular expression for one path element. Like Python's
    fnmatch, each stretch between stars is matched atomically (a lookahead and a backreference),
    so a pattern with many stars cannot make matching take exponential time."""
    pieces: list[list[str]] = [[]]  # the pattern's parts between stars, as regular expressions
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "*":
            pieces.append([])
        elif char == "?":
            pieces[-1].append("[^/]")
        elif char == "\\":
            i += 1
            if i >= len(pattern):
                raise BadPattern(pattern)
            pieces[-1].append(re.escape(pattern[i]))
        elif char == "[":
            i, cls = _go_class(pattern, i + 1)
            pieces[-1].append(cls)
            continue
        else:
            pieces[-1].append(re.escape(char))
        i += 1
    parts = ["".join(piece) for piece in pieces]
    if len(parts) == 1:
        return re.compile(parts[0] + r"\Z", re.DOTALL)
    middle = "".join(f"(?=(?P<g{n}>[^/]*?{part}))(?P=g{n})" for n, part in enumerate(parts[1:-1]) if part)
    return re.compile(f"{parts[0]}{middle}[^/]*{parts[-1]}\\Z", re.DOTALL)


def _go_class(pattern: str, i: int) -> tuple[int, str]:
    """A `[...]` class starting after its `[`: the index after its `]`, and the regex class."""
    negate = i < len(pattern) and pattern[i] == "^"
    if negate:
        i += 1
    ranges = []
    first = True
    while True:
        if i >= len(pattern):
            raise BadPattern(pattern)
        if pattern[i] == "]" and not first:
            i += 1
            break
        low, i = _go_class_char(pattern, i)
        high = low
        if i < len(pattern) and pattern[i] == "-":
            high, i = _go_class_char(pattern, i + 1)
            if high < low:
                raise BadPattern(pattern)
        ranges.append(re.escape(low) if low == high else f"{re.escape(low)}-{re.escape(high)}")
        first = False
    return i, f"[{'^' if negate else ''}{''.join(ranges)}{'/' if negate else ''}]"


def _go_class_char(pattern: str, i: int) -> tuple[str, int]:
    if i >= len(pattern) or pattern[i] in "-]":
        raise BadPattern(pattern)
    if pattern[i] == "\\":
        i += 1
        if i >= len(pattern):
            raise BadPattern(pattern)
    return pattern[i], i + 1
