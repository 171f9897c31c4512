"""The plugin section: the kubelet device plugin, its device list strategy and GPU sharing.

`sharing` is NVIDIA k8s-device-plugin's block, camelCase keys as NVIDIA writes them, so a working
NVIDIA config can be pasted unchanged; `gpu_replicas` (ours) sets replica counts per GPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

from gpu_agent.config.section import Bounds, Check, Section, setting, shown
from gpu_agent.numbers import decimal

if TYPE_CHECKING:
    from gpu_agent.config.schema import AgentConfig
    from gpu_agent.host.paths import Root

MAX_REPLICAS = 1024  # NVIDIA's plugin has no bound; this catches a typo (a million ids per GPU)
MAX_MPS_CLIENTS = 48  # an MPS server's clients on Volta and later (NVIDIA's mps-control-daemon/mps/device.go)
RESOURCE_PREFIX = "nvidia.com/"
SHARED_SUFFIX = ".shared"  # renameByDefault's name: <name>.shared
MAX_RESOURCE_NAME = 63  # the fully-qualified name, as NVIDIA's MaxResourceNameLength
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_UUID = r"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|[0-9a-fA-F]{32})"
_GPU_UUID = re.compile(f"GPU-{_UUID}")
_MIG_UUID = re.compile(f"MIG-({_UUID}|GPU-{_UUID}/[0-9]+/[0-9]+)")
_MIG_INDEX = re.compile(r"[0-9]{1,9}:[0-9]{1,9}")


def _resource_name(value: str) -> str:
    """As NVIDIA's NewResourceName: nvidia.com/ is added where missing (`valid` is nvidia.com/valid), the
    whole at most 63 characters, the part after it a DNS subdomain."""
    name = value if value.startswith(RESOURCE_PREFIX) else RESOURCE_PREFIX + value
    if len(name) > MAX_RESOURCE_NAME:
        raise ValueError(f"fully-qualified resource name must be {MAX_RESOURCE_NAME} characters or less: {shown(name)}")
    if not _DNS_SUBDOMAIN.fullmatch(name[len(RESOURCE_PREFIX):]):
        raise ValueError(f"{shown(value)} is not a resource name: after nvidia.com/, lower-case letters, digits, "
                         "'-' and '.' (a DNS subdomain)")
    return name


def is_mig_ref(value: Union[int, str]) -> bool:
    return isinstance(value, str) and bool(_MIG_INDEX.fullmatch(value) or _MIG_UUID.fullmatch(value))


def _device_ref(value: Union[int, str]) -> Union[int, str]:
    """As NVIDIA's ReplicatedDeviceRef: a GPU index (a number, or its digits as a string), a MIG index
    `<gpu>:<mig>`, a GPU UUID, or a MIG UUID (MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>)."""
    if isinstance(value, int):
        return value
    index = decimal(value)
    if index is not None and value == value.strip():
        return index
    if is_mig_ref(value) or _GPU_UUID.fullmatch(value):
        return value
    raise ValueError(f"unsupported device {shown(value)}: a GPU index, a MIG index such as \"0:1\", "
                     "or a GPU-/MIG- UUID")


def _bounded(value: Union[str, int, list[Union[int, str]]]) -> Union[str, int, list[Union[int, str]]]:
    if isinstance(value, list) and len(value) > 1024:
        raise ValueError(f"{len(value)} devices is more than any node has (at most 1024)")
    return value


ResourceName = Annotated[str, Bounds(max_length=80), Check(_resource_name)]
DeviceRef = Annotated[Union[Annotated[int, Bounds(ge=0, le=1023)], Annotated[str, Bounds(max_length=80)]],
                      Check(_device_ref)]
Devices = Annotated[Union[Literal["all"], Annotated[int, Bounds(ge=1, le=1024)], list[DeviceRef]],
                    Check(_bounded)]


# NVIDIA's keys are camelCase (each field's alias); the snake_case names are accepted too.
@dataclass(frozen=True)
class ReplicatedResource(Section):
    """One resource of timeSlicing or mps, as NVIDIA's ReplicatedResource reads it."""

    name: ResourceName = setting(description="The resource to share: nvidia.com/gpu (or nvidia.com/mig-<profile>); one "
                                             "the node does not have is ignored.")
    replicas: int = setting(description="Devices advertised per GPU (or MIG device); at least 2, as NVIDIA's plugin.",
                            ge=2, le=MAX_REPLICAS)
    rename: Optional[ResourceName] = setting(
        None, "Advertise the shared devices under this name; honoured with plugin.per_resource_sharing only.")
    devices: Devices = setting(
        "all", '"all", a count of GPUs, or the GPUs and MIG devices (index or UUID) to share; honoured with '
               "plugin.per_resource_sharing only.")


@dataclass(frozen=True)
class ReplicatedResources(Section):
    """NVIDIA's ReplicatedResources: the body of sharing.timeSlicing and sharing.mps."""

    rename_by_default: bool = setting(False, "Advertise shared resources as <name>.shared.", alias="renameByDefault")
    fail_requests_greater_than_one: Optional[bool] = setting(
        None, "Refuse an Allocate asking for more than one device when any is a replica (unset: false for "
              "timeSlicing, true for mps; false honoured under mps too, as NVIDIA's plugin since v0.20).",
        alias="failRequestsGreaterThanOne")
    resources: list[ReplicatedResource] = setting([], max_length=64)

    def __post_init__(self) -> None:
        if not self.resources:
            raise ValueError("no resources specified")  # NVIDIA's words
        seen: set[str] = set()
        for entry in self.resources:
            if entry.name in seen:
                raise ValueError(f"{entry.name} is listed twice in resources; merge the entries")
            seen.add(entry.name)


@dataclass(frozen=True)
class Sharing(Section):
    time_slicing: Optional[ReplicatedResources] = setting(None, "Time-slicing: replicas share a GPU in turns.",
                                                          alias="timeSlicing")
    mps: Optional[ReplicatedResources] = setting(
        None, "CUDA MPS: replicas share a GPU at once, each with its share of threads and memory; gpu-agent runs "
              "the MPS control daemons itself.")

    def __post_init__(self) -> None:
        if self.time_slicing is not None and self.mps is not None:
            raise ValueError("timeSlicing and mps are both set; NVIDIA's plugin then shares by mps alone and "
                             "ignores timeSlicing: keep one")
        for n, entry in enumerate(self.mps.resources if self.mps else ()):
            if entry.name.startswith(RESOURCE_PREFIX + "mig-") or (
                    isinstance(entry.devices, list) and any(is_mig_ref(ref) for ref in entry.devices)):
                raise ValueError(f"mps.resources.{n}: sharing using MPS is not supported for MIG devices")
            if entry.replicas > MAX_MPS_CLIENTS:
                raise ValueError(f"mps.resources.{n}.replicas: maximum allowed replicas exceeded: {entry.replicas} > "
                                 f"{MAX_MPS_CLIENTS} (the clients one MPS server takes)")

    @property
    def strategy(self) -> str:
        """NVIDIA's SharingStrategy(): mps, time-slicing or none."""
        return "mps" if self.mps is not None else "time-slicing" if self.time_slicing is not None else "none"

    @property
    def replicated(self) -> Optional[ReplicatedResources]:
        return self.mps if self.mps is not None else self.time_slicing

    @property
    def fail_requests_greater_than_one(self) -> bool:
        """As NVIDIA's plugin v0.20 loads it: unset, true under mps (its NewConfig keeps the historical MPS
        behaviour) and false otherwise; set, as set (before v0.20 MPS refused two replicas regardless)."""
        chosen = self.replicated
        if chosen is None or chosen.fail_requests_greater_than_one is None:
            return self.mps is not None
        return chosen.fail_requests_greater_than_one


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
    per_resource_sharing: bool = setting(
        False, "gpu-agent's extension: honour each sharing resource's rename and devices. NVIDIA's plugin ignores "
               "both (with a warning) and shares every GPU under its own name; so does gpu-agent without this.")
    gpu_replicas: GpuReplicas = setting(
        {}, 'Replicas per GPU, by index ("0") or UUID; overrides timeSlicing for that GPU and its MIG '
            "devices. 1 takes the GPU out of sharing.", max_length=1024)
    api: Literal["device-plugin", "dra", "both"] = setting(
        "device-plugin", "Which API serves this node's GPUs (one at a time, never the same GPU twice): "
                         "device-plugin (nvidia.com/gpu), dra (driver gpu.nvidia.com, Kubernetes 1.34+) or both "
                         "(DRA, with nvidia.com/gpu served through DRA's extended resource: only where the "
                         "cluster has a DeviceClass for it, else device-plugin); a switch waits until no pod holds a "
                         "GPU (docs/dra.md).")
    shared_devices_allocation_policy: Literal["distributed", "packed"] = setting(
        "distributed", "Which replicas and MIG devices GetPreferredAllocation offers, as NVIDIA's plugin v0.20: "
                       "distributed (those of the least loaded GPUs, counting what is allocated) or packed (the "
                       "most loaded first, keeping other GPUs free). Whole GPUs are placed by topology either way.")


@dataclass(frozen=True)
class DraConfig(Section):
    enabled: bool = setting(
        False, "The earlier spelling of plugin.api: dra (kept): true serves the GPUs through DRA where plugin.api "
               "is left at device-plugin.")


def configured_api(plugin: PluginConfig, dra: DraConfig) -> str:
    """plugin.api, with dra.enabled: true read as plugin.api: dra where plugin.api is left at its default."""
    return "dra" if dra.enabled and plugin.api == "device-plugin" else plugin.api


def serves_dra(api: str) -> bool:
    """Whether `api` (a plugin.api value) serves the GPUs through DRA, the device plugin then advertising none."""
    return api != "device-plugin"


DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"  # kubeadm's, k3s's and RKE2's kubelet
MICROK8S_DEVICE_PLUGIN_DIR = "/var/snap/microk8s/common/var/lib/kubelet/device-plugins"  # its --root-dir


def device_plugin_dir(root: Root) -> str:
    """The kubelet's device-plugins directory on this node: the usual one, else microk8s's where only it is."""
    if not root(DEVICE_PLUGIN_DIR).is_dir() and root(MICROK8S_DEVICE_PLUGIN_DIR).is_dir():
        return MICROK8S_DEVICE_PLUGIN_DIR
    return DEVICE_PLUGIN_DIR


def kubelet_dir(root: Root) -> str:
    """The kubelet's root directory (--root-dir): the one that holds its device-plugins directory."""
    return device_plugin_dir(root).rsplit("/", 1)[0]


def plugin_wanted(root: Root, settings: PluginConfig) -> bool:
    """On when asked for, or (auto) when the kubelet's device-plugins directory exists under --root."""
    return settings.enabled is True or (settings.enabled == "auto" and root(device_plugin_dir(root)).is_dir())


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
    found: list[tuple[tuple[str, ...], str]] = []
    old, new = config.kubernetes.mig_strategy, config.mig.strategy
    if old is not None and new is not None and old != new:
        found.append((("kubernetes", "mig_strategy"), f"deprecated alias of mig.strategy, which says {new!r} where "
                                                      f"this says {old!r}; remove kubernetes.mig_strategy"))
    plugin = config.plugin
    if plugin.sharing.mps is not None:
        if mig_strategy(config) == "mixed":
            found.append((("plugin", "sharing", "mps"), "using mig.strategy mixed is not supported with MPS "
                                                        "(as NVIDIA's plugin): use mig.strategy none or single"))
        if plugin.gpu_replicas:
            found.append((("plugin", "gpu_replicas"), "per-GPU replicas are for timeSlicing; with mps every GPU of "
                                                      "a resource has its replicas (its daemon's thread share)"))
    return found


def ignored_keys(config: AgentConfig) -> list[tuple[tuple[str, ...], str]]:
    """(key path, warning) for each rename and devices NVIDIA's plugin would ignore, and so does the agent
    unless plugin.per_resource_sharing is on (NVIDIA's DisableResourceNamingInConfig)."""
    sharing = config.plugin.sharing
    found: list[tuple[tuple[str, ...], str]] = []
    if config.plugin.per_resource_sharing:
        return []
    for key, chosen in (("timeSlicing", sharing.time_slicing), ("mps", sharing.mps)):
        if chosen is None:
            continue
        for n, entry in enumerate(chosen.resources):
            if entry.rename is not None and entry.rename != default_rename(entry.name, chosen.rename_by_default):
                found.append((("plugin", "sharing", key, "resources", str(n), "rename"),
                              "ignored, as NVIDIA's plugin ignores it; set plugin.per_resource_sharing: true to "
                              "honour it"))
            if entry.devices != "all":
                found.append((("plugin", "sharing", key, "resources", str(n), "devices"),
                              "ignored (every GPU is shared), as NVIDIA's plugin ignores it; set "
                              "plugin.per_resource_sharing: true to honour it"))
    return found


def default_rename(name: str, rename_by_default: bool) -> Optional[str]:
    return name + SHARED_SUFFIX if rename_by_default else None
