"""Schema of /etc/gpu-agent/config.yaml, version v1. Unknown keys are errors, never ignored."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from gpu_agent.config.driver import DriverConfig
from gpu_agent.config.section import Section
from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.toolkit import ToolkitConfig


class ReconcileConfig(Section):
    interval_seconds: float = Field(60, gt=0, description="Re-reconcile every stage this often.")
    backoff_initial_seconds: float = Field(5, gt=0, description="First retry delay of a failing stage.")
    backoff_max_seconds: float = Field(300, gt=0, description="Retry delay cap of a failing stage.")


class HttpConfig(Section):
    listen: str = Field(
        "127.0.0.1:9445",
        description='TCP address of the read-only endpoint, HOST:PORT; "" turns TCP off.',
    )
    socket: str = Field(
        "/run/gpu-agent/agent.sock",
        description='Unix socket of the same endpoint (under --root); "" turns it off.',
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value == "":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9445, got {value!r}")
        return value

    @field_validator("socket")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class NvmlConfig(Section):
    call_timeout_seconds: float = Field(
        5, gt=0, description="An NVML call that takes longer is abandoned and the driver reported hung."
    )


class MetricsConfig(Section):
    sample_interval_seconds: float = Field(
        5, gt=0, description="How often GPU metrics are sampled; a scrape never calls NVML."
    )
    hostname: Optional[str] = Field(None, description="Hostname label of the GPU metrics; default: this host's name.")


class DiscoveryConfig(Section):
    expected_gpus: Optional[int] = Field(
        None, ge=0, description="Fail discovery unless exactly this many GPUs are visible (catches a GPU off the bus)."
    )


class HealthConfig(Section):
    ignored_xids: list[int] = Field(
        [13, 31, 43, 45, 68, 109],
        description="XIDs caused by applications, not the GPU (the Kubernetes device plugin's list); "
        "any other XID marks the GPU unhealthy until the agent restarts.",
    )


class AgentConfig(Section):
    version: Literal["v1"] = "v1"
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="debug, info, warning or error.")
    reconcile: ReconcileConfig = ReconcileConfig()
    http: HttpConfig = HttpConfig()
    nvml: NvmlConfig = NvmlConfig()
    metrics: MetricsConfig = MetricsConfig()
    driver: DriverConfig = DriverConfig()
    toolkit: ToolkitConfig = ToolkitConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    health: HealthConfig = HealthConfig()
