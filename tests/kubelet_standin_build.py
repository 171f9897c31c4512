"""The Go kubelet stand-in (tests/kubelet_standin/), built from Debian's Go packages (.ci/run installs them)
once per distinct source (build_cache.py). `python tests/kubelet_standin_build.py` builds it before the
test workers start (the Makefile's warm-up), so no worker waits on the build; it says nothing and builds
nothing where go or protoc is missing (the tests that need it then skip, or fail in CI, saying why)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from build_cache import cached_build

HERE = Path(__file__).resolve().parent
TOOLS = ("go", "protoc", "protoc-gen-go")


def missing_tools() -> bool:
    return shutil.which("go") is None or shutil.which("protoc") is None


def standin_binary() -> Optional[Path]:
    """The built stand-in; None where go or protoc is missing. AssertionError with the build's output when the
    build fails."""
    if missing_tools():
        return None

    def build(binary: Path, work: Path) -> None:
        built = subprocess.run([str(HERE / "kubelet_standin" / "build.sh"), str(binary), str(work / "gopath")],
                               capture_output=True, text=True, timeout=300)
        assert built.returncode == 0, f"building the kubelet stand-in failed:\n{built.stdout}\n{built.stderr}"

    sources = [HERE / "kubelet_standin" / "build.sh", HERE / "kubelet_standin" / "main.go",
               HERE / "kubelet_api/deviceplugin.proto"]
    return cached_build("kubelet-standin", sources, TOOLS, build)


if __name__ == "__main__":
    try:
        standin_binary()
    except AssertionError as exc:  # the tests that need it report the build's failure themselves
        print(exc, file=sys.stderr)
