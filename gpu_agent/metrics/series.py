"""How one DCGM series' labels are put together, in the order dcgm-exporter 4.5.3-4.8.2 writes them
(internal/pkg/rendermetrics/render_metrics.go at 691c927): the GPU's own labels in a fixed order
(gpu, UUID, pci_bus_id, device, modelName, then GPU_I_PROFILE and GPU_I_ID on a GPU instance, then the
host's name), then what it calls labels, sorted by name (DCGM_FI_DRIVER_VERSION, a pod's Kubernetes
labels, a DCGM_EXP_* series' own), then what it calls attributes, sorted by name (pod, namespace,
container, pod_uid, vgpu, hpc_job, err_code, err_msg).

The names themselves follow metrics.legacy_label_names (uuid, pod_name, pod_namespace, container_name)
and metrics.hostname_label (Hostname, hostname or none)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from gpu_agent.metrics import text


@dataclass(frozen=True)
class Naming:
    uuid: str  # UUID, or uuid with legacy names
    host: Optional[str]  # Hostname, hostname, or None: no host label
    container: str
    namespace: str
    pod: str


CURRENT = Naming("UUID", "Hostname", "container", "namespace", "pod")


def naming(legacy: bool, hostname_label: str) -> Naming:
    host = None if hostname_label == "none" else hostname_label
    if legacy:
        return Naming("uuid", host, "container_name", "pod_namespace", "pod_name")
    return Naming("UUID", host, "container", "namespace", "pod")


def line(name: str, fixed: Sequence[tuple[str, str]], labels: Mapping[str, str], attributes: Mapping[str, str],
         value: float) -> str:
    """One sample line: the fixed labels in their order, then `labels` and `attributes`, each sorted."""
    pairs = [*fixed, *sorted(labels.items()), *sorted(attributes.items())]
    return text.sample(name, [key for key, _ in pairs], [given for _, given in pairs], value)
