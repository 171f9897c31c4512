"""The agent's own resources on /metrics, read with psutil from the running kernel's /proc whatever
--root is: resident memory, CPU seconds, open file descriptors and threads, under the names every
Prometheus client library gives them (process_*), so the usual dashboards and alerts find them."""
from __future__ import annotations

import logging
from typing import Iterator

import psutil

from gpu_agent.host import processes
from gpu_agent.metrics.text import Family, counter, gauge

log = logging.getLogger(__name__)

PROC = "/proc"  # this process's own table, never the one under --root


class OwnProcessCollector:
    def __init__(self) -> None:
        with processes.procfs(PROC):
            self._process = psutil.Process()

    def collect(self) -> Iterator[Family]:
        try:
            with processes.procfs(PROC), self._process.oneshot():
                rss = self._process.memory_info().rss
                times = self._process.cpu_times()
                fds = self._process.num_fds()
                threads = self._process.num_threads()
        except (psutil.Error, OSError) as exc:  # /proc not mounted in the agent's namespace
            log.debug("own resource metrics unavailable: %s", exc)
            return
        yield gauge("process_resident_memory_bytes", "Resident memory size in bytes.", value=rss)
        yield counter("process_cpu_seconds", "Total user and system CPU time spent in seconds.",
                      value=times.user + times.system)
        yield gauge("process_open_fds", "Number of open file descriptors.", value=fds)
        yield gauge("process_threads", "Number of OS threads in the process.", value=threads)
