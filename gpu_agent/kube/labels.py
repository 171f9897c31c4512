"""Node labels with GPU Feature Discovery's keys and value formats, so existing nodeSelectors keep
working, computed from what the state model holds (the inventory, readiness) and the config."""
from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gpu_agent.config.plugin import RESOURCE_PREFIX, mig_strategy
from gpu_agent.host import procfs
from gpu_agent.host.paths import Root
from gpu_agent.nvml.model import Gpu, Inventory, MigDevice
from gpu_agent.plugin.devices import GPU_RESOURCE, Shared, mig_resource, sharing

if TYPE_CHECKING:
    from gpu_agent.config.schema import AgentConfig

log = logging.getLogger(__name__)

PREFIX = "nvidia.com/"
TIMESTAMP = PREFIX + "gfd.timestamp"
WORKLOAD = PREFIX + "gpu-agent.workload"
_STAMP = re.compile(r"[0-9]{1,19}")
_INVALID = re.compile(r"[^A-Za-z0-9_. -]")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX = 63


def sanitise(value: str) -> str:
    """As GFD does: characters Kubernetes refuses are dropped, runs of spaces become one '-';
    then at most 63 characters, starting and ending with a letter or digit."""
    value = "-".join(_INVALID.sub("", value).split())[:MAX]
    return value.strip("-_.")


def valid_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(name) and len(name) <= MAX and bool(_NAME.match(name)) and len(prefix) <= 253


def valid_value(value: str) -> bool:
    return value == "" or (len(value) <= MAX and bool(_NAME.match(value)))


def family(major: int, minor: int) -> str:
    """The architecture by compute capability, as GFD names it."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
            10: "blackwell", 12: "blackwell"}.get(major, "undefined")


def machine_name(root: Root) -> Optional[str]:
    """The DMI product name, for gpu.machine."""
    name = procfs.read(root, "/sys/class/dmi/id/product_name")
    return name.strip() if name is not None else None


def node_labels(config: AgentConfig, inventory: Optional[Inventory], ready: bool,
                machine: Optional[str], workload: Optional[Any] = None) -> dict[str, str]:
    """Every label the agent owns for this inventory and readiness: what the labels stage sets, /status
    shows and `gpu-agent labels` prints, with mig.strategy and the time-shared resources of `config`, and the
    node's workload where the vfio stage ran (`workload`: its stages.vfio.WorkloadResult)."""
    strategy = mig_strategy(config)
    labels = compute(inventory, ready, strategy, machine, sharing(inventory, strategy, config.plugin))
    return {**labels, **workload_labels(workload)} if workload is not None else labels


def workload_labels(workload: Any) -> dict[str, str]:
    """gpu-agent.workload: vm-passthrough (every GPU passed through) or mixed, none on a node of containers only;
    gpu.present stays true while the node's GPUs are passed through (NVML, which the GFD labels describe, sees
    none of them), as the GPU Operator keeps it on a vm-passthrough node. The agent never writes
    gpu.workload.config (its input) nor the Operator's gpu.deploy.* labels (docs/vfio.md)."""
    vm = len(workload.vm_gpus())
    if not vm:  # a node of containers only carries no label of this (most nodes: nothing new to write)
        return {}
    return {WORKLOAD: "vm-passthrough" if vm == len(workload.gpus) else "mixed", PREFIX + "gpu.present": "true"}


def compute(inventory: Optional[Inventory], ready: bool, strategy: str, machine: Optional[str],
            shared: Optional[Mapping[str, Shared]] = None) -> dict[str, str]:
    """Every label the agent owns, keys with the nvidia.com/ prefix, as GFD's internal/lm writes them.
    `shared`: the time-sliced resources by name without nvidia.com/ (plugin/devices.py sharing()).
    `machine`: the DMI product name, None where it cannot be read (GFD's "unknown")."""
    labels = {"gpu-agent.ready": str(ready).lower()}
    if inventory is None or not inventory.gpus:
        return _prefixed(labels)
    # A GPU NVML cannot read keeps its labels as last read, and counts in gpu.count: it is still the node's
    # (its devices go Unhealthy in the plugin). Known by its identity alone, its MIG state and memory are
    # unknown: the other GPUs describe the node. (GFD, whose NVML enumeration fails as a whole, exits,
    # removing its labels file: docs/health.md.)
    gpus = tuple(gpu for gpu in inventory.gpus if gpu.details_known) or inventory.gpus
    # As GFD: a node's GPUs are one model, and a GPU with MIG off describes it before one with MIG on.
    first = next((gpu for gpu in gpus if not gpu.mig.enabled), gpus[0])
    product = sanitise(first.product)
    shared = dict(shared or {})
    labels.update(_versions(inventory))
    major, minor = first.compute_capability
    if major:  # GFD's newArchitectureLabels writes none for compute capability 0
        labels.update({"gpu.family": family(major, minor), "gpu.compute.major": str(major),
                       "gpu.compute.minor": str(minor)})
    labels.update({
        "gpu.present": "true",
        "gpu.machine": sanitise(machine) if machine is not None else "unknown",
        "gpu.mode": gpu_mode(inventory.gpus),
        "gpu.replicas": "1",
        "gpu.sharing-strategy": "none",
        "mig.capable": str(any(gpu.mig.capable for gpu in gpus)).lower(),
        "mps.capable": "false",  # GFD's value unless the plugin shares by MPS (_sharing)
    })
    if strategy != "none":
        labels["mig.strategy"] = strategy
    # GFD labels one model (a random one of several: Go's map order); its count is the GPUs of that model
    count = sum(gpu.product == first.product for gpu in inventory.gpus)
    labels.update({"gpu.product": product, "gpu.count": str(count), "gpu.memory": str(first.memory_mib)})
    labels.update(_vgpu(inventory.gpus))
    single = strategy == "single" and any(gpu.mig.enabled for gpu in gpus)
    if not single and all(gpu.mig.enabled for gpu in gpus):
        # GFD's newGPULabelers: the gpu.* labels of MIG-enabled GPUs never carry sharing (replicas 0),
        # whatever the plugin does with them; only a GPU with MIG off brings the config's sharing in.
        labels["gpu.replicas"] = "0"
        shared.pop(_GPU, None)
    if strategy == "mixed":
        labels.update(_mixed(gpus, product))
    elif single:
        labels.update(_single(gpus, product))
    labels.update(_sharing(labels, shared))
    return _prefixed(labels)


_VGA, _3D = 0x030000, 0x030200


def gpu_mode(gpus: tuple[Gpu, ...]) -> str:
    """GFD's newGPUModeLabeler: `graphics` where every GPU's PCI class is VGA, `compute` where every one is
    a 3D controller, `unknown` for a mix, another class, or a class that could not be read."""
    classes = {gpu.pci_class for gpu in gpus}
    if len(classes) != 1:
        return "unknown"
    return {_VGA: "graphics", _3D: "compute"}.get(classes.pop() or 0, "unknown")


def _vgpu(gpus: tuple[Gpu, ...]) -> dict[str, str]:
    """GFD's vgpu labeler: vgpu.present, and on a vGPU guest the host's vGPU manager version and branch.
    Nothing where a GPU's config space could not be read (GFD logs 'unable to get vGPU devices')."""
    if any(gpu.vgpu is None for gpu in gpus):
        return {}
    guests = [gpu.vgpu for gpu in gpus if gpu.vgpu is not None and gpu.vgpu.present]
    labels = {"vgpu.present": str(bool(guests)).lower()}
    for guest in guests[-1:]:
        labels.update({"vgpu.host-driver-version": guest.host_driver_version,
                       "vgpu.host-driver-branch": guest.host_driver_branch})
    return labels


def with_timestamp(wanted: Mapping[str, str], published: Mapping[str, str], now: float) -> dict[str, str]:
    """`wanted` with nvidia.com/gfd.timestamp, the label in which GFD says when its labels were made: Unix
    seconds, as its internal/lm/timestamp.go writes them. GFD takes it once when it starts and writes the
    same value at every labeling pass (cmd/gpu-feature-discovery main_test.go, TestRunSleep, fails when the
    value changes between two passes). Here it is the time the agent last changed any of its labels:
    `published` (what the node or the NFD feature file has now) keeps its timestamp while every other label
    is as wanted, so a pass that changes nothing writes nothing; any change of another label takes a new one."""
    wanted = {key: value for key, value in wanted.items() if key != TIMESTAMP}
    kept = published.get(TIMESTAMP, "")
    same = {key: value for key, value in published.items() if key != TIMESTAMP} == wanted
    return {**wanted, TIMESTAMP: kept if same and _STAMP.fullmatch(kept) else str(int(now))}


def _sharing(labels: dict[str, str], shared: Mapping[str, Shared]) -> dict[str, str]:
    """As GFD writes sharing: the replica count and strategy (time-slicing or mps), -SHARED on the product
    of a resource shared under its own name, and mps.capable=true when MPS shares (GFD's sharing labeler:
    MIG-enabled GPUs, which MPS cannot share, leave nothing shared here)."""
    changed = {}
    for name, how in shared.items():
        changed[f"{name}.replicas"] = str(how.replicas)
        changed[f"{name}.sharing-strategy"] = how.strategy
        if how.strategy == "mps":
            changed["mps.capable"] = "true"
        product = labels.get(f"{name}.product")
        if product and not how.renamed:
            changed[f"{name}.product"] = sanitise(f"{product}-SHARED")
    return changed


def _versions(inventory: Inventory) -> dict[str, str]:
    driver = inventory.driver_version.split(".")
    major, minor, revision = (driver + ["", "", ""])[:3]
    cuda_major, _, cuda_minor = inventory.cuda_version.partition(".")
    return {
        "cuda.driver-version.major": major, "cuda.driver-version.minor": minor,
        "cuda.driver-version.revision": revision, "cuda.driver-version.full": inventory.driver_version,
        "cuda.driver.major": major, "cuda.driver.minor": minor, "cuda.driver.rev": revision,
        "cuda.runtime-version.major": cuda_major, "cuda.runtime-version.minor": cuda_minor,
        "cuda.runtime-version.full": inventory.cuda_version,
        "cuda.runtime.major": cuda_major, "cuda.runtime.minor": cuda_minor,
    }


_GPU = GPU_RESOURCE[len(RESOURCE_PREFIX):]


def _mig_name(device: MigDevice) -> str:
    """mig-1g.10gb, mig-1g.10gb.me, mig-1c.3g.40gb: the device plugin's resource name without nvidia.com/,
    GFD's name for its labels (go-nvlib's profile string, '+' as '.')."""
    return mig_resource(device.profile)[len(RESOURCE_PREFIX):]


def _mig_attributes(gpu: Gpu, device: MigDevice) -> dict[str, str]:
    """GFD's MIG device attributes (its nvmlDeviceGetAttributes): memory and engines of the GPU instance,
    slices of the GPU and compute instances, the compute instance's multiprocessors. Empty where the
    GPU instance or its profile is not in the inventory."""
    instance = next((gi for gi in gpu.mig.gpu_instances if gi.id == device.gpu_instance_id), None)
    profile = next((p for p in gpu.mig.profiles if instance is not None and p.name == instance.profile), None)
    compute = next((ci for ci in instance.compute_instances if ci.id == device.compute_instance_id), None) \
        if instance is not None else None
    if profile is None or compute is None:
        return {}
    return {
        "memory": str(device.memory_mib), "multiprocessors": str(device.multiprocessors),
        "slices.gi": str(profile.slices), "slices.ci": str(compute.slices),
        "engines.copy": str(profile.copy_engines), "engines.decoder": str(profile.decoders),
        "engines.encoder": str(profile.encoders), "engines.jpeg": str(profile.jpeg_engines),
        "engines.ofa": str(profile.ofa_engines),
    }


def _mixed(gpus: tuple[Gpu, ...], product: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    counts: dict[str, int] = {}
    for gpu in gpus:
        for device in gpu.mig.devices if gpu.mig.enabled else ():
            key = _mig_name(device)
            counts[key] = counts.get(key, 0) + 1
            labels.update({f"{key}.{name}": value for name, value in _mig_attributes(gpu, device).items()})
            labels.update({f"{key}.product": sanitise(f"{product}-MIG-{key[len('mig-'):]}"),
                           f"{key}.replicas": "1", f"{key}.sharing-strategy": "none"})
    labels.update({f"{key}.count": str(count) for key, count in counts.items()})
    return labels


def _single(gpus: tuple[Gpu, ...], product: str) -> dict[str, str]:
    """Every GPU in MIG mode with one profile throughout: the MIG devices stand in for GPUs.
    Anything else cannot be expressed with one resource: GFD's newInvalidMigStrategyLabeler."""
    devices = [(gpu, device) for gpu in gpus for device in (gpu.mig.devices if gpu.mig.enabled else ())]
    names = {_mig_name(device) for _, device in devices}
    uniform = all(gpu.mig.enabled and gpu.mig.devices for gpu in gpus) and len(names) == 1
    if not uniform:
        return {"gpu.product": sanitise(f"{product}-MIG-INVALID"), "gpu.count": "0", "gpu.memory": "0",
                "gpu.replicas": "0", "gpu.sharing-strategy": ""}
    gpu, device = devices[0]
    labels = {"gpu.product": sanitise(f"{product}-MIG-{_mig_name(device)[len('mig-'):]}"),
              "gpu.count": str(len(devices))}
    labels.update({f"gpu.{name}": value for name, value in _mig_attributes(gpu, device).items()})
    return labels


def _prefixed(labels: dict[str, str]) -> dict[str, str]:
    """With the prefix; a key or value Kubernetes would refuse is left out (and logged), so one odd
    name cannot make the API reject the whole patch."""
    result = {}
    for key, value in sorted(labels.items()):
        if valid_key(PREFIX + key) and valid_value(value):
            result[PREFIX + key] = value
        else:
            log.warning("label %s%s=%r is not valid in Kubernetes; left out", PREFIX, key, value)
    return result
