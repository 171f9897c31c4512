"""The toolkit section: which container runtimes get the nvidia runtime, and the CDI spec."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from gpu_agent.config.section import AbsolutePath, Section, seconds

Runtime = Literal["containerd", "docker", "crio"]


class CdiConfig(Section):
    enabled: bool = Field(True, description="Write a CDI spec for the GPUs and turn CDI on in the runtimes.")
    path: AbsolutePath = Field("/var/run/cdi/nvidia.yaml", description="Where the CDI spec is written.")


class ToolkitConfig(Section):
    enabled: bool = Field(True, description="Configure the container runtimes for NVIDIA GPUs.")
    runtimes: Union[Literal["auto"], list[Runtime]] = Field(
        "auto", description="auto: every runtime found by its config file, binary or unit; or a list.")
    set_as_default: bool = Field(False, description="Make nvidia the runtimes' default runtime.")
    runtime_binary: AbsolutePath = Field(
        "/usr/bin/nvidia-container-runtime", description="What the nvidia runtime runs."
    )
    oci_hook: bool = Field(False, description="Also install the legacy OCI prestart hook (podman, CRI-O).")
    runtime_config: dict[str, Any] = Field(
        default_factory=dict,
        description='Keys to set in /etc/nvidia-container-runtime/config.toml, '
        'e.g. {"nvidia-container-runtime.mode": "cdi"}.',
    )
    install: bool = Field(False, description="Install nvidia-container-toolkit with apt-get or dnf when it is missing.")
    allow_vulnerable_toolkit: bool = Field(
        False, description="Accept a toolkit older than 1.17.8 (CVE-2025-23266).")
    restart_timeout_seconds: float = seconds(60, 3600, "How long a restarted runtime has to answer.")
    cdi: CdiConfig = CdiConfig()
