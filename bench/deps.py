"""What each runtime dependency costs: install size (its files in site-packages) and the resident memory
its import adds to a fresh interpreter. Prints a Markdown table for packaging/README.md.

    .venv/bin/python bench/deps.py
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

# (distribution, what the daemon imports of it)
DEPENDENCIES = [
    ("nvidia-ml-py", "pynvml"),
    ("pydantic", "pydantic"),
    ("pydantic-core", "pydantic_core"),
    ("psutil", "psutil"),
    ("sdnotify", "sdnotify"),
    ("h11", "h11"),
    ("PyYAML", "yaml"),
    ("tomlkit", "tomlkit"),
    ("grpclib", "grpclib.server"),  # with h2, hpack, hyperframe, multidict; only when the device plugin is on
]

RSS = "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"


def install_kib(distribution: str) -> int:
    files = importlib.metadata.distribution(distribution).files or []
    return sum(Path(str(f.locate())).stat().st_size for f in files if Path(str(f.locate())).is_file()) // 1024


def rss_kib(module: str) -> int:
    code = f"import {module}; {RSS}" if module else RSS
    return int(subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip())


def main() -> None:
    baseline = min(rss_kib("") for _ in range(3))
    print(f"Python {sys.version.split()[0]}, bare interpreter {baseline / 1024:.1f} MiB RSS\n")
    print("| dependency | version | install size | RSS added by importing it alone |")
    print("|---|---|---|---|")
    for distribution, module in DEPENDENCIES:
        version = importlib.metadata.version(distribution)
        added = min(rss_kib(module) for _ in range(3)) - baseline
        print(f"| {distribution} | {version} | {install_kib(distribution) / 1024:.1f} MiB | "
              f"{'(with pydantic)' if distribution == 'pydantic-core' else f'{added / 1024:.1f} MiB'} |")


if __name__ == "__main__":
    main()
