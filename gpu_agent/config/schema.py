"""Schema of /etc/gpu-agent/config.yaml, version v1. Unknown keys are errors, never ignored.

The sections are frozen dataclasses (config/section.py): the types the agent runs with, built by
pydantic (config/loader.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union


from gpu_agent.config.driver import DriverConfig
from gpu_agent.config.endpoint import (DEFAULT_LISTEN, DEFAULT_SOCKET, LISTEN_MAX, SOCKET_DIRECTORIES, Endpoint,
                                       valid_listen, valid_socket)
from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.mig import MigConfig
from gpu_agent.config.plugin import DraConfig, PluginConfig
from gpu_agent.config.section import (PATH_MAX, AbsolutePath, AllOr, Bounds, Check, Section, absolute_path, seconds,
                                      setting, shown)
from gpu_agent.config.toolkit import ToolkitConfig
from gpu_agent.config.workload import WorkloadConfig

MAX_GPUS = 1024  # more than any node has: catches a typo, not a machine
EXPORTER_SERIES = ("DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_CLOCK_EVENTS_COUNT", "DCGM_EXP_GPU_HEALTH_STATUS",
                   "DCGM_EXP_P2P_STATUS")
ExporterSeries = Literal["DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_CLOCK_EVENTS_COUNT", "DCGM_EXP_GPU_HEALTH_STATUS",
                         "DCGM_EXP_P2P_STATUS"]


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{shown(value)} is not a regular expression: {exc}") from None
    return value


def _one_or_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


Regex = Annotated[str, Bounds(max_length=1024), Check(_regex)]
RegexList = Annotated[list[Regex], Bounds(max_length=64), Check(_one_or_list, before=True)]


@dataclass(frozen=True)
class ReconcileConfig(Section):
    interval_seconds: float = seconds(60, 86400, "Re-reconcile every stage this often.")
    backoff_initial_seconds: float = seconds(5, 3600, "First retry delay of a failing stage.")
    backoff_max_seconds: float = seconds(300, 86400, "Retry delay cap of a failing stage.")


def _host_port(value: str) -> str:
    if not valid_listen(value):
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9445 or [::1]:9445 (an IPv6 address in brackets), "
                         f"got {shown(value)}")
    return value


def _socket_path(value: str) -> str:
    if value and not valid_socket(absolute_path(value)):
        raise ValueError(f"the socket must be under {' or '.join(d.rstrip('/') for d in SOCKET_DIRECTORIES)} (a "
                         f"runtime directory), without '..': {shown(value)} could stand where a file of the system is")
    return value


@dataclass(frozen=True)
class HttpConfig(Section):
    listen: Annotated[str, Check(_host_port)] = setting(
        DEFAULT_LISTEN, 'TCP address of the read-only endpoint, HOST:PORT; "" turns TCP off.', max_length=LISTEN_MAX)
    socket: Annotated[str, Check(_socket_path)] = setting(
        DEFAULT_SOCKET, 'Unix socket of the same endpoint (under --root); "" turns it off.', max_length=PATH_MAX)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.listen, self.socket)

    @property
    def host(self) -> str:
        return self.endpoint.host

    @property
    def port(self) -> int:
        return self.endpoint.port


@dataclass(frozen=True)
class NvmlConfig(Section):
    call_timeout_seconds: float = seconds(
        5, 300, "An NVML call that takes longer is abandoned and the driver reported hung.")


@dataclass(frozen=True)
class MetricsConfig(Section):
    sample_interval_seconds: float = seconds(
        15, 3600, "How often GPU metrics are sampled; a scrape never calls NVML. 15 s suits a 15-30 s scrape "
        "interval (dcgm-exporter collects every 30 s); each sample of 8 GPUs x 7 MIG devices costs about 4 ms.")
    hostname: Optional[str] = setting(
        None, "Hostname label of the GPU metrics; default: this host's name.", max_length=253)
    pod_labels: bool = setting(
        False, "Add pod, namespace and container labels to the GPU metrics, from the kubelet's "
               "pod-resources API (/var/lib/kubelet/pod-resources/kubelet.sock), as dcgm-exporter does.")
    pod_uid: bool = setting(
        False, "With pod_labels: also a pod_uid label (dcgm-exporter's --kubernetes-enable-pod-uid), the UID "
               "read from the Kubernetes API with the node's credentials (kubernetes.kubeconfig).")
    pod_kubernetes_labels: bool = setting(
        False, "With pod_labels: also the pod's own Kubernetes labels, names sanitized to [a-zA-Z0-9_] "
               "(dcgm-exporter's --kubernetes-enable-pod-labels), read from the Kubernetes API.")
    pod_label_allowlist_regex: RegexList = setting(
        [], "With pod_kubernetes_labels: only the pod labels whose key one of these regular expressions "
            "matches, anywhere in the key (a regex or a list); empty: every label.")
    legacy_label_names: bool = setting(
        False, "dcgm-exporter 1.x's label names (--use-old-namespace): uuid, pod_name, pod_namespace and "
               "container_name for UUID, pod, namespace and container.")
    virtual_gpus: bool = setting(
        False, "With pod_labels: shared GPUs (time-slicing, MPS) as dcgm-exporter's KUBERNETES_VIRTUAL_GPUS: "
               "a vgpu label for the replica, and DCGM_FI_DEV_GPU_UTIL and DCGM_FI_DEV_FB_USED per pod from "
               "each process' utilisation and memory (NVML), beside the GPU's own series.")
    hpc_job_mapping_dir: Optional[AbsolutePath] = setting(
        None, "A directory of files named by GPU index (or <gpu>.<gpu instance>) listing job ids, one a line; "
              "each job is an hpc_job label (dcgm-exporter's --hpc-job-mapping-dir). Under --root.")
    hostname_label: Literal["Hostname", "hostname", "none"] = setting(
        "Hostname", "Name of the host label: Hostname (dcgm-exporter's releases to 4.8), hostname (its main "
                    "branch since d5e5f51) or none (left out, as its --no-hostname).")
    exporter_series: list[ExporterSeries] = setting(
        [], "dcgm-exporter's own series to add (its default-counters.csv has them commented out): "
            "DCGM_EXP_XID_ERRORS_COUNT, DCGM_EXP_CLOCK_EVENTS_COUNT, DCGM_EXP_GPU_HEALTH_STATUS, "
            "DCGM_EXP_P2P_STATUS.", max_length=4)
    xid_count_window_seconds: float = seconds(
        300, 86400, "DCGM_EXP_XID_ERRORS_COUNT counts the XIDs of this window (--xid-count-window-size).")
    clock_events_count_window_seconds: float = seconds(
        300, 86400, "DCGM_EXP_CLOCK_EVENTS_COUNT counts the samples with each clock event reason in this window "
                    "(--clock-events-count-window-size).")

    def __post_init__(self) -> None:
        needs = {"pod_uid": "pod_labels", "pod_kubernetes_labels": "pod_labels", "virtual_gpus": "pod_labels",
                 "pod_label_allowlist_regex": "pod_kubernetes_labels"}
        for key, needed in needs.items():
            if getattr(self, key) and not getattr(self, needed):
                raise ValueError(f"{key} takes effect only with {needed}: true (dcgm-exporter ignores it "
                                 f"silently; set {needed}: true or remove {key})")
        if len(set(self.exporter_series)) != len(self.exporter_series):
            raise ValueError("exporter_series names a series twice")


@dataclass(frozen=True)
class DiscoveryConfig(Section):
    expected_gpus: Optional[int] = setting(
        None, "Fail discovery unless exactly this many GPUs are visible (catches a GPU off the bus).",
        ge=0, le=MAX_GPUS)


Xid = Annotated[int, Bounds(ge=0, le=65535)]
Xids = Annotated[Union[Literal["all"], list[Xid]], AllOr(Annotated[list[Xid], Bounds(max_length=1024)])]


@dataclass(frozen=True)
class HealthConfig(Section):
    ignored_xids: Xids = setting(
        [13, 31, 43, 45, 68, 109], "XIDs caused by applications, not the GPU (the Kubernetes device plugin's "
        "list; DP_DISABLE_HEALTHCHECKS adds to it); all: no XID marks a GPU unhealthy unless "
        "extra_critical_xids names it. Any other XID marks the GPU unhealthy.")
    extra_critical_xids: Xids = setting(
        [], "XIDs that mark the GPU unhealthy even when ignored_xids lists them (DP_ENABLE_HEALTHCHECKS); all: "
            "every XID does, the application ones too.")
    recover_after_seconds: float = seconds(
        300, 86400, "A GPU made unhealthy by an XID is healthy again after this long without another critical "
        "XID; one off the bus (XID 79) only once NVML answers for it again at the same PCI bus id.")
    check_interval_seconds: float = seconds(
        30, 3600, "Run the periodic GPU checks this often: NVML answers in time, pending row remaps (or page "
        "retirements), a row remapping failure, temperature at or above the slowdown threshold.")
    unready_when: Literal["any", "all"] = setting(
        "any", "The node is not ready when any GPU is unhealthy (any), or only when every GPU is (all).")


@dataclass(frozen=True)
class AgentConfig(Section):
    version: Literal["v1"] = "v1"
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "debug, info, warning or error.")
    reconcile: ReconcileConfig = setting(ReconcileConfig())
    http: HttpConfig = setting(HttpConfig())
    nvml: NvmlConfig = setting(NvmlConfig())
    metrics: MetricsConfig = setting(MetricsConfig())
    driver: DriverConfig = setting(DriverConfig())
    toolkit: ToolkitConfig = setting(ToolkitConfig())
    kubernetes: KubernetesConfig = setting(KubernetesConfig())
    discovery: DiscoveryConfig = setting(DiscoveryConfig())
    health: HealthConfig = setting(HealthConfig())
    mig: MigConfig = setting(MigConfig())
    plugin: PluginConfig = setting(PluginConfig())
    workload: WorkloadConfig = setting(WorkloadConfig())
    dra: DraConfig = setting(DraConfig())
