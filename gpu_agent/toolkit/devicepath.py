"""Which path a pod's GPU takes into its container on this node, and why: a pure decision over the
runtimes found, their versions and the kubelet's.

CDI reaches a container only where every link applies it:
- containerd applies CDI from 1.7 with `enable_cdi = true` in its CRI plugin, and by default from 2.0;
  1.6 accepts the key and ignores it (CDI README, "containerd configuration";
  https://github.com/cncf-tags/container-device-interface#containerd-configuration).
- CRI-O applies CDI by default, no switch (CDI README, "CRI-O configuration"), from 1.23.
- Docker applies CDI from 25 with `features.cdi` (CDI README, "Docker configuration"); Docker 20.10
  ignores the feature. Behind cri-dockerd no CDI reaches the CRI: the nvidia runtime path there.
- The kubelet passes a device plugin's CDI devices (the CDIDevices field) from 1.29 by default:
  KEP-4009, alpha in 1.28 behind the DevicePluginCDIDevices gate, beta (on) in 1.29, GA in 1.31
  (https://www.kubernetes.dev/resources/keps/4009/). An older kubelet still passes annotations,
  which containerd 1.7 and CRI-O read: cdi-annotations there.
- k3s, RKE2 and microk8s run their own kubelet on the containerd they embed: the same rules, with that
  containerd's version (k3s and RKE2 ship k3s-io's containerd, 1.7.23-k3s2 say; k3s 1.32 and later 2.0).
The CDI spec is also read outside the CRI, by the CLIs that take `--device nvidia.com/gpu=0` and apply the
spec themselves, with no switch: Podman from 4.1 (its release notes, 4.1.0, "CDI"; docker/cli#3864
says the same) and nerdctl from 2.1 (containerd/nerdctl#4170). Where one is installed the spec is written,
whatever the kubelet's path.
Elsewhere the GPU goes in through NVIDIA_VISIBLE_DEVICES, which only the nvidia runtime reads: it is
then the kubelet's runtime's default runtime (as `nvidia-ctk runtime configure --set-as-default` and
the GPU Operator make it), or pods name `runtimeClassName: nvidia`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from gpu_agent.numbers import version_numbers

STRATEGIES = ("cdi-cri", "cdi-annotations", "envvar")
CDI_SINCE = {"containerd": (1, 7), "crio": (1, 23), "docker": (25, 0)}
CDI_BY_DEFAULT = {"containerd": (2, 0), "crio": (1, 23)}  # no switch needed from these versions
KUBELET_CDI_DEVICES = (1, 29)
SWITCH = {"containerd": "enable_cdi", "docker": "features.cdi", "crio": "none (CDI is always on)"}
NODE_RUNTIMES = {"containerd": "containerd", "cri-o": "crio", "docker": "docker"}  # containerRuntimeVersion schemes
EMBEDDED = {"k3s": "containerd", "rke2": "containerd", "microk8s": "containerd"}  # their kubelet's, their runtime
CONSUMERS = {"podman": (4, 1), "nerdctl": (2, 1)}  # read CDI specs themselves (--device), from these versions
DISPLAY = {"containerd": "containerd", "docker": "Docker", "crio": "CRI-O", "k3s": "k3s", "rke2": "RKE2",
           "microk8s": "microk8s", "podman": "Podman", "nerdctl": "nerdctl"}


@dataclass(frozen=True)
class Found:
    """A container runtime on the node and its version, as read from `source`."""

    name: str  # containerd, docker, crio, k3s, rke2 or microk8s; podman or nerdctl (a CDI consumer)
    version: Optional[str] = None  # k3s, rke2, microk8s: their containerd's
    source: str = ""  # where the version was read: a package record, `containerd --version`, the Node

    @property
    def engine(self) -> str:
        """The runtime whose rules apply: containerd for the distributions that embed it."""
        return EMBEDDED.get(self.name, self.name)

    def describe(self) -> str:
        name = DISPLAY.get(self.name, self.name)
        if self.engine != self.name:
            return f"{name} (containerd {self.version or 'version unknown'})"
        return f"{name} {self.version}" if self.version else f"{name} (version unknown)"


@dataclass(frozen=True)
class Inputs:
    """What the decision reads; every field comes from the config or from the node."""

    setting: str = "auto"  # plugin.device_list_strategy
    plugin: bool = True  # the device plugin serves the kubelet
    spec: bool = True  # the agent writes the CDI spec and the runtimes' CDI switches (toolkit and toolkit.cdi on)
    set_as_default: Union[bool, str] = "auto"  # toolkit.set_as_default
    runtimes: tuple[Found, ...] = ()
    consumers: tuple[Found, ...] = ()  # Podman, nerdctl: read the CDI spec themselves
    kubelet: Optional[str] = None  # the kubelet's version
    kubelet_source: str = ""
    node_runtime: Optional[str] = None  # the Node's status.nodeInfo.containerRuntimeVersion


@dataclass(frozen=True)
class DevicePath:
    strategy: str  # what Allocate answers: cdi-cri, cdi-annotations or envvar
    chosen: bool  # True: auto chose it; False: plugin.device_list_strategy named it
    kubelet_runtime: Optional[str]  # the runtime the kubelet's pods run through
    cdi: tuple[str, ...]  # runtimes whose CDI switch the toolkit writes
    no_cdi: dict[str, str] = field(default_factory=dict)  # runtime: why no CDI switch is written there
    nvidia_default: tuple[str, ...] = ()  # runtimes where nvidia is made the default runtime
    spec_needed: bool = False  # some runtime, CDI consumer or the plugin names CDI devices
    consumers: tuple[str, ...] = ()  # the CDI consumers (Podman, nerdctl) that read the spec
    reason: str = ""
    warning: Optional[str] = None  # an explicit setting on a node where it cannot work
    readers: tuple[Found, ...] = ()  # what reads the CDI spec: the runtimes in `cdi`, then the consumers

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "chosen_by": "auto" if self.chosen else "config",
                "kubelet_runtime": self.kubelet_runtime, "cdi_runtimes": list(self.cdi),
                "no_cdi": dict(self.no_cdi), "nvidia_default": list(self.nvidia_default),
                "cdi_consumers": list(self.consumers), "cdi_spec_needed": self.spec_needed, "reason": self.reason,
                "warning": self.warning}

    def summary(self) -> str:
        text = f"{self.strategy} ({'auto' if self.chosen else 'set in the config'}): {self.reason}"
        return text + (f"; WARNING: {self.warning}" if self.warning else "")


def applies_cdi(runtime: Found, switch: bool) -> Optional[bool]:
    """Whether `runtime` puts CDI devices into containers, with its switch written (`switch`) or not;
    None when its version is unknown."""
    version = version_numbers(runtime.version)
    if version is None:
        return None
    if runtime.name in CONSUMERS:
        return version[:2] >= CONSUMERS[runtime.name]
    since = CDI_BY_DEFAULT.get(runtime.engine) if not switch else CDI_SINCE.get(runtime.engine)
    return since is not None and version[:2] >= since


def from_node(value: Optional[str]) -> Optional[Found]:
    """`containerd://1.6.20` (status.nodeInfo.containerRuntimeVersion) as a Found."""
    scheme, sep, version = (value or "").partition("://")
    name = NODE_RUNTIMES.get(scheme)
    return Found(name, version or None, "the Node's containerRuntimeVersion") if sep and name else None


def kubelet_runtime(inputs: Inputs) -> Optional[Found]:
    """The runtime the kubelet's pods run through, with the Node's version where it says one: the one the
    Node names; else k3s, RKE2 or microk8s (their own kubelet), CRI-O, containerd, Docker, the first found
    (a kubelet talks CRI: CRI-O or containerd before Docker, which needs cri-dockerd)."""
    found = {runtime.name: runtime for runtime in inputs.runtimes}
    node = from_node(inputs.node_runtime)
    if node is None:
        return next((found[name] for name in (*EMBEDDED, "crio", "containerd", "docker") if name in found), None)
    # The one whose version the Node reports; else k3s and RKE2, which run k3s-io's containerd (versions
    # ending in -k3sN), else microk8s, which runs containerd's own; else the runtime the Node names.
    node_version = version_numbers(node.version)
    same = tuple(name for name, runtime in found.items()
                 if node_version and version_numbers(runtime.version) == node_version)
    names = same + (("k3s", "rke2") if "-k3s" in (node.version or "") else ("microk8s", "containerd"))
    name = next((name for name in (*names, *EMBEDDED, node.name) if name in found and found[name].engine == node.name),
                None)
    if name is None:
        return node
    return dataclasses.replace(node, name=name) if node.version else found[name]


def choose(inputs: Inputs) -> DevicePath:
    pod_runtime = kubelet_runtime(inputs)
    runtimes = [pod_runtime if pod_runtime is not None and pod_runtime.name == runtime.name else runtime
                for runtime in inputs.runtimes]
    cdi, no_cdi = [], {}
    for runtime in runtimes:
        applies = applies_cdi(runtime, switch=True)
        if not inputs.spec:
            continue
        if applies is False:
            no_cdi[runtime.name] = (f"{runtime.describe()} does not apply CDI (from "
                                    f"{'.'.join(map(str, CDI_SINCE[runtime.engine]))}): no {SWITCH[runtime.engine]} "
                                    "written, it would be ignored")
        else:
            cdi.append(runtime.name)
    consumers = []
    for consumer in inputs.consumers if inputs.spec else ():
        if applies_cdi(consumer, switch=False) is False:
            no_cdi[consumer.name] = (f"{consumer.describe()} reads no CDI spec (from "
                                     f"{'.'.join(map(str, CONSUMERS[consumer.name]))})")
        else:
            consumers.append(consumer)
    strategy, reason, warning = _strategy(inputs, pod_runtime)
    envvar_default = inputs.plugin and strategy == "envvar" and pod_runtime is not None
    if inputs.set_as_default is True:
        nvidia_default = tuple(runtime.name for runtime in runtimes)
    elif inputs.set_as_default == "auto" and envvar_default and pod_runtime is not None:
        nvidia_default = (pod_runtime.name,)
        reason += f"; nvidia made {DISPLAY[pod_runtime.name]}'s default runtime (toolkit.set_as_default: auto)"
    else:
        nvidia_default = ()
        if envvar_default and pod_runtime is not None:
            reason += ("; toolkit.set_as_default is false: pods get their GPU only with runtimeClassName: nvidia "
                       "(packaging/kubernetes/gpu-agent-shim.yaml ships that RuntimeClass)")
    if consumers:
        reason += (f"; the CDI spec is written for {', '.join(consumer.describe() for consumer in consumers)}, "
                   "which read it themselves (--device nvidia.com/gpu=...)")
    spec_needed = bool(cdi) or bool(consumers) or (inputs.plugin and strategy != "envvar" and inputs.spec)
    readers = tuple(runtime for runtime in runtimes if runtime.name in cdi) + tuple(consumers)
    return DevicePath(strategy, inputs.setting == "auto", pod_runtime.name if pod_runtime else None, tuple(cdi),
                      no_cdi, nvidia_default, spec_needed, tuple(consumer.name for consumer in consumers), reason,
                      warning, readers)


def _strategy(inputs: Inputs, runtime: Optional[Found]) -> tuple[str, str, Optional[str]]:
    """(strategy, why, a warning for an explicit setting that cannot work here)."""
    kubelet = version_numbers(inputs.kubelet)
    kubelet_text = f"kubelet {inputs.kubelet}" if inputs.kubelet else "kubelet version unknown"
    if runtime is None:
        verdict = ("envvar", "no container runtime found (containerd, Docker, CRI-O): NVIDIA_VISIBLE_DEVICES, which "
                   "the nvidia runtime reads once it is the default of the kubelet's runtime")
    elif not inputs.spec:
        verdict = ("envvar", "the agent writes no CDI spec (toolkit.cdi.enabled false or the toolkit off): "
                   f"NVIDIA_VISIBLE_DEVICES through the nvidia runtime in {runtime.describe()}")
    else:
        applies = applies_cdi(runtime, switch=runtime.engine != "docker")
        if runtime.name == "docker":
            verdict = ("envvar", f"the kubelet runs pods through {runtime.describe()} (cri-dockerd), which passes no "
                       "CDI devices: NVIDIA_VISIBLE_DEVICES through the nvidia runtime")
        elif applies is False:
            verdict = ("envvar", f"{runtime.describe()} does not apply CDI (from "
                       f"{'.'.join(map(str, CDI_SINCE[runtime.engine]))}): NVIDIA_VISIBLE_DEVICES through the "
                       "nvidia runtime")
        elif kubelet is not None and kubelet[:2] < KUBELET_CDI_DEVICES:
            verdict = ("cdi-annotations", f"{runtime.describe()} applies CDI; {kubelet_text} passes no CDI devices "
                       "by default (from 1.29): cdi.k8s.io annotations, which the runtime reads")
        else:
            assumed = [what for what, known in ((runtime.describe(), applies is not None), (kubelet_text, kubelet))
                       if not known]
            verdict = ("cdi-cri", f"{runtime.describe()} applies CDI and {kubelet_text} passes CDI devices"
                       + (f" (assumed where unknown: {', '.join(assumed)})" if assumed else ""))
    strategy, reason = verdict
    if inputs.setting == "auto":
        return strategy, reason, None
    warning = None
    if inputs.setting != "envvar" and strategy == "envvar" and runtime is not None:
        warning = f"plugin.device_list_strategy {inputs.setting} names CDI devices, and here {reason.split(':')[0]}"
    return inputs.setting, f"plugin.device_list_strategy: {inputs.setting}; auto would choose {strategy}", warning
