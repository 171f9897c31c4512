"""The kubernetes section: where the node's labels and condition go, and how they are computed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from gpu_agent.config.section import AbsolutePath, Bounds, Check, Section, seconds, setting, shown
from gpu_agent.kube.names import MAX_NODE_NAME, node_name_problem


def _node_name(value: str) -> str:
    problem = node_name_problem(value)
    if problem:
        raise ValueError(f"{shown(value)} {problem}")
    return value


NodeName = Annotated[str, Bounds(max_length=MAX_NODE_NAME), Check(_node_name)]


@dataclass(frozen=True)
class KubernetesConfig(Section):
    enabled: Union[bool, Literal["auto"]] = setting(
        "auto", "Publish labels and the GPUAgentReady condition; auto: when the kubeconfig exists.")
    kubeconfig: AbsolutePath = setting("/etc/kubernetes/kubelet.conf", "The node's own credentials (kubelet's).")
    node_name: Optional[NodeName] = setting(
        None, "This node's name in the cluster; default: the hostname, in lower case (as the kubelet's).")
    mig_strategy: Optional[Literal["none", "single", "mixed"]] = setting(None, "Deprecated: use mig.strategy.")
    nfd_feature_file: bool = setting(
        False, "Also write the labels to /etc/kubernetes/node-feature-discovery/features.d/gpu-agent "
        "(with enabled: false too: the file needs no API server).")
    request_timeout_seconds: float = seconds(10, 300, "How long one Kubernetes API request may take.")
