"""Device-path stage: which way a pod's GPU reaches its container on this node (CDI in the CRI, CDI
annotations, or NVIDIA_VISIBLE_DEVICES through the nvidia runtime), and why; and whether a CDI
consumer outside the CRI (Podman, nerdctl) needs the spec. It changes nothing; the
toolkit (CDI switches, the default runtime), the cdi stage (the spec) and the device plugin (what
Allocate answers) follow its choice. The decision itself is toolkit.devicepath.choose."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpu_agent.config.plugin import PluginConfig, plugin_wanted
from gpu_agent.config.toolkit import ToolkitConfig
from gpu_agent.host.paths import Root
from gpu_agent.stages.base import Stage
from gpu_agent.stages.toolkit import found_runtimes
from gpu_agent.toolkit.devicepath import CONSUMERS, EMBEDDED, DevicePath, Found, Inputs, choose, from_node
from gpu_agent.toolkit.versions import Versions

log = logging.getLogger(__name__)

NodeInfo = Callable[[], Optional[dict[str, Any]]]  # the Node's status.nodeInfo, None without the API


@dataclass(frozen=True)
class Observed:
    path: DevicePath
    versions: dict[str, str]  # runtime or kubelet: "1.6.20 (package containerd)"


class DevicePathStage(Stage):
    name = "device-path"
    produces = ("device_path",)

    def __init__(self, root: Root, plugin: PluginConfig, toolkit: ToolkitConfig, versions: Versions,
                 node_info: Optional[NodeInfo] = None) -> None:
        self.root = root
        self.plugin = plugin
        self.toolkit = toolkit
        self.versions = versions
        self.node_info = node_info
        self._said: Optional[str] = None

    def observe(self) -> Observed:
        info = (self.node_info() if self.node_info is not None else None) or {}
        node_runtime, node_kubelet = _text(info.get("containerRuntimeVersion")), _text(info.get("kubeletVersion"))
        read: dict[str, str] = {}
        runtimes = [self._found(name, read) for name in found_runtimes(self.root, self.toolkit)]
        consumers = [self._found(name, read) for name in CONSUMERS if self.versions.installed(name)]
        # k3s, RKE2 and microk8s run their own kubelet: its version is theirs
        kubelet_of = next((f"{runtime.name}-kubelet" for runtime in runtimes if runtime.name in EMBEDDED), "kubelet")
        kubelet, source = (node_kubelet, "the Node's kubeletVersion") if node_kubelet else \
            self.versions.read(kubelet_of)
        read["kubelet"] = f"{kubelet} ({source})" if kubelet else f"unknown ({source})"
        node = from_node(node_runtime)
        if node is not None:
            read["node_runtime"] = node_runtime or ""
        inputs = Inputs(setting=self.plugin.device_list_strategy, plugin=plugin_wanted(self.root, self.plugin),
                        spec=self.toolkit.enabled and self.toolkit.cdi.enabled,
                        set_as_default=self.toolkit.set_as_default, runtimes=tuple(runtimes),
                        consumers=tuple(consumers), kubelet=kubelet,
                        kubelet_source=source, node_runtime=node_runtime)
        return Observed(choose(inputs), read)

    def _found(self, name: str, read: dict[str, str]) -> Found:
        version, source = self.versions.read(name)
        read[name] = f"{version} ({source})" if version else f"unknown ({source})"
        return Found(name, version, source)

    def verify(self, observed: Observed) -> str:
        summary = observed.path.summary()
        if observed.path.warning and summary != self._said:
            log.warning("device path: %s", summary)
        self._said = summary
        return summary

    def outputs(self, observed: Observed) -> dict[str, Any]:
        return {"device_path": observed.path}

    def facts(self, observed: Any) -> dict[str, Any]:
        if not isinstance(observed, Observed):
            return {}
        return {**observed.path.to_json(), "versions": observed.versions}


def _text(value: Any) -> Optional[str]:
    return value[:100] if isinstance(value, str) and value else None
