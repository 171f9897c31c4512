"""Background sampling of GPU metrics and processes, so HTTP requests never call NVML."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from gpu_agent.host.paths import Root
from gpu_agent.host.processes import named
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlHung, NvmlUnavailable, describe, short_bus_id
from gpu_agent.health.policy import cleared
from gpu_agent.metrics.extras import ExporterReadings
from gpu_agent.metrics.gpm import Profiling
from gpu_agent.nvml.model import Gpu, GpuSample
from gpu_agent.state import AgentState, GpuProcess

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, nvml: Nvml, state: AgentState, root: Root,
                 leaving: Callable[[], frozenset[str]] = frozenset) -> None:
        self.nvml = nvml
        self.state = state
        self.root = root
        self.leaving = leaving  # PCI addresses of GPUs passed through to VMs or given back now: not read
        self._running = threading.Lock()
        self._misplaced: set[str] = set()  # lost GPUs found answering at another bus id, already logged
        self._nvlink: dict[str, tuple[float, float]] = {}  # by GPU UUID: the last NVLink counter (KiB) and when
        self.profiling = Profiling(nvml)
        self.extras = ExporterReadings(nvml, root)

    def sample(self) -> None:
        """Read every known GPU once; runs on a worker thread. A sample already in progress wins."""
        if not self._running.acquire(blocking=False):
            return
        try:
            self._sample()
        finally:
            self._running.release()

    def _sample(self) -> None:
        # Every GPU discovery found, those NVML could not read too (so a lost GPU is seen gone, and back,
        # between two passes); while discovery fails, the GPUs it last found.
        inventory = self.state.inventory or self.state.last_inventory
        if inventory is None:
            return
        # A GPU the vfio stage moves to vfio-pci leaves NVML before the pass's discovery drops it: not a GPU
        # that stopped answering (no query error, no unhealthy transition), and its series go.
        leaving = self.leaving()
        if leaving:
            inventory = replace(inventory, gpus=tuple(
                gpu for gpu in inventory.gpus if short_bus_id(gpu.pci_bus_id) not in leaving))
        samples: dict[str, GpuSample] = {}
        processes: dict[str, tuple[GpuProcess, ...]] = {}
        try:
            # One trip to an NVML worker for every GPU's queries (hundreds with GPM and MIG): a trip per
            # GPU woke two threads, and handed the GIL between them, eight times a sample.
            results = self.nvml.session.batch("nvmlDeviceGet*(every GPU)", self._read_every, inventory.gpus)
            for gpu, result in zip(inventory.gpus, results):
                if isinstance(result, BaseException) and short_bus_id(gpu.pci_bus_id) in self.leaving():
                    continue  # the vfio stage began moving it while the batch ran: it left, it did not fail
                try:
                    if isinstance(result, BaseException):
                        raise result
                    samples[gpu.uuid], processes[gpu.uuid] = result
                    self._back_on_the_bus(gpu)
                except self.nvml.lib.NVMLError as exc:
                    self._query_error(gpu.index, gpu.uuid, f"NVML query failed: {describe(exc)}")
                    self._gone(gpu.uuid)
                else:
                    self._query_error(gpu.index, gpu.uuid, "")
        except (NvmlHung, NvmlUnavailable) as exc:
            if self.state.nvml_error != str(exc):
                log.error("%s", exc)
            self.state.publish_nvml_error(str(exc))
            return
        self.profiling.keep_only(samples)
        now = time.time()
        settings = self.state.config.config.metrics
        if settings.virtual_gpus:
            processes = self.extras.with_pods(processes)
        self.state.publish_samples(samples, processes, now)
        self.state.publish_exporter_readings(*self.extras.read(settings, inventory.gpus, samples, now))

    def _read_every(self, gpus: tuple[Gpu, ...]) -> list[Any]:
        """On the NVML worker: each GPU's reading, or the NVMLError it answered (the others go on)."""
        results: list[Any] = []
        for gpu in gpus:
            try:
                results.append(self._read(gpu))
            except self.nvml.lib.NVMLError as exc:
                results.append(exc)
        return results

    def _read(self, gpu: Gpu) -> tuple[GpuSample, tuple[GpuProcess, ...]]:
        sample = self.profiling.add_to(self._nvlink_rate(gpu.uuid, self.nvml.sampling.sample(gpu.index, gpu.mig)), gpu)
        used = self.nvml.inventory.process_details(gpu.index, self.state.config.config.metrics.virtual_gpus)
        names = named(self.root, [pid for pid, *_ in used])
        return sample, tuple(GpuProcess(pid, process.name or "?", mib, sm, gpu_instance_id=gi)
                             for (pid, mib, gi, sm), process in zip(used, names))

    def _nvlink_rate(self, uuid: str, sample: GpuSample) -> GpuSample:
        """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL as DCGM works it out: the NVLink data counter's growth since
        the last sample, per second, divided by 1000. The first sample has none (never a made-up 0)."""
        now = time.monotonic()
        before = self._nvlink.pop(uuid, None)
        if sample.nvlink_data_kib is None:
            return sample
        self._nvlink[uuid] = (sample.nvlink_data_kib, now)
        if before is None or now <= before[1] or sample.nvlink_data_kib < before[0]:
            return sample  # first reading, or the counter restarted (driver reload)
        rate = (sample.nvlink_data_kib - before[0]) / (now - before[1]) / 1000.0
        return replace(sample, nvlink_bandwidth_total=float(int(rate)))

    def _query_error(self, index: int, uuid: str, error: str) -> None:
        """Publish whether the GPU answers NVML queries; log only when that changes."""
        before = self.state.health.get(uuid)
        if (before.query_error if before else "") == error:
            return
        self.state.update_health(uuid, lambda health: replace(health, query_error=error))
        if error:
            log.error("GPU %d: %s", index, error)
        else:
            log.info("GPU %d answers NVML queries again", index)

    def _gone(self, uuid: str) -> None:
        """A lost GPU (XID 79) NVML no longer answers for: once it answers again, it is back."""
        health = self.state.health.get(uuid)
        if health is not None and health.lost and not health.missing:
            self.state.update_health(uuid, lambda h: replace(h, missing=h.lost))

    def _back_on_the_bus(self, gpu: Gpu) -> None:
        """A lost GPU that NVML stopped answering for and now answers for again at the same PCI bus id is
        healthy again (a reset brought it back); at another bus id it is some other GPU, and stays lost."""
        health = self.state.health.get(gpu.uuid)
        if health is None or not (health.lost and health.missing):
            return
        found = self.nvml.inventory.bus_id(gpu.index)  # that GPU's alone: another may still be off the bus
        if found != gpu.pci_bus_id:
            if gpu.uuid not in self._misplaced:  # said once, not at every sample
                self._misplaced.add(gpu.uuid)
                log.warning("%s answers NVML again but at %s, not %s; it stays unhealthy",
                            self.state.gpu_name(gpu.uuid), found or "no bus id", gpu.pci_bus_id)
            return
        self._misplaced.discard(gpu.uuid)
        self.state.update_health(gpu.uuid, lambda h: cleared(h) if h.lost and h.missing else h)
        log.info("%s is back on the bus at %s; healthy again as far as XIDs go",
                 self.state.gpu_name(gpu.uuid), gpu.pci_bus_id)
