"""Test tools built once per machine, not once per xdist worker and run: a build lives in a directory of
the temp dir named by a digest of everything it is made from, and a lock lets one worker build while
the others wait for its result."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

CACHE = Path(tempfile.gettempdir()) / f"gpu-agent-test-builds-{os.getuid()}"


# Installing or upgrading any Debian package (Go's own, or the Go sources under /usr/share/gocode that
# a build compiles) rewrites this file: a build made before is not trusted after.
PACKAGES = Path("/var/lib/dpkg/status")


def _stat(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:absent"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _digest(inputs: Iterable[Path], tools: Iterable[str]) -> str:
    """Every input file's name and bytes, each tool's resolved path, size and mtime, and the package database's.
    Not where the clone is: a clone elsewhere of the same sources uses the same build."""
    digest = hashlib.sha256()
    for path in inputs:
        digest.update("/".join(path.parts[-2:]).encode() + b"\0" + path.read_bytes() + b"\0")
    for tool in tools:
        found = shutil.which(tool)
        digest.update(f"{tool}={_stat(os.path.realpath(found)) if found else 'absent'}\0".encode())
    digest.update(_stat(str(PACKAGES)).encode())
    return digest.hexdigest()[:16]


def cached_build(name: str, inputs: Iterable[Path], tools: Iterable[str],
                 build: Callable[[Path, Path], None]) -> Path:
    """The file `name` that `build(output, work_dir)` makes from `inputs` with `tools`, built at most once
    per distinct input; `build` raises (an assertion with the build's output) when it fails, and a failed
    build leaves nothing behind, so the next run builds again."""
    directory = CACHE / f"{name}-{_digest(inputs, tools)}"
    binary = directory / name
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not binary.is_file():
                work = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
                try:
                    build(work / name, work)
                    os.replace(work / name, binary)  # whole or absent: a killed build leaves no binary
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return binary
