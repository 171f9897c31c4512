"""The agent's own modules parsed once per test process, for the guards that read its source (the layers,
bounded reads and runs, ints of text, the state model's owner): each file's tree, and the nodes of each
tree in ast.walk's order, so that no guard parses or walks the whole package again (they were a few seconds
of every `make test`)."""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_agent"


@dataclass(frozen=True)
class Module:
    path: Path
    relative: str  # "host/paths.py"
    lines: list[str]
    tree: ast.Module


@functools.lru_cache(maxsize=1)
def modules() -> tuple[Module, ...]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        found.append(Module(path, path.relative_to(PACKAGE).as_posix(), text.splitlines(), ast.parse(text, str(path))))
    return tuple(found)


_WALKED: dict[int, tuple[ast.AST, ...]] = {}  # by id() of a tree modules() keeps alive


def nodes(tree: ast.AST) -> Sequence[ast.AST]:
    """Every node of `tree`, as ast.walk gives them; walked once for the package's own trees."""
    if not any(module.tree is tree for module in modules()):
        return tuple(ast.walk(tree))
    walked = _WALKED.get(id(tree))
    if walked is None:
        walked = _WALKED[id(tree)] = tuple(ast.walk(tree))
    return walked
