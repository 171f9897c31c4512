"""The plugin section: the kubelet device plugin, its device list strategy and GPU sharing.

`sharing` is NVIDIA k8s-device-plugin's block, camelCase keys as NVIDIA writes them, so a working
NVIDIA config can be pasted unchanged; `gpu_replicas` (ours) sets replica counts per GPU.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from gpu_agent.config.section import Section, shown

if TYPE_CHECKING:
    from gpu_agent.config.schema import AgentConfig
    from gpu_agent.host.paths import Root

MAX_REPLICAS = 1024  # NVIDIA's plugin has no bound; this catches a typo (a million ids per GPU)
RESOURCE_PREFIX = "nvidia.com/"
_RESOURCE = re.compile(r"(gpu|mig-[0-9]+g\.[0-9]+gb(\.[a-z0-9]+)*)")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Fa-f-]{8,64}")


def _resource_name(value: str) -> str:
    """`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb` (or without the prefix, as NVIDIA's plugin accepts),
    returned with the prefix."""
    name = value[len(RESOURCE_PREFIX):] if value.startswith(RESOURCE_PREFIX) else value
    if not _RESOURCE.fullmatch(name):
        raise ValueError(f"{shown(value)} is not a resource this plugin serves: nvidia.com/gpu or "
                         "nvidia.com/mig-<profile> such as nvidia.com/mig-1g.10gb")
    return RESOURCE_PREFIX + name


def _renamed(value: str) -> str:
    name = value[len(RESOURCE_PREFIX):] if value.startswith(RESOURCE_PREFIX) else value
    if len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        raise ValueError(f"{shown(value)} is not a resource name (lower-case letters, digits, '-' and '.')")
    return RESOURCE_PREFIX + name


def _device_ref(value: Union[int, str]) -> Union[int, str]:
    """A GPU by index, or a GPU or MIG device by UUID."""
    if isinstance(value, int) or _GPU_UUID.fullmatch(value):
        return value
    raise ValueError(f"{shown(value)} is neither a GPU index nor a GPU-/MIG- UUID")


# NVIDIA's keys are camelCase; the snake_case names are accepted too (what defaults.py writes).
_CAMEL = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True, populate_by_name=True)
ResourceName = Annotated[str, Field(max_length=80), AfterValidator(_resource_name)]
DeviceRef = Annotated[Union[Annotated[int, Field(ge=0, le=1023)], Annotated[str, Field(max_length=80)]],
                      AfterValidator(_device_ref)]


class TimeSlicedResource(Section):
    name: ResourceName = Field(description="The resource to share: nvidia.com/gpu or nvidia.com/mig-<profile>.")
    replicas: int = Field(ge=1, le=MAX_REPLICAS, description="Devices advertised per GPU (or MIG device).")
    rename: Optional[Annotated[str, Field(max_length=80), AfterValidator(_renamed)]] = Field(
        None, description="Advertise the shared devices under this name instead.")
    devices: Union[Literal["all"], list[DeviceRef]] = Field(
        "all", description='"all", or the GPUs (index or UUID) and MIG devices (UUID) to share.')

    @field_validator("devices")
    @classmethod
    def _bounded(cls, value: Union[str, list[Union[int, str]]]) -> Union[str, list[Union[int, str]]]:
        if isinstance(value, list) and len(value) > 1024:
            raise ValueError(f"{len(value)} devices is more than any node has (at most 1024)")
        return value


class TimeSlicing(Section):
    model_config = _CAMEL

    rename_by_default: bool = Field(False, alias="renameByDefault",
                                    description="Advertise shared resources as <name>.shared.")
    fail_requests_greater_than_one: bool = Field(
        False, alias="failRequestsGreaterThanOne",
        description="Refuse an Allocate asking for more than one device of a shared resource.")
    resources: list[TimeSlicedResource] = Field([], max_length=64)

    @model_validator(mode="after")
    def _one_entry_per_resource(self) -> TimeSlicing:
        seen: set[str] = set()
        for entry in self.resources:
            if entry.name in seen:
                raise ValueError(f"{entry.name} is listed twice in timeSlicing.resources; merge the entries")
            seen.add(entry.name)
        return self


class Sharing(Section):
    model_config = _CAMEL

    time_slicing: TimeSlicing = Field(TimeSlicing(), alias="timeSlicing")
    mps: Optional[dict[str, object]] = Field(None, description="Not supported: MPS sharing is out of scope.")

    @field_validator("mps")
    @classmethod
    def _no_mps(cls, value: Optional[dict[str, object]]) -> None:
        if value:
            raise ValueError("MPS sharing is not supported by gpu-agent; use timeSlicing or remove mps")
        return None


GpuKey = Annotated[str, Field(max_length=80)]


class PluginConfig(Section):
    enabled: Union[bool, Literal["auto"]] = Field(
        "auto", description="Serve the kubelet device plugin; auto: when <root>/var/lib/kubelet/device-plugins "
                            "exists.")
    device_list_strategy: Literal["cdi-cri", "cdi-annotations", "envvar"] = Field(
        "cdi-cri", description="How Allocate names devices: cdi-cri (CDI devices in the CRI), cdi-annotations "
                               "(cdi.k8s.io/ annotations) or envvar (NVIDIA_VISIBLE_DEVICES).")
    sharing: Sharing = Field(Sharing(), description="NVIDIA k8s-device-plugin's sharing block, pasted unchanged.")
    gpu_replicas: dict[GpuKey, Annotated[int, Field(ge=1, le=MAX_REPLICAS)]] = Field(
        {}, max_length=1024,
        description='Replicas per GPU, by index ("0") or UUID; overrides timeSlicing for that GPU and its MIG '
                    "devices. 1 takes the GPU out of sharing.")

    @field_validator("gpu_replicas", mode="before")
    @classmethod
    def _index_keys(cls, value: object) -> object:
        """`0: 4` in YAML is an int key: the index as written."""
        if isinstance(value, dict):
            return {str(key) if isinstance(key, int) and not isinstance(key, bool) else key: count
                    for key, count in value.items()}
        return value

    @field_validator("gpu_replicas")
    @classmethod
    def _gpu_keys(cls, value: dict[str, int]) -> dict[str, int]:
        for key in value:
            if not (key.isdigit() or re.fullmatch(r"GPU-[0-9A-Fa-f-]{8,64}", key)):
                raise ValueError(f"key {shown(key)} is neither a GPU index such as \"0\" nor a GPU UUID")
        return value


DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


def plugin_wanted(root: Root, settings: PluginConfig) -> bool:
    """On when asked for, or (auto) when the kubelet's device-plugins directory exists under --root."""
    return settings.enabled is True or (settings.enabled == "auto" and root(DEVICE_PLUGIN_DIR).is_dir())


def mig_strategy(config: AgentConfig) -> str:
    """mig.strategy, else its deprecated alias kubernetes.mig_strategy, else none."""
    return config.mig.strategy or config.kubernetes.mig_strategy or "none"


def deprecated_keys(config: AgentConfig) -> list[tuple[tuple[str, ...], str]]:
    """(key path, what to write instead) for each deprecated setting the config uses."""
    found: list[tuple[tuple[str, ...], str]] = []
    if config.kubernetes.mig_strategy is not None:
        found.append((("kubernetes", "mig_strategy"),
                      f"deprecated: write mig.strategy: {config.kubernetes.mig_strategy} instead"))
    return found


def conflicting_keys(config: AgentConfig) -> list[tuple[tuple[str, ...], str]]:
    """(key path, reason) where a deprecated alias and its new key disagree."""
    old, new = config.kubernetes.mig_strategy, config.mig.strategy
    if old is not None and new is not None and old != new:
        return [(("kubernetes", "mig_strategy"), f"deprecated alias of mig.strategy, which says {new!r} where this "
                                                 f"says {old!r}; remove kubernetes.mig_strategy")]
    return []
