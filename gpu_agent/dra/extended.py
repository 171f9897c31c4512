"""plugin.api both: allowed only where the cluster serves `nvidia.com/gpu` through DRA.

With DRAExtendedResource (alpha in Kubernetes 1.34), a DeviceClass whose `spec.extendedResourceName` is
`nvidia.com/gpu` lets the scheduler satisfy a pod's `nvidia.com/gpu` request with a device of that class, on a
node whose allocatable does not hold `nvidia.com/gpu` itself (a node's device plugin would take it back). How
the agent tells: it lists the DeviceClasses and looks for such a class. An apiserver without the feature gate
drops the field from a class it stores, so a class that holds it also shows that the apiserver has the gate on
(the rig's test makes such a class on kube-apiserver 1.34 with the gate off and on, and reads it back). The
scheduler's own gate cannot be read from a node.

The node's own credentials may not list DeviceClasses (the `system:node` role grants none):
packaging/kubernetes/gpu-agent-deviceclass-reader.yaml grants list to the group `system:nodes`.

A definite answer decides: a class found, `both` holds; none, or no grant to look, `both` is refused and the
node serves `device-plugin` (the default), saying why. No answer (the apiserver unreachable) keeps what the
last answer decided, `both` as configured before the first: a node that served through DRA must not start
advertising `nvidia.com/gpu` from its device plugin while its pool may still be in the API.
"""
from __future__ import annotations

from typing import Any, Optional

from gpu_agent.kube.client import RESOURCE_API, ApiError
from gpu_agent.state import Verdict

EXTENDED_RESOURCE = "nvidia.com/gpu"
GRANT = "packaging/kubernetes/gpu-agent-deviceclass-reader.yaml"
RECHECK_S = 60.0
MAX_CLASSES = 500  # a cluster has a handful; more are not read


def verdict(classes: list[Any]) -> Verdict:
    """What the DeviceClasses the apiserver listed say of `both`."""
    for item in classes:
        spec = item.get("spec") if isinstance(item, dict) else None
        metadata = item.get("metadata") if isinstance(item, dict) else None
        if isinstance(spec, dict) and spec.get("extendedResourceName") == EXTENDED_RESOURCE \
                and isinstance(metadata, dict) and isinstance(metadata.get("name"), str):
            return Verdict(metadata["name"])
    return Verdict(None, f"no DeviceClass has spec.extendedResourceName {EXTENDED_RESOURCE} (the cluster does not "
                         "serve it through DRA: make one selecting driver gpu.nvidia.com's devices, on an apiserver "
                         "and scheduler with the DRAExtendedResource feature gate)")


def check(client: Any) -> Optional[Verdict]:
    """The verdict of the cluster's DeviceClasses, read with the node's credentials (a worker thread's call);
    None when the apiserver gave no answer (the last verdict stands)."""
    try:
        listed = client.list_device_classes(MAX_CLASSES)
    except ApiError as exc:
        if exc.status == 403:
            return Verdict(None, f"the node's credentials may not list DeviceClasses, so whether the cluster serves "
                                 f"{EXTENDED_RESOURCE} through DRA cannot be told: apply {GRANT} (from the package's "
                                 "documentation)")
        if exc.status == 404:
            return Verdict(None, f"the apiserver serves no {RESOURCE_API}/deviceclasses (DRA is GA in Kubernetes 1.34)")
        return None
    return verdict(listed)
