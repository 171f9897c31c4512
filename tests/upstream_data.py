"""Upstream's data files, read where they are kept: ../shared beside the clone, never the repository (issue 32).

../shared/upstream/<repository>/<path> holds the files of the projects the agent must agree with, at the
commits its README names; ../shared/schemas/ holds the CDI JSON schema. A clone with nothing beside it
has neither: the tests that need them skip, each naming the file it lacks. CI always has ../shared, so
there a missing file fails the test instead of skipping it quietly.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
# The only folders of ../shared a test may read (tests/conftest.py's guard): never write, never hardware/.
READABLE = (SHARED / "upstream", SHARED / "schemas")


def _needed(path: Path) -> Path:
    if path.is_file():
        return path
    where = path.relative_to(SHARED.parent)
    reason = (f"needs upstream's data file ../{where}, which is kept beside the clone, not in it "
              "(a README there names the commit it is from)")
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must have ../shared", pytrace=False)
    pytest.skip(reason)


def upstream_file(repository: str, path: str) -> Path:
    """../shared/upstream/<repository>/<path>, or the calling test skips (fails in CI) saying which file."""
    return _needed(SHARED / "upstream" / repository / path)


def schema_file(path: str) -> Path:
    """../shared/schemas/<path>, or the calling test skips (fails in CI) saying which file."""
    return _needed(SHARED / "schemas" / path)


def have_upstream_file(repository: str, path: str) -> bool:
    """For collection time, where a test's cases are read from the file: whether it is there to read."""
    return (SHARED / "upstream" / repository / path).is_file()
