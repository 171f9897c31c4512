"""The agent's own resources on /metrics (gpu_agent.metrics.own_process), read from this process."""
from __future__ import annotations

import os
import re
from pathlib import Path

from gpu_agent.config import load_config
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.state import AgentState


def scrape(state: AgentState) -> dict[str, float]:
    text = render(make_registry(AgentCollector(state, lambda: 0, "node-1"))).decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(process_\w+) (\S+)$", text, re.MULTILINE)}


def test_memory_cpu_descriptors_and_threads_are_this_process(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("version: v1\n")
    state = AgentState(load_config(tmp_path / "config.yaml", required=True))
    before = scrape(state)
    assert set(before) == {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                           "process_threads"}
    assert before["process_resident_memory_bytes"] > 10 * 2**20 and before["process_cpu_seconds_total"] > 0
    assert before["process_threads"] >= 1
    # Other threads of a test worker (xdist's, a finished test's) open and close descriptors too: the
    # count follows these seven in one of a few tries, each measured against its own baseline.
    differences = []
    for _ in range(5):
        baseline = scrape(state)["process_open_fds"]
        opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(7)]
        try:
            differences.append(scrape(state)["process_open_fds"] - baseline)
        finally:
            for fd in opened:
                os.close(fd)
        if differences[-1] == 7:
            break
    assert differences[-1] == 7, differences
