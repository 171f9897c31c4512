"""What the sampler reads, beside the GPUs' metrics, for dcgm-exporter's own series, the hpc_job label
and the per-process series of metrics.virtual_gpus; each only while a setting asks for it.

- the clock event reasons of the samples within metrics.clock_events_count_window_seconds (the reasons
  come with each sample; this keeps their history);
- NVML's NVLink P2P status of every pair of GPUs, read once per set of GPUs (it changes with the
  hardware only);
- the HPC job mapping directory, read at every sample (metrics/hpc.py);
- the pod each GPU process runs in: the pod UID in its /proc/PID/cgroup (as dcgm-exporter's
  pidmapper.go at 691c927 finds it: `pod` then at least 32 of [a-f0-9_-], `_` read as `-`), kept per
  PID while the process runs.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Optional

from gpu_agent.config.schema import MetricsConfig
from gpu_agent.host.bounded import Unreadable, read_text
from gpu_agent.host.paths import Root
from gpu_agent.metrics import exp
from gpu_agent.metrics.hpc import HpcJobs, read_jobs
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Gpu, GpuSample
from gpu_agent.nvml.session import NvmlHung, NvmlUnavailable
from gpu_agent.state import GpuProcess

log = logging.getLogger(__name__)

POD_UID = re.compile(r"pod([a-f0-9_-]+)")
MIN_UID_CHARS = 32
MAX_CGROUP_BYTES = 64 << 10


def pod_uid_of(cgroup: str) -> str:
    """The pod UID in a /proc/PID/cgroup's paths, or "" outside any pod."""
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        found = POD_UID.search(path)
        if found:
            uid = found.group(1).replace("_", "-")
            if len(uid) >= MIN_UID_CHARS:
                return uid
    return ""


class ExporterReadings:
    def __init__(self, nvml: Nvml, root: Root) -> None:
        self.nvml = nvml
        self.root = root
        self._clock: dict[str, tuple[tuple[float, int], ...]] = {}
        self._p2p: Optional[tuple[tuple[str, ...], dict[str, tuple[tuple[int, int], ...]]]] = None
        self._pods: dict[int, str] = {}  # pod UID by PID, of the processes running at the last sample

    def read(self, settings: MetricsConfig, gpus: tuple[Gpu, ...], samples: Mapping[str, GpuSample], now: float
             ) -> tuple[dict[str, tuple[tuple[float, int], ...]], dict[str, tuple[tuple[int, int], ...]],
                        Optional[HpcJobs]]:
        """(clock event history, P2P status, HPC jobs) as the settings ask for them."""
        wanted = set(settings.exporter_series)
        clock: dict[str, tuple[tuple[float, int], ...]] = {}
        if exp.CLOCK_EVENTS_COUNT in wanted:
            since = now - settings.clock_events_count_window_seconds
            for uuid, sample in samples.items():
                kept = tuple(entry for entry in self._clock.get(uuid, ()) if entry[0] >= since)[-exp.MAX_HISTORY + 1:]
                if sample.clock_event_reasons is not None:
                    kept += ((now, sample.clock_event_reasons),)
                clock[uuid] = kept
        self._clock = clock
        p2p = self._p2p_status(gpus) if exp.P2P_STATUS in wanted else {}
        directory = settings.hpc_job_mapping_dir
        jobs = read_jobs(self.root(directory), directory) if directory else None
        return clock, p2p, jobs

    def _p2p_status(self, gpus: tuple[Gpu, ...]) -> dict[str, tuple[tuple[int, int], ...]]:
        key = tuple(gpu.uuid for gpu in gpus if not gpu.unreadable)
        if self._p2p is None or self._p2p[0] != key:
            try:
                status = self.nvml.session.batch("nvmlDeviceGetP2PStatus(every pair)", self.nvml.inventory.p2p_status,
                                                 gpus)
            except (NvmlHung, NvmlUnavailable, self.nvml.lib.NVMLError) as exc:
                log.warning("DCGM_EXP_P2P_STATUS left out: %s", exc)
                return {}
            self._p2p = (key, status)
        return self._p2p[1]

    def with_pods(self, processes: Mapping[str, tuple[GpuProcess, ...]]) -> dict[str, tuple[GpuProcess, ...]]:
        """The processes, each with the UID of the pod it runs in (read once per PID)."""
        running = {process.pid for found in processes.values() for process in found}
        self._pods = {pid: uid for pid, uid in self._pods.items() if pid in running}
        return {uuid: tuple(replace(process, pod_uid=self._pod_of(process.pid)) for process in found)
                for uuid, found in processes.items()}

    def _pod_of(self, pid: int) -> str:
        if pid not in self._pods:
            shown = f"/proc/{pid}/cgroup"
            try:
                text = read_text(self.root(shown), shown, MAX_CGROUP_BYTES, errors="replace")
            except Unreadable as exc:
                log.debug("%s", exc)
                return ""  # asked again at the next sample
            self._pods[pid] = pod_uid_of(text or "")
        return self._pods[pid]
