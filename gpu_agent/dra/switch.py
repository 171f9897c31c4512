"""A change of plugin.api waits until no pod holds a GPU of the API serving now: a pod keeps the devices it was
given, and the other API would hand the same GPUs out again.

Who holds GPUs: through the device plugin, the pods the kubelet's pod-resources API lists with an nvidia.com/
device; through DRA, the claims in the DRA plugin's checkpoint (the kubelet unprepares a claim once its last
pod ended). Between dra and both nothing changes hands (both serve through DRA): such a change is at once.
"""
from __future__ import annotations

from typing import Optional

from gpu_agent.config.plugin import serves_dra
from gpu_agent.dra.claims import CHECKPOINT, Checkpoint
from gpu_agent.host.paths import Root
from gpu_agent.metrics.pods import SOCKET, list_pod_resources

ASK_TIMEOUT_S = 5.0
MAX_NAMED = 5  # holders named in the message; the rest counted


async def holders(root: Root, api: str) -> list[str]:
    """What holds GPUs served through `api`, by name. Raises (OSError, grpclib's errors) where the kubelet
    cannot be asked: the caller keeps the API serving now."""
    if serves_dra(api):
        checkpoint = Checkpoint(root(CHECKPOINT))
        checkpoint.load()
        if checkpoint.error is not None:
            raise OSError(checkpoint.error)
        return sorted(f"claim {claim.namespace}/{claim.name}" for claim in checkpoint.claims.values())
    socket = root(SOCKET)
    if not socket.exists():
        return []  # no kubelet: no pod holds anything
    answer = await list_pod_resources(socket, ASK_TIMEOUT_S)
    return sorted(f"pod {pod.namespace}/{pod.name}" for pod in answer.pod_resources
                  if any(device.resource_name.startswith("nvidia.com/")
                         for container in pod.containers for device in container.devices))


def switch_now(serving: str, wanted: str) -> bool:
    """Whether going from `serving` to `wanted` moves GPUs between the APIs (else it is at once)."""
    return serves_dra(serving) == serves_dra(wanted)


def waiting(serving: str, wanted: str, held_by: list[str], error: Optional[str] = None) -> str:
    """/status api.switch: why the node still serves through `serving`."""
    if error is not None:
        return (f"plugin.api {wanted} waits: serving {serving} until no pod holds a GPU, and which do cannot be "
                f"read ({error})")
    named = ", ".join(held_by[:MAX_NAMED]) + (f" and {len(held_by) - MAX_NAMED} more" if len(held_by) > MAX_NAMED
                                             else "")
    return f"plugin.api {wanted} waits: serving {serving} until these end: {named}"
