"""The kubernetes section: where the node's labels and condition go, and how they are computed."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from gpu_agent.config.section import AbsolutePath, Section, seconds


class KubernetesConfig(Section):
    enabled: Union[bool, Literal["auto"]] = Field(
        "auto", description="Publish labels and the GPUAgentReady condition; auto: when the kubeconfig exists.")
    kubeconfig: AbsolutePath = Field(
        "/etc/kubernetes/kubelet.conf", description="The node's own credentials (kubelet's)."
    )
    node_name: Optional[str] = Field(
        None, max_length=253, description="This node's name in the cluster; default: the hostname."
    )
    mig_strategy: Optional[Literal["none", "single", "mixed"]] = Field(
        None, description="Deprecated: use mig.strategy.")
    nfd_feature_file: bool = Field(
        False, description="Also write the labels to /etc/kubernetes/node-feature-discovery/features.d/gpu-agent.")
    request_timeout_seconds: float = seconds(10, 300, "How long one Kubernetes API request may take.")
