"""Schema of /etc/gpu-agent/config.yaml, version v1. Unknown keys are errors, never ignored."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator

from gpu_agent.config.driver import DriverConfig
from gpu_agent.config.endpoint import DEFAULT_LISTEN, DEFAULT_SOCKET, LISTEN_MAX, Endpoint, valid_listen
from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.mig import MigConfig
from gpu_agent.config.plugin import PluginConfig
from gpu_agent.config.section import PATH_MAX, Section, absolute_path, seconds, shown
from gpu_agent.config.toolkit import ToolkitConfig

MAX_GPUS = 1024  # more than any node has: catches a typo, not a machine


class ReconcileConfig(Section):
    interval_seconds: float = seconds(60, 86400, "Re-reconcile every stage this often.")
    backoff_initial_seconds: float = seconds(5, 3600, "First retry delay of a failing stage.")
    backoff_max_seconds: float = seconds(300, 86400, "Retry delay cap of a failing stage.")


class HttpConfig(Section):
    listen: str = Field(
        DEFAULT_LISTEN, max_length=LISTEN_MAX,
        description='TCP address of the read-only endpoint, HOST:PORT; "" turns TCP off.',
    )
    socket: str = Field(
        DEFAULT_SOCKET, max_length=PATH_MAX,
        description='Unix socket of the same endpoint (under --root); "" turns it off.',
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if not valid_listen(value):
            raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9445, got {shown(value)}")
        return value

    @field_validator("socket")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return absolute_path(value) if value else value

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.listen, self.socket)

    @property
    def host(self) -> str:
        return self.endpoint.host

    @property
    def port(self) -> int:
        return self.endpoint.port


class NvmlConfig(Section):
    call_timeout_seconds: float = seconds(
        5, 300, "An NVML call that takes longer is abandoned and the driver reported hung.")


class MetricsConfig(Section):
    sample_interval_seconds: float = seconds(
        5, 3600, "How often GPU metrics are sampled; a scrape never calls NVML.")
    hostname: Optional[str] = Field(
        None, max_length=253, description="Hostname label of the GPU metrics; default: this host's name."
    )
    pod_labels: bool = Field(
        False, description="Add pod, namespace and container labels to the GPU metrics, from the kubelet's "
                           "pod-resources API (/var/lib/kubelet/pod-resources/kubelet.sock), as dcgm-exporter does.")


class DiscoveryConfig(Section):
    expected_gpus: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_GPUS,
        description="Fail discovery unless exactly this many GPUs are visible (catches a GPU off the bus).",
    )


class HealthConfig(Section):
    ignored_xids: list[Annotated[int, Field(ge=0, le=65535)]] = Field(
        [13, 31, 43, 45, 68, 109], max_length=1024,
        description="XIDs caused by applications, not the GPU (the Kubernetes device plugin's list, as "
        "DP_DISABLE_HEALTHCHECKS); any other XID marks the GPU unhealthy.",
    )
    extra_critical_xids: list[Annotated[int, Field(ge=0, le=65535)]] = Field(
        [], max_length=1024,
        description="XIDs that mark the GPU unhealthy even when ignored_xids lists them (as DP_ENABLE_HEALTHCHECKS).",
    )
    recover_after_seconds: float = seconds(
        300, 86400, "A GPU made unhealthy by an XID is healthy again after this long without another critical "
        "XID; one off the bus (XID 79) only once NVML answers for it again at the same PCI bus id.")
    check_interval_seconds: float = seconds(
        30, 3600, "Run the periodic GPU checks this often: NVML answers in time, pending row remaps (or page "
        "retirements), a row remapping failure, temperature at or above the slowdown threshold.")
    unready_when: Literal["any", "all"] = Field(
        "any", description="The node is not ready when any GPU is unhealthy (any), or only when every GPU is (all).")


class AgentConfig(Section):
    version: Literal["v1"] = "v1"
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error."
    )
    reconcile: ReconcileConfig = ReconcileConfig()
    http: HttpConfig = HttpConfig()
    nvml: NvmlConfig = NvmlConfig()
    metrics: MetricsConfig = MetricsConfig()
    driver: DriverConfig = DriverConfig()
    toolkit: ToolkitConfig = ToolkitConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    health: HealthConfig = HealthConfig()
    mig: MigConfig = MigConfig()
    plugin: PluginConfig = PluginConfig()
