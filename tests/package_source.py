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
    nodes: tuple[ast.AST, ...]  # the tree's, in ast.walk's order


@functools.lru_cache(maxsize=1)
def modules() -> tuple[Module, ...]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text, str(path))
        found.append(Module(path, path.relative_to(PACKAGE).as_posix(), text.splitlines(), tree,
                            tuple(ast.walk(tree))))
    return tuple(found)


@functools.lru_cache(maxsize=1)
def _walked() -> dict[int, tuple[ast.AST, ...]]:
    return {id(module.tree): module.nodes for module in modules()}  # modules() keeps each tree, and its id, alive


def nodes(tree: ast.AST) -> Sequence[ast.AST]:
    """Every node of `tree`, as ast.walk gives them; walked once for the package's own trees."""
    walked = _walked().get(id(tree))
    return walked if walked is not None else tuple(ast.walk(tree))
