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
Elsewhere the GPU goes in through NVIDIA_VISIBLE_DEVICES, which only the nvidia runtime reads: it is
then the kubelet's runtime's default runtime (as `nvidia-ctk runtime configure --set-as-default` and
the GPU Operator make it), or pods name `runtimeClassName: nvidia`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

STRATEGIES = ("cdi-cri", "cdi-annotations", "envvar")
CDI_SINCE = {"containerd": (1, 7), "crio": (1, 23), "docker": (25, 0)}
CDI_BY_DEFAULT = {"containerd": (2, 0), "crio": (1, 23)}  # no switch needed from these versions
KUBELET_CDI_DEVICES = (1, 29)
SWITCH = {"containerd": "enable_cdi", "docker": "features.cdi", "crio": "none (CDI is always on)"}
NODE_RUNTIMES = {"containerd": "containerd", "cri-o": "crio", "docker": "docker"}  # containerRuntimeVersion schemes
DISPLAY = {"containerd": "containerd", "docker": "Docker", "crio": "CRI-O"}


@dataclass(frozen=True)
class Found:
    """A container runtime on the node and its version, as read from `source`."""

    name: str  # containerd, docker or crio
    version: Optional[str] = None
    source: str = ""  # where the version was read: a package record, `containerd --version`, the Node

    def describe(self) -> str:
        return f"{DISPLAY.get(self.name, self.name)} {self.version}" if self.version else \
            f"{DISPLAY.get(self.name, self.name)} (version unknown)"


@dataclass(frozen=True)
class Inputs:
    """What the decision reads; every field comes from the config or from the node."""

    setting: str = "auto"  # plugin.device_list_strategy
    plugin: bool = True  # the device plugin serves the kubelet
    spec: bool = True  # the agent writes the CDI spec and the runtimes' CDI switches (toolkit and toolkit.cdi on)
    set_as_default: Union[bool, str] = "auto"  # toolkit.set_as_default
    runtimes: tuple[Found, ...] = ()
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
    spec_needed: bool = False  # some runtime or the plugin names CDI devices
    reason: str = ""
    warning: Optional[str] = None  # an explicit setting on a node where it cannot work

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "chosen_by": "auto" if self.chosen else "config",
                "kubelet_runtime": self.kubelet_runtime, "cdi_runtimes": list(self.cdi),
                "no_cdi": dict(self.no_cdi), "nvidia_default": list(self.nvidia_default),
                "cdi_spec_needed": self.spec_needed, "reason": self.reason, "warning": self.warning}

    def summary(self) -> str:
        text = f"{self.strategy} ({'auto' if self.chosen else 'set in the config'}): {self.reason}"
        return text + (f"; WARNING: {self.warning}" if self.warning else "")


def version_tuple(version: Optional[str]) -> Optional[tuple[int, ...]]:
    """`1.6.20~ds1` -> (1, 6, 20); `v1.29.3+k3s1` -> (1, 29, 3); None when it holds no version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if not match:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def applies_cdi(runtime: Found, switch: bool) -> Optional[bool]:
    """Whether `runtime` puts CDI devices into containers, with its switch written (`switch`) or not;
    None when its version is unknown."""
    version = version_tuple(runtime.version)
    if version is None:
        return None
    since = CDI_BY_DEFAULT.get(runtime.name) if not switch else CDI_SINCE.get(runtime.name)
    return since is not None and version[:2] >= since


def from_node(value: Optional[str]) -> Optional[Found]:
    """`containerd://1.6.20` (status.nodeInfo.containerRuntimeVersion) as a Found."""
    scheme, sep, version = (value or "").partition("://")
    name = NODE_RUNTIMES.get(scheme)
    return Found(name, version or None, "the Node's containerRuntimeVersion") if sep and name else None


def kubelet_runtime(inputs: Inputs) -> Optional[Found]:
    """The runtime the kubelet's pods run through: the Node says; else CRI-O, containerd, Docker, the
    first one found (a kubelet talks CRI: CRI-O or containerd before Docker, which needs cri-dockerd)."""
    found = {runtime.name: runtime for runtime in inputs.runtimes}
    node = from_node(inputs.node_runtime)
    if node is not None:
        return node if node.version or node.name not in found else found[node.name]
    return next((found[name] for name in ("crio", "containerd", "docker") if name in found), None)


def choose(inputs: Inputs) -> DevicePath:
    node = from_node(inputs.node_runtime)
    runtimes = [node if node is not None and node.name == runtime.name and node.version else runtime
                for runtime in inputs.runtimes]
    cdi, no_cdi = [], {}
    for runtime in runtimes:
        applies = applies_cdi(runtime, switch=True)
        if not inputs.spec:
            continue
        if applies is False:
            no_cdi[runtime.name] = (f"{runtime.describe()} does not apply CDI (from "
                                    f"{'.'.join(map(str, CDI_SINCE[runtime.name]))}): no {SWITCH[runtime.name]} "
                                    "written, it would be ignored")
        else:
            cdi.append(runtime.name)
    pod_runtime = kubelet_runtime(dataclasses.replace(inputs, runtimes=tuple(runtimes)))
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
    spec_needed = bool(cdi) or (inputs.plugin and strategy != "envvar" and inputs.spec)
    return DevicePath(strategy, inputs.setting == "auto", pod_runtime.name if pod_runtime else None, tuple(cdi),
                      no_cdi, nvidia_default, spec_needed, reason, warning)


def _strategy(inputs: Inputs, runtime: Optional[Found]) -> tuple[str, str, Optional[str]]:
    """(strategy, why, a warning for an explicit setting that cannot work here)."""
    kubelet = version_tuple(inputs.kubelet)
    kubelet_text = f"kubelet {inputs.kubelet}" if inputs.kubelet else "kubelet version unknown"
    if runtime is None:
        verdict = ("envvar", "no container runtime found (containerd, Docker, CRI-O): NVIDIA_VISIBLE_DEVICES, which "
                   "the nvidia runtime reads once it is the default of the kubelet's runtime")
    elif not inputs.spec:
        verdict = ("envvar", "the agent writes no CDI spec (toolkit.cdi.enabled false or the toolkit off): "
                   f"NVIDIA_VISIBLE_DEVICES through the nvidia runtime in {runtime.describe()}")
    else:
        applies = applies_cdi(runtime, switch=runtime.name != "docker")
        if runtime.name == "docker":
            verdict = ("envvar", f"the kubelet runs pods through {runtime.describe()} (cri-dockerd), which passes no "
                       "CDI devices: NVIDIA_VISIBLE_DEVICES through the nvidia runtime")
        elif applies is False:
            verdict = ("envvar", f"{runtime.describe()} does not apply CDI (from "
                       f"{'.'.join(map(str, CDI_SINCE[runtime.name]))}): NVIDIA_VISIBLE_DEVICES through the "
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
