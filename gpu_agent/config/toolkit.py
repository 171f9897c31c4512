"""The toolkit section: which container runtimes get the nvidia runtime, and the CDI spec."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

from gpu_agent.config.section import AbsolutePath, Section, seconds, setting

Runtime = Literal["containerd", "docker", "crio"]


@dataclass(frozen=True)
class CdiConfig(Section):
    enabled: bool = setting(True, "Write a CDI spec for the GPUs and turn CDI on in the runtimes.")
    path: AbsolutePath = setting("/var/run/cdi/nvidia.yaml", "Where the CDI spec is written.")


@dataclass(frozen=True)
class ToolkitConfig(Section):
    enabled: bool = setting(True, "Configure the container runtimes for NVIDIA GPUs.")
    runtimes: Union[Literal["auto"], list[Runtime]] = setting(
        "auto", "auto: every runtime found by its config file, binary or unit; or a list.")
    set_as_default: bool = setting(False, "Make nvidia the runtimes' default runtime.")
    runtime_binary: AbsolutePath = setting("/usr/bin/nvidia-container-runtime", "What the nvidia runtime runs.")
    oci_hook: bool = setting(False, "Also install the legacy OCI prestart hook (podman, CRI-O).")
    runtime_config: dict[str, Any] = setting(
        {}, 'Keys to set in /etc/nvidia-container-runtime/config.toml, e.g. {"nvidia-container-runtime.mode": "cdi"}.')
    install: bool = setting(False, "Install nvidia-container-toolkit with apt-get or dnf when it is missing.")
    allow_vulnerable_toolkit: bool = setting(False, "Accept a toolkit older than 1.17.8 (CVE-2025-23266).")
    restart_timeout_seconds: float = seconds(60, 3600, "How long a restarted runtime has to answer.")
    cdi: CdiConfig = setting(CdiConfig())
