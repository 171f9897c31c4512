"""The layer contract: a module imports only its own layer and those below it.

The layers, lowest first (a package, or a module where one module of a package sits apart):

 1. gpu_agent (the package: its version), errors, printable, numbers, plan, proto3, grpcsize, kube.names:
    leaves that import nothing of the agent (kube.names: the Kubernetes name rules the config validates with)
 2. host: the machine under --root (files, paths, processes, kernel interfaces, inotify watches)
 3. config, nvml: the settings, and NVML behind its session
 4. health.policy: what a GPU's health and XIDs mean (the state applies it)
 5. state: the agent's state model
 6. kube, mig, toolkit, metrics, health, plugin, mps, capture, dra: what the stages and the daemon drive
 7. stages: the reconcile stages
 8. sim: the simulator, above everything it simulates
 9. daemon: the engine, HTTP and the composition root (daemon/app.py)
10. cli, __main__: the commands

Every import counts: top-level, function-local (lazy) and TYPE_CHECKING ones. The simulator is wired
in only by the composition root (daemon/app.py) and the commands that choose it (cli/): no other
production module imports it or branches on it.
"""
from __future__ import annotations

import ast
from pathlib import Path

from package_source import modules, nodes

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_agent"
WIRING = {"daemon/app.py"}  # the composition root

LAYERS = (
    ("gpu_agent", "errors", "printable", "numbers", "plan", "proto3", "grpcsize", "kube.names"),
    ("host",),
    ("config", "nvml", "endpoint_proof"),
    ("health.policy",),
    ("state",),
    ("kube", "mig", "toolkit", "metrics", "health", "plugin", "mps", "capture", "dra"),
    ("stages",),
    ("sim",),
    ("daemon",),
    ("cli", "__main__"),
)

# Imports that break the contract, each to be removed: none now.
EXCEPTIONS: set[tuple[str, str]] = set()


def _layer(module: str) -> int:
    """The layer of a dotted name under gpu_agent ("nvml.model"), by its most specific entry."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        name = ".".join(parts[:length])
        for number, layer in enumerate(LAYERS):
            if name in layer:
                return number
    raise AssertionError(f"gpu_agent.{module} is in no layer: add it to LAYERS")


def _name(path: Path) -> str:
    relative = path.relative_to(PACKAGE).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts) or "gpu_agent"


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name under gpu_agent) of every import of the agent's own modules, wherever it is."""
    found = []
    for node in nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "gpu_agent":  # `from gpu_agent import __version__` or `... import sim`
                found += [(node.lineno, a.name if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists()
                           else "gpu_agent") for a in node.names]
            elif node.module.startswith("gpu_agent."):
                base = node.module.removeprefix("gpu_agent.")
                found += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
                          for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.removeprefix("gpu_agent.")) for a in node.names
                      if a.name.startswith("gpu_agent.")]
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _violations(module: str, tree: ast.AST) -> list[str]:
    own = _layer(module)
    return [f"line {line}: imports gpu_agent.{name} (layer {_layer(name) + 1}, above its {own + 1})"
            for line, name in _imported(tree) if _layer(name) > own and not _excepted(module, name)]


def _excepted(module: str, name: str) -> bool:
    return any(module == where and (name == what or name.startswith(f"{what}.")) for where, what in EXCEPTIONS)


def _modules() -> list[tuple[str, str, ast.AST]]:
    return [(module.relative, _name(module.path), module.tree) for module in modules()]


def test_no_module_imports_a_higher_layer() -> None:
    offenders = {relative: found for relative, module, tree in _modules() if (found := _violations(module, tree))}
    assert offenders == {}


def test_every_exception_is_still_needed() -> None:
    """An exception whose import is gone is dropped from EXCEPTIONS, so it cannot hide a new one."""
    used = set()
    for _, module, tree in _modules():
        for _, name in _imported(tree):
            used |= {(where, what) for where, what in EXCEPTIONS
                     if module == where and (name == what or name.startswith(f"{what}."))}
    assert used == EXCEPTIONS


def test_the_check_sees_lazy_and_type_checking_imports() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from gpu_agent.daemon.app import Runtime\n"
                     "def f():\n    import gpu_agent.stages.base\n    from gpu_agent import cli\n")
    assert [line for line, _ in _imported(tree)] == [3, 5, 6]
    assert len(_violations("host.paths", tree)) == 3
    assert _violations("cli.run", tree) == []


def _may_know_the_simulator(relative: str) -> bool:
    return relative.startswith(("sim/", "cli/")) or relative in WIRING


def _mentions(tree: ast.AST) -> list[str]:
    found = []
    for node in nodes(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpu_agent.sim"):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "gpu_agent" and "sim" in (a.name for a in node.names):
            found.append(f"line {node.lineno}: from gpu_agent import sim")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("gpu_agent.sim")]
        elif isinstance(node, ast.Name) and node.id in ("simulate", "simulated", "FakeNvml", "MachineState"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("simulate", "simulated", "real_root_simulated"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_production_module_mentions_the_simulator() -> None:
    offenders = {}
    for relative, _, tree in _modules():
        if _may_know_the_simulator(relative):
            continue
        mentions = _mentions(tree)
        if mentions:
            offenders[relative] = mentions
    assert offenders == {}


def test_the_check_sees_an_import_and_a_branch() -> None:
    tree = ast.parse("from gpu_agent.sim.fake import FakeNvml\nif runtime.simulated:\n    pass\n")
    assert len(_mentions(tree)) == 2
