"""The packages' scripts compile the agent's bytecode for the installed python3 and remove it again
(the blocks between the `bytecode` markers, run against a stand-in for /usr/lib/gpu-agent); build.py
vendors only pinned versions."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def load_build() -> object:
    spec = importlib.util.spec_from_file_location("packaging_build", PACKAGING / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up there
    spec.loader.exec_module(module)
    return module


def test_a_vendored_distribution_its_pins_do_not_name_fails_the_build(tmp_path: Path) -> None:
    build: Any = load_build()
    site = tmp_path / "site"
    for name, version in (("pydantic", "2.14.4"), ("typing_extensions", "4.16.0")):
        (site / f"{name}-{version}.dist-info").mkdir(parents=True)
        (site / f"{name}-{version}.dist-info/METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                                                     f"Version: {version}\n")
    pins = tmp_path / "constraints.txt"
    target = build.Target("t", "deb", "3.11", "1", "bookworm", pins)
    pins.write_text("# a comment\npydantic==2.14.4\ntyping_extensions==4.15.0\n")
    with pytest.raises(SystemExit, match=r"does not pin typing_extensions 4\.16\.0; pin each as name==version"):
        build.check_pinned(target, site)
    pins.write_text("pydantic==2.14.4  # the dev pin\ntyping-extensions==4.16.0\n")  # names compare normalized
    build.check_pinned(target, site)
    pins.write_text("pydantic>=2\n")
    with pytest.raises(SystemExit, match=r"constraints\.txt:1: not name==version: 'pydantic>=2'"):
        build.check_pinned(target, site)
