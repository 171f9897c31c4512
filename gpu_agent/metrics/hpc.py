"""The hpc_job label (metrics.hpc_job_mapping_dir), as dcgm-exporter's --hpc-job-mapping-dir (its
internal/pkg/transformation/hpc.go at 691c927): a directory whose files are named by GPU index (`0`) or
by GPU index and GPU instance id (`3.0`), each listing the ids of the jobs on it, one a line. A series
of a GPU (or GPU instance) with jobs is written once per job, with hpc_job; a GPU without a file, or
with an empty one, keeps its series as they were. Other names, and directories, are not mapping files.

Read on the sampler's cadence, never on a scrape, each file through the bounded reader: at most
MAX_FILES files of MAX_FILE_BYTES each. A directory that is missing or unreadable is a reason in
/status, not an error of /metrics."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpu_agent.host.bounded import Unreadable, read_text

MAX_FILES = 4096  # more than GPUs x GPU instances on any node
MAX_FILE_BYTES = 64 << 10
MAX_JOBS = 256  # per file: one GPU is not shared by more jobs than this
# <gpu> or <gpu>.<gpu instance>, ASCII digits only (Go's \d is ASCII; Python's matches other digits too)
MAPPING_FILE = re.compile(r"[0-9]+(\.[0-9]+)?")


@dataclass(frozen=True)
class HpcJobs:
    """Replaced, never changed: the jobs by file name (`0`, `3.0`), or why the directory was not read."""

    jobs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    error: Optional[str] = None

    def of(self, gpu_index: int, gpu_instance: Optional[int] = None) -> tuple[str, ...]:
        key = str(gpu_index) if gpu_instance is None else f"{gpu_index}.{gpu_instance}"
        return self.jobs.get(key, ())

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "jobs": {name: list(jobs) for name, jobs in sorted(self.jobs.items())}}


def read_jobs(directory: Path, shown: str) -> HpcJobs:
    """The mapping directory's jobs; `shown` is its host path, for messages."""
    try:
        with os.scandir(directory) as entries:
            names: list[str] = []
            for entry in entries:
                if len(names) >= MAX_FILES:
                    return HpcJobs({}, f"{shown} holds more than {MAX_FILES} entries; not read")
                if MAPPING_FILE.fullmatch(entry.name) and not entry.is_dir():
                    names.append(entry.name)
    except FileNotFoundError:
        return HpcJobs({}, f"no directory {shown}")
    except OSError as exc:
        return HpcJobs({}, f"cannot read {shown}: {exc.strerror or exc}")
    jobs: dict[str, tuple[str, ...]] = {}
    problems = []
    for name in sorted(names):
        try:
            content = read_text(directory / name, f"{shown}/{name}", MAX_FILE_BYTES, errors="replace")
        except Unreadable as exc:
            problems.append(str(exc))
            continue
        if content is None:  # gone since it was listed
            continue
        lines = content.split("\n")
        if lines and lines[-1] == "":  # the last line's newline ends it, as a line scanner reads it
            lines.pop()
        jobs[name] = tuple(line.rstrip("\r") for line in lines[:MAX_JOBS])
    return HpcJobs(jobs, "; ".join(problems) or None)
