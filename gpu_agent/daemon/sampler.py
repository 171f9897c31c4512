"""Background sampling of GPU metrics and processes, so HTTP requests never call NVML."""
from __future__ import annotations

import logging
import threading

from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml, NvmlHung, NvmlUnavailable, describe
from gpu_agent.nvml.model import GpuHealth, GpuSample
from gpu_agent.state import AgentState, GpuProcess

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, nvml: Nvml, state: AgentState, root: Root) -> None:
        self.nvml = nvml
        self.state = state
        self.root = root
        self._running = threading.Lock()

    def sample(self) -> None:
        """Read every known GPU once; runs on a worker thread. A sample already in progress wins."""
        if not self._running.acquire(blocking=False):
            return
        try:
            self._sample()
        finally:
            self._running.release()

    def _sample(self) -> None:
        inventory = self.state.inventory
        if inventory is None:
            return
        samples: dict[str, GpuSample] = {}
        processes: dict[str, tuple[GpuProcess, ...]] = {}
        try:
            for gpu in inventory.gpus:
                health = self.state.health.setdefault(gpu.uuid, GpuHealth())
                try:
                    samples[gpu.uuid] = self.nvml.sample(gpu.index)
                    processes[gpu.uuid] = tuple(
                        GpuProcess(pid, self._process_name(pid), used)
                        for pid, used in self.nvml.processes(gpu.index)
                    )
                except self.nvml.lib.NVMLError as exc:
                    if not health.query_error:
                        log.error("GPU %d: NVML query failed: %s", gpu.index, describe(exc))
                    health.query_error = f"NVML query failed: {describe(exc)}"
                else:
                    if health.query_error:
                        log.info("GPU %d answers NVML queries again", gpu.index)
                        health.query_error = ""
        except (NvmlHung, NvmlUnavailable) as exc:
            if self.state.nvml_error != str(exc):
                log.error("%s", exc)
            self.state.nvml_error = str(exc)
            return
        self.state.nvml_error = None
        self.state.samples = samples
        self.state.processes = processes

    def _process_name(self, pid: int) -> str:
        try:
            return self.root(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "?"
