"""The agent's own resources on /metrics, read from the running kernel's /proc whatever --root is: resident
memory, CPU seconds, open file descriptors and threads, under the names every Prometheus client library
gives them (process_*), so the usual dashboards and alerts find them. Read as psutil's Linux code reads
them (statm, stat, fd/ and status), without psutil: its modules hold 0.75 MiB of an idle agent's resident
set, for four numbers."""
from __future__ import annotations

import logging
import os
from typing import Iterator

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.metrics.text import Family, counter, gauge

log = logging.getLogger(__name__)

PROC = "/proc/self"  # this process's own table, never the one under --root
MAX_BYTES = 64 << 10  # statm, stat and status are under 2 KiB
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _read(name: str) -> str:
    data = read_bounded(f"{PROC}/{name}", MAX_BYTES)
    if data is None:
        raise FileNotFoundError(f"{PROC}/{name}")
    return data.decode("ascii", errors="replace")


class OwnProcessCollector:
    def collect(self) -> Iterator[Family]:
        try:
            rss = int(_read("statm").split()[1]) * _PAGE_BYTES
            stat = _read("stat")
            fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
            cpu_seconds = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
            fds = len(os.listdir(f"{PROC}/fd"))
            threads = next(int(line.split()[1]) for line in _read("status").splitlines()
                           if line.startswith("Threads:"))
        # /proc not mounted in the namespace
        except (OSError, NotRegular, TooLarge, ValueError, IndexError, StopIteration) as exc:
            log.debug("own resource metrics unavailable: %s", exc)
            return
        yield gauge("process_resident_memory_bytes", "Resident memory size in bytes.", value=rss)
        yield counter("process_cpu_seconds", "Total user and system CPU time spent in seconds.", value=cpu_seconds)
        yield gauge("process_open_fds", "Number of open file descriptors.", value=fds)
        yield gauge("process_threads", "Number of OS threads in the process.", value=threads)
