"""The simulator is wired in only by the composition root (daemon/app.py) and the commands that
choose it (cli/): no other production module imports it or branches on it."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_agent"
WIRING = {"daemon/app.py"}  # the composition root


def _may_know_the_simulator(relative: str) -> bool:
    return relative.startswith(("sim/", "cli/")) or relative in WIRING


def _mentions(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpu_agent.sim"):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("gpu_agent.sim")]
        elif isinstance(node, ast.Name) and node.id in ("simulate", "simulated", "FakeNvml", "MachineState"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("simulate", "simulated", "real_root_simulated"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_production_module_mentions_the_simulator() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if _may_know_the_simulator(relative):
            continue
        mentions = _mentions(ast.parse(path.read_text(), str(path)))
        if mentions:
            offenders[relative] = mentions
    assert offenders == {}


def test_the_check_sees_an_import_and_a_branch() -> None:
    tree = ast.parse("from gpu_agent.sim.fake import FakeNvml\nif runtime.simulated:\n    pass\n")
    assert len(_mentions(tree)) == 2
