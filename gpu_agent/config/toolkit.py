"""The toolkit section: which container runtimes get the nvidia runtime, and the CDI spec."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from gpu_agent.config.section import (PATH_MAX, AbsolutePath, Bounds, Check, Section, absolute_path, seconds,
                                     setting)
from gpu_agent.config.text import shown

Runtime = Literal["containerd", "docker", "crio", "k3s", "rke2", "microk8s"]
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOML_INT = range(-(1 << 63), 1 << 63)


def runtime_config_key(key: str) -> str:
    """A dotted key of the runtime's config.toml (nvidia-container-runtime.modes.cdi.default-kind): every part
    a TOML bare key, as the toolkit's own keys are."""
    if not all(_BARE_KEY.fullmatch(part) for part in key.split(".")):
        raise ValueError(f"{shown(key)} is not a dotted key of the runtime's config.toml: each part letters, "
                         "digits, '-' or '_', parts joined by '.'")
    return key


def runtime_config_value(value: Any) -> Any:
    """What TOML and the runtime's settings hold: a string, a boolean, a number, or a list of those."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or isinstance(item, str) or (isinstance(item, int) and item in _TOML_INT):
            continue
        if isinstance(item, float) and math.isfinite(item):
            continue
        kind = "null" if item is None else "an empty mapping" if isinstance(item, dict) else \
            "a list inside a list" if isinstance(item, list) else shown(item)
        raise ValueError(f"must be a string, boolean, number or a list of those; got {kind}")
    return value


def flattened(settings: Any) -> Any:
    """Tables written as YAML mappings ({nvidia-container-runtime: {mode: cdi}}) as the dotted keys they
    hold (nvidia-container-runtime.mode): each key is set alone, the rest of its table kept."""
    if not isinstance(settings, dict):
        return settings
    flat: dict[Any, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value and isinstance(key, str):
            flat.update({f"{key}.{inner}": item for inner, item in flattened(value).items()})
        else:
            flat[key] = value
    return flat


RuntimeConfigKey = Annotated[str, Bounds(max_length=256), Check(runtime_config_key)]
RuntimeConfigValue = Annotated[Any, Check(runtime_config_value)]
RuntimeConfig = Annotated[dict[RuntimeConfigKey, RuntimeConfigValue], Check(flattened, before=True)]


CDI_DIRS = ("/etc/cdi", "/var/run/cdi", "/run/cdi")  # the runtimes' CDI spec directories (/run/cdi: /var/run/cdi)


def cdi_spec_path(value: str) -> str:
    """A file directly in a CDI spec directory, named *.yaml or *.json: where the runtimes read specs
    (cdi.spec-dirs defaults to /etc/cdi and /var/run/cdi), and nowhere the agent would overwrite a
    system file that it does not manage."""
    directory, _, name = absolute_path(value).rpartition("/")
    if directory not in CDI_DIRS or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*\.(yaml|json)", name):
        raise ValueError(f"must be a .yaml or .json file directly in {', '.join(CDI_DIRS)} (where the container "
                         f"runtimes read CDI specs), such as /var/run/cdi/nvidia.yaml; got {shown(value)}")
    return value


@dataclass(frozen=True)
class CdiConfig(Section):
    enabled: bool = setting(True, "Write a CDI spec for the GPUs and turn CDI on in the runtimes.")
    path: Annotated[str, Bounds(max_length=PATH_MAX), Check(cdi_spec_path)] = setting(
        "/var/run/cdi/nvidia.yaml", "Where the CDI spec is written: a .yaml or .json file in /etc/cdi or /var/run/cdi.")
    additional_gids: Union[bool, Literal["auto"]] = setting(
        "auto", "Give containers the group of each device node that is not world read-writable (additionalGids, "
                "CDI 0.7.0); auto: where every CDI reader here reads 0.7.0 specs; false: never (docs/cdi.md).")


@dataclass(frozen=True)
class ToolkitConfig(Section):
    enabled: bool = setting(True, "Configure the container runtimes for NVIDIA GPUs.")
    runtimes: Union[Literal["auto"], list[Runtime]] = setting(
        "auto", "auto: every runtime found by its config file, binary or unit; or a list.")
    set_as_default: Union[bool, Literal["auto"]] = setting(
        "auto", "Make nvidia the runtimes' default runtime; auto: the kubelet's runtime's, where pods get their "
                "GPU through NVIDIA_VISIBLE_DEVICES (docs/device-path.md).")
    runtime_binary: AbsolutePath = setting("/usr/bin/nvidia-container-runtime", "What the nvidia runtime runs.")
    oci_hook: bool = setting(False, "Also install the legacy OCI prestart hook (podman, CRI-O).")
    runtime_config: RuntimeConfig = setting(
        {}, 'Keys to set in /etc/nvidia-container-runtime/config.toml, e.g. {"nvidia-container-runtime.mode": "cdi"}.')
    install: bool = setting(False, "Install nvidia-container-toolkit with apt-get or dnf when it is missing.")
    allow_vulnerable_toolkit: bool = setting(False, "Accept a toolkit older than 1.17.8 (CVE-2025-23266).")
    restart_timeout_seconds: float = seconds(60, 3600, "How long a restarted runtime has to answer.")
    cdi: CdiConfig = setting(CdiConfig())
