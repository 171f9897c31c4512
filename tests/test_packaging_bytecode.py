"""The packages' scripts compile the agent's bytecode for the installed python3 and remove it again
(the blocks between the `bytecode` markers, run against a stand-in for /usr/lib/gpu-agent)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGING = Path(__file__).resolve().parent.parent / "packaging"
ABI = f"{sys.version_info[0]}{sys.version_info[1]}"


def block(script: str, name: str, lib: Path) -> str:
    text = (PACKAGING / script).read_text()
    found = re.search(rf"# >>> bytecode: {name}\n(.*?)# <<< bytecode: {name}", text, re.S)
    assert found, f"{script} has no bytecode {name} block"
    return found.group(1).replace("/usr/lib/gpu-agent", str(lib)).replace("python3 -I", f"{sys.executable} -I")


def tree(lib: Path) -> None:
    for path in ("gpu_agent/__init__.py", f"site-cp{ABI}/fast/__init__.py", "site-cp27/other.py"):
        (lib / path).parent.mkdir(parents=True, exist_ok=True)
        (lib / path).write_text("VALUE = 1\n")
    (lib / f"site-cp{ABI}/broken.py").write_text("def (:\n")  # a file that does not compile fails nothing


def caches(lib: Path) -> list[str]:
    return sorted(str(path.relative_to(lib)) for path in lib.rglob("*.pyc"))


@pytest.mark.subprocess
@pytest.mark.parametrize(("install", "remove", "args"), [("deb/postinst", "deb/prerm", ("configure",)),
                                                         ("rpm/post", "rpm/preun", ("0",))])
def test_install_compiles_for_this_python_and_removal_cleans_up(
        tmp_path: Path, install: str, remove: str, args: tuple[str, ...]) -> None:
    lib = tmp_path / "usr/lib/gpu-agent"
    tree(lib)
    compiled = subprocess.run(["sh", "-ec", block(install, "compile", lib), "script", *args],
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    tag = sys.implementation.cache_tag
    assert caches(lib) == [f"gpu_agent/__pycache__/__init__.{tag}.pyc",
                           f"site-cp{ABI}/fast/__pycache__/__init__.{tag}.pyc"]
    removed = subprocess.run(["sh", "-ec", block(remove, "remove", lib)], capture_output=True, text=True, timeout=60)
    assert removed.returncode == 0, removed.stderr
    assert caches(lib) == [] and not list(lib.rglob("__pycache__"))
