"""The plugin section: the kubelet device plugin, its device list strategy and GPU sharing.

`sharing` is NVIDIA k8s-device-plugin's block, camelCase keys as NVIDIA writes them, so a working
NVIDIA config can be pasted unchanged; `gpu_replicas` (ours) sets replica counts per GPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union


from gpu_agent.config.section import Bounds, Check, Section, setting, shown

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


def _bounded(value: Union[str, list[Union[int, str]]]) -> Union[str, list[Union[int, str]]]:
    if isinstance(value, list) and len(value) > 1024:
        raise ValueError(f"{len(value)} devices is more than any node has (at most 1024)")
    return value


ResourceName = Annotated[str, Bounds(max_length=80), Check(_resource_name)]
DeviceRef = Annotated[Union[Annotated[int, Bounds(ge=0, le=1023)], Annotated[str, Bounds(max_length=80)]],
                      Check(_device_ref)]


# NVIDIA's keys are camelCase (each field's alias); the snake_case names are accepted too.
@dataclass(frozen=True)
class TimeSlicedResource(Section):
    name: ResourceName = setting(description="The resource to share: nvidia.com/gpu or nvidia.com/mig-<profile>.")
    replicas: int = setting(description="Devices advertised per GPU (or MIG device).", ge=1, le=MAX_REPLICAS)
    rename: Optional[Annotated[str, Bounds(max_length=80), Check(_renamed)]] = setting(
        None, "Advertise the shared devices under this name instead.")
    devices: Annotated[Union[Literal["all"], list[DeviceRef]], Check(_bounded)] = setting(
        "all", '"all", or the GPUs (index or UUID) and MIG devices (UUID) to share.')


@dataclass(frozen=True)
class TimeSlicing(Section):
    rename_by_default: bool = setting(False, "Advertise shared resources as <name>.shared.", alias="renameByDefault")
    fail_requests_greater_than_one: bool = setting(
        False, "Refuse an Allocate asking for more than one device of a shared resource.",
        alias="failRequestsGreaterThanOne")
    resources: list[TimeSlicedResource] = setting([], max_length=64)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for entry in self.resources:
            if entry.name in seen:
                raise ValueError(f"{entry.name} is listed twice in timeSlicing.resources; merge the entries")
            seen.add(entry.name)


def _no_mps(value: Optional[dict[str, object]]) -> None:
    if value:
        raise ValueError("MPS sharing is not supported by gpu-agent; use timeSlicing or remove mps")
    return None


@dataclass(frozen=True)
class Sharing(Section):
    time_slicing: TimeSlicing = setting(TimeSlicing(), alias="timeSlicing")
    mps: Annotated[Optional[dict[str, object]], Check(_no_mps)] = setting(
        None, "Not supported: MPS sharing is out of scope.")


def _index_keys(value: object) -> object:
    """`0: 4` in YAML is an int key: the index as written."""
    if isinstance(value, dict):
        return {str(key) if isinstance(key, int) and not isinstance(key, bool) else key: count
                for key, count in value.items()}
    return value


def _gpu_keys(value: dict[str, int]) -> dict[str, int]:
    for key in value:
        if not (key.isdigit() or re.fullmatch(r"GPU-[0-9A-Fa-f-]{8,64}", key)):
            raise ValueError(f"key {shown(key)} is neither a GPU index such as \"0\" nor a GPU UUID")
    return value


GpuKey = Annotated[str, Bounds(max_length=80)]
GpuReplicas = Annotated[dict[GpuKey, Annotated[int, Bounds(ge=1, le=MAX_REPLICAS)]],
                        Check(_gpu_keys), Check(_index_keys, before=True)]


@dataclass(frozen=True)
class PluginConfig(Section):
    enabled: Union[bool, Literal["auto"]] = setting(
        "auto", "Serve the kubelet device plugin; auto: when <root>/var/lib/kubelet/device-plugins exists.")
    device_list_strategy: Literal["auto", "cdi-cri", "cdi-annotations", "envvar"] = setting(
        "auto", "How Allocate names devices: auto (what this node's runtime and kubelet apply, see "
                "docs/device-path.md), cdi-cri (CDI devices in the CRI), cdi-annotations (cdi.k8s.io/ "
                "annotations) or envvar (NVIDIA_VISIBLE_DEVICES).")
    sharing: Sharing = setting(Sharing(), "NVIDIA k8s-device-plugin's sharing block, pasted unchanged.")
    gpu_replicas: GpuReplicas = setting(
        {}, 'Replicas per GPU, by index ("0") or UUID; overrides timeSlicing for that GPU and its MIG '
            "devices. 1 takes the GPU out of sharing.", max_length=1024)


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
