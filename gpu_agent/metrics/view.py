"""One rendering of the DCGM series: the settings, names and attributions in force while it is written,
and how one value becomes its series lines: once per pod holding the GPU (metrics.pod_labels), once per
HPC job on it (metrics.hpc_job_mapping_dir), in that order, as dcgm-exporter applies its pod mapper
before its HPC mapper (internal/pkg/transformation/transformer.go at 691c927).

With metrics.virtual_gpus, as dcgm-exporter's KUBERNETES_VIRTUAL_GPUS: every holder of a shared GPU is
a series (a vgpu label names its replica), and DCGM_FI_DEV_GPU_UTIL and DCGM_FI_DEV_FB_USED are the
GPU's own series without pod labels, and beside it one per holder whose value is its pod's processes'
share (their SM utilisation, their memory in MiB, each process' floored), with pod_uid always: 0 for a
pod with no process there (kubernetes.go's createPerProcessMetrics, process_metrics.go). A difference:
a holder whose pod's UID the API did not give has no per-process series (dcgm-exporter writes it as 0
with an empty pod_uid), since which processes are its cannot be told.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Optional

from gpu_agent.metrics import series
from gpu_agent.metrics.dcgm import dcgm_bus_id
from gpu_agent.metrics.pod_metadata import kept_labels
from gpu_agent.metrics.pods import Holder
from gpu_agent.nvml.model import Gpu
from gpu_agent.state import AgentState, GpuProcess

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
PER_PROCESS = (GPU_UTIL, FB_USED)  # dcgm-exporter's isPerProcessMetric


class SeriesView:
    def __init__(self, state: AgentState, hostname: str) -> None:
        self.state = state
        self.settings = state.config.config.metrics
        self.names = series.naming(self.settings.legacy_label_names, self.settings.hostname_label)
        self.hostname = hostname
        inventory = state.inventory
        self.driver = inventory.driver_version if inventory else ""
        self.pods = state.pods
        self.hpc = state.hpc_jobs
        self._pod_labels: dict[tuple[str, str], dict[str, str]] = {}

    def fixed(self, gpu: Gpu, profile: Optional[str] = None,
              gpu_instance: Optional[int] = None) -> list[tuple[str, str]]:
        """A GPU's (or GPU instance's) own labels, in dcgm-exporter's order."""
        pairs = [("gpu", str(gpu.index)), (self.names.uuid, gpu.uuid), ("pci_bus_id", dcgm_bus_id(gpu.pci_bus_id)),
                 ("device", f"nvidia{gpu.index}"), ("modelName", gpu.product)]
        if profile is not None:
            pairs += [("GPU_I_PROFILE", profile), ("GPU_I_ID", str(gpu_instance))]
        if self.names.host is not None:
            pairs.append((self.names.host, self.hostname))
        return pairs

    def expanded(self, name: str, fixed: Sequence[tuple[str, str]], gpu: Gpu, gpu_instance: Optional[int],
                 labels: Mapping[str, str], attributes: Mapping[str, str], value: float,
                 per_process: Optional[str]) -> Iterator[str]:
        """The series lines of one value: `labels` and `attributes` beside the driver version label."""
        labels = {"DCGM_FI_DRIVER_VERSION": self.driver, **labels}
        jobs = self.hpc.of(gpu.index, gpu_instance) if self.hpc is not None else ()
        for pod_labels, pod_attributes, pod_value in self._by_pod(fixed, gpu, gpu_instance, labels, attributes,
                                                                  value, per_process):
            if not jobs:
                yield series.line(name, fixed, pod_labels, pod_attributes, pod_value)
            for job in jobs:
                yield series.line(name, fixed, pod_labels, {**pod_attributes, "hpc_job": job}, pod_value)

    def _by_pod(self, fixed: Sequence[tuple[str, str]], gpu: Gpu, gpu_instance: Optional[int],
                labels: dict[str, str], attributes: Mapping[str, str], value: float,
                per_process: Optional[str]) -> Iterator[tuple[dict[str, str], dict[str, str], float]]:
        holders = self.pods.of(gpu.uuid, gpu_instance) if self.pods is not None else ()
        if not holders:
            yield labels, dict(attributes), value
            return
        settings = self.settings
        if settings.virtual_gpus:
            if per_process:
                yield labels, dict(attributes), value  # the GPU's own, beside its pods' shares
                shares = self._shares(gpu.uuid, gpu_instance, per_process)
                for holder in holders:
                    uid = self._uid(holder)
                    if uid:
                        yield labels, {**attributes, **self._names_of(holder), "pod_uid": uid,
                                       **self._vgpu(holder)}, shares.get(uid, 0)
                return
            for holder in holders:
                yield labels, {**attributes, **self._names_of(holder), **self._uid_label(holder),
                               **self._vgpu(holder)}, value
            return
        seen: set[tuple[str, str, str]] = set()
        for holder in holders:  # one series per container, whichever replicas it holds
            if (holder.namespace, holder.pod, holder.container) in seen:
                continue
            seen.add((holder.namespace, holder.pod, holder.container))
            own = {**attributes, **self._names_of(holder), **self._uid_label(holder)}
            taken = {key for key, _ in fixed} | set(own)
            extra = {key: text for key, text in self._kube_labels(holder).items() if key not in taken}
            yield {**labels, **extra}, own, value

    def _names_of(self, holder: Holder) -> dict[str, str]:
        return {self.names.pod: holder.pod, self.names.namespace: holder.namespace,
                self.names.container: holder.container, **holder.dra_labels}

    def _uid(self, holder: Holder) -> str:
        meta = self.pods.meta(holder) if self.pods is not None else None
        return meta.uid if meta is not None else ""

    def _uid_label(self, holder: Holder) -> dict[str, str]:
        """pod_uid with metrics.pod_uid; empty where the API did not give it, as dcgm-exporter writes it."""
        return {"pod_uid": self._uid(holder)} if self.settings.pod_uid else {}

    @staticmethod
    def _vgpu(holder: Holder) -> dict[str, str]:
        return {"vgpu": holder.replica} if holder.replica else {}

    def _kube_labels(self, holder: Holder) -> dict[str, str]:
        if not self.settings.pod_kubernetes_labels or self.pods is None:
            return {}
        key = (holder.namespace, holder.pod)
        if key not in self._pod_labels:
            meta = self.pods.meta(holder)
            self._pod_labels[key] = kept_labels(meta.labels, self.settings.pod_label_allowlist_regex) if meta else {}
        return self._pod_labels[key]

    def _shares(self, uuid: str, gpu_instance: Optional[int], counter: str) -> dict[str, float]:
        """By pod UID: the sum of its processes' SM utilisation or memory (MiB, each floored) on the GPU or
        GPU instance."""
        shares: dict[str, float] = {}
        for process in self.state.processes.get(uuid, ()):
            if not process.pod_uid or process.gpu_instance_id != gpu_instance:
                continue
            part = _share(process, counter)
            if part is not None:
                shares[process.pod_uid] = shares.get(process.pod_uid, 0) + part
        return shares


def _share(process: GpuProcess, counter: str) -> Optional[int]:
    if counter == GPU_UTIL:
        return process.sm_util
    return int(process.used_mib)
