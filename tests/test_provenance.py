"""The repository holds only what this project wrote (issue 32): no other project's licence header or
copyright line, no Go source but our own test programs, no licence file but ours, and no file that repeats
a file of ../shared/upstream. Upstream's data files are read from ../shared (tests/upstream_data.py); its
test tables are our own fact tables (tests/facts/); its wire definitions are our own .proto files."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pytest
from upstream_data import READABLE

PROJECT = Path(__file__).resolve().parent.parent

# Written so that this file's own text matches none of them.
FOREIGN_NOTICES = {
    "a copyright line": re.compile(r"(?i)\bcopy[r]ight\b\s*(\(c\)|©)?\s*:?\s*(19|20)\d\d|\bcopy[r]ight\b.{0,60}"
                                   r"(nvidia|authors|inc\b|corporation|llc\b|ltd\b|foundation)"),
    "an SPDX licence tag": re.compile(r"SPDX-Licen[s]e-Identifier"),
    "the Apache licence header": re.compile(r"(?i)licen[s]ed under the apache licen[s]e|without warranties or "
                                            r"condition[s] of any kind"),
    "the MIT licence text": re.compile(r"(?i)permission is hereby grante[d], free of charge"),
    "the GPL's text": re.compile(r"(?i)gnu (lesser |affero )?general public licen[s]e"),
    "a rights reservation": re.compile(r"(?i)all rights reserve[d]"),
    "the Kubernetes authors' header": re.compile(r"The Kubernetes Author[s]"),
}
# The package's own copyright file (Debian's format), the one place a copyright line belongs.
NOTICES_ALLOWED_IN = {"packaging/copyright"}
# Go programs of our own, for the test rig: the kubelet stand-in of the device plugin tests.
OUR_GO_PROGRAMS = ("tests/kubelet_standin/",)
LICENCE_FILE = re.compile(r"(?i)^(licen[cs]e|copying|notice)([.-].*)?$")
OUR_LICENCE_FILES = {"LICENSE"}  # at the top, if the project ever has one
# A file repeating this many normalised lines of one upstream file (and that share of its lines) is a copy.
COPIED_LINES, COPIED_SHARE, LONG_LINE = 8, 0.3, 24


@dataclass(frozen=True)
class Finding:
    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


def foreign_notices(path: str, text: str) -> list[Finding]:
    if path in NOTICES_ALLOWED_IN:
        return []
    found = []
    for what, pattern in FOREIGN_NOTICES.items():
        match = pattern.search(text)
        if match:
            line = text.count("\n", 0, match.start()) + 1
            found.append(Finding(path, f"line {line} holds {what} ({match.group(0)[:60]!r}): another "
                                       "project's file, or text copied from one"))
    return found


def foreign_files(path: str) -> list[Finding]:
    name = path.rsplit("/", 1)[-1]
    if path.endswith(".go") and not path.startswith(OUR_GO_PROGRAMS):
        return [Finding(path, "Go source outside our own test programs "
                              f"({', '.join(OUR_GO_PROGRAMS)}): upstream's code is never copied; "
                              "re-express its test table as our own facts (tests/facts/)")]
    if LICENCE_FILE.match(name) and path not in OUR_LICENCE_FILES:
        return [Finding(path, "a licence file other than ours: it came with a copied file")]
    return []


def _long_lines(text: str) -> set[str]:
    return {line for line in (" ".join(raw.split()) for raw in text.splitlines()) if len(line) >= LONG_LINE}


def copies_of(path: str, text: str, upstream: dict[str, set[str]]) -> list[Finding]:
    ours = _long_lines(text)
    found = []
    for name, lines in upstream.items():
        common = len(ours & lines)
        if lines and common >= COPIED_LINES and common >= COPIED_SHARE * len(lines):
            found.append(Finding(path, f"repeats {common} of the {len(lines)} lines of ../shared/{name}: "
                                       "read it from there (tests/upstream_data.py) instead"))
    return found


def check(files: Iterable[tuple[str, str]], upstream: dict[str, set[str]]) -> list[Finding]:
    found: list[Finding] = []
    for path, text in files:
        found += foreign_files(path) + foreign_notices(path, text) + copies_of(path, text, upstream)
    return found


def repository_files() -> list[tuple[str, str]]:
    """Every file git would commit here (tracked, and new ones not ignored), with its text."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=PROJECT,
                            capture_output=True, timeout=60, check=True).stdout.decode().split("\0")
    files = []
    for path in filter(None, listed):
        try:
            files.append((path, (PROJECT / path).read_bytes().decode("utf-8", "replace")))
        except (FileNotFoundError, IsADirectoryError):
            continue  # deleted in the work tree and not yet committed, or a submodule
    return files


def upstream_lines() -> dict[str, set[str]]:
    """The long lines of each file in ../shared/upstream and ../shared/schemas (none where it is absent)."""
    lines = {}
    for folder in READABLE:
        if folder.is_dir():
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path.name != "README.md":
                    lines[str(path.relative_to(folder.parent))] = _long_lines(path.read_text(errors="replace"))
    return lines


@pytest.mark.subprocess
def test_the_repository_holds_only_what_we_wrote() -> None:
    files = repository_files()
    assert len(files) > 300 and any(path == "gpu_agent/__init__.py" for path, _ in files)
    findings = check(files, upstream_lines())
    assert not findings, "files that look copied from another project:\n" + "\n".join(map(str, findings))


def test_a_planted_copy_is_found() -> None:
    """Each kind of copy the guard knows, planted among files of our own; none of ours is flagged."""
    upstream = {"upstream/mig-parted/examples/config.yaml": {f"an upstream example line number {n}" for n in range(12)}}
    header = "// Copy" + "right (c) 2021, NVIDIA CORPORATION.  All rights " + "reserved.\n"
    planted = [
        ("gpu_agent/ours.py", '"""Our module: upstream is Apache-2.0, and a fact is copyright-free."""\n'),
        (*NOTICES_ALLOWED_IN, "Copy" + "right: 2026 the gpu-agent authors\n"),
        ("tests/kubelet_standin/main.go", "package main\n"),
        ("tests/data/upstream/pciutil.go", "package vgpu\n"),
        ("tests/data/schemas/cdi/LICENSE", "Apache License\n"),
        ("tests/kubelet_api/api.proto", "/*\n" + "Copy" + "right 2018 The Kubernetes " + "Authors.\n*/\n"),
        ("gpu_agent/port.py", "# " + "Licensed under the Apache " + "License, Version 2.0\n"),
        ("gpu_agent/header.py", header),
        ("gpu_agent/spdx.py", "# SPDX-" + "License-Identifier: Apache-2.0\n"),
        ("tests/data/config.yaml", "\n".join(f"  an upstream example line number {n}" for n in range(10))),
    ]
    found = check(planted, upstream)
    assert sorted({f.path for f in found}) == [
        "gpu_agent/header.py", "gpu_agent/port.py", "gpu_agent/spdx.py", "tests/data/config.yaml",
        "tests/data/schemas/cdi/LICENSE", "tests/data/upstream/pciutil.go", "tests/kubelet_api/api.proto"]
    assert any("line 1 holds a copyright line" in str(f) for f in found if f.path == "gpu_agent/header.py")
    assert any("repeats 10 of the 12 lines of ../shared/upstream/mig-parted/examples/config.yaml" in str(f)
               for f in found)
