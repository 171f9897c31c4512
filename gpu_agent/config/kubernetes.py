"""The kubernetes section: where the node's labels and condition go, and how they are computed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from gpu_agent.config.section import AbsolutePath, Section, seconds, setting


@dataclass(frozen=True)
class KubernetesConfig(Section):
    enabled: Union[bool, Literal["auto"]] = setting(
        "auto", "Publish labels and the GPUAgentReady condition; auto: when the kubeconfig exists.")
    kubeconfig: AbsolutePath = setting("/etc/kubernetes/kubelet.conf", "The node's own credentials (kubelet's).")
    node_name: Optional[str] = setting(
        None, "This node's name in the cluster; default: the hostname.", max_length=253)
    mig_strategy: Optional[Literal["none", "single", "mixed"]] = setting(None, "Deprecated: use mig.strategy.")
    nfd_feature_file: bool = setting(
        False, "Also write the labels to /etc/kubernetes/node-feature-discovery/features.d/gpu-agent.")
    request_timeout_seconds: float = seconds(10, 300, "How long one Kubernetes API request may take.")
