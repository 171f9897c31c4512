"""One MPS control daemon as systemd knows it, and the record of what it was started with.

Under systemd each daemon is an instance of the packaged template systemd/gpu-agent-mps@.service, named
by its resource escaped as systemd-escape(1) does (nvidia.com/gpu: gpu-agent-mps@nvidia.com-gpu.service).
The unit derives the pipe and log directories from the instance (%I, the resource again); the one thing
an instance needs beyond its name, its GPUs, reaches it through the record below, which the unit reads
as its EnvironmentFile=. ExecStart= stays fixed in the unit.

The record, /run/nvidia/mps/<resource>/daemon.env, is written (temp, fsync, rename) before every start,
with or without systemd: CUDA_VISIBLE_DEVICES, and what the agent sets the daemon to (replicas, each
GPU's memory and index). It lies in the resource's directory, which the ledger holds and removes with
it. A later agent process reads it to know what an adopted daemon was started with: the control pipe
shows a daemon's thread percentage and memory limits, but not its GPUs, and its limits only in whole
GiB.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.layout import record_path, unit_name
from gpu_agent.numbers import decimal

VISIBLE = "CUDA_VISIBLE_DEVICES"
INDICES = "GPU_AGENT_MPS_GPU_INDICES"
MEMORY = "GPU_AGENT_MPS_GPU_MEMORY_MIB"
REPLICAS = "GPU_AGENT_MPS_REPLICAS"
THREADS = "GPU_AGENT_MPS_ACTIVE_THREAD_PERCENTAGE"  # only where limits are asked for, not derived from replicas
PINNED = "GPU_AGENT_MPS_PINNED_MEMORY_MIB"  # each GPU's, 0 for none; likewise
_MAX_BYTES = 64 << 10


def render(spec: DaemonSpec) -> str:
    return (f"# gpu-agent wrote this before it started the MPS control daemon of {spec.resource} "
            f"({unit_name(spec.resource)} reads it): its GPUs, and what gpu-agent sets it to.\n"
            f"{VISIBLE}={','.join(spec.gpus)}\n{INDICES}={','.join(map(str, spec.indices))}\n"
            f"{MEMORY}={','.join(map(str, spec.memory_mib))}\n{REPLICAS}={spec.replicas}\n"
            + (f"{THREADS}={spec.threads}\n" if spec.threads is not None else "")
            + (f"{PINNED}={','.join(map(str, spec.pinned_mib))}\n" if spec.pinned_mib is not None else ""))


def parse(resource: str, text: str) -> Optional[DaemonSpec]:
    """The spec a record holds; None for one that is incomplete or not gpu-agent's."""
    values = dict(line.partition("=")[::2] for line in text.splitlines() if line and not line.startswith("#"))
    if not {VISIBLE, INDICES, MEMORY, REPLICAS} <= values.keys():
        return None
    gpus = tuple(values[VISIBLE].split(","))
    indices = tuple(decimal(index) for index in values[INDICES].split(","))
    memory = tuple(decimal(mib) for mib in values[MEMORY].split(","))
    replicas = decimal(values[REPLICAS])
    if not all(gpus) or None in indices or None in memory or not replicas or \
            not len(gpus) == len(indices) == len(memory):
        return None
    threads = decimal(values[THREADS]) if THREADS in values else None
    pinned = tuple(decimal(mib) for mib in values[PINNED].split(",")) if PINNED in values else None
    if (THREADS in values and (threads is None or threads > 100)) or \
            (pinned is not None and (None in pinned or len(pinned) != len(gpus))):
        return None
    return DaemonSpec(resource, gpus, tuple(n for n in indices if n is not None),
                      tuple(n for n in memory if n is not None), replicas, threads,
                      None if pinned is None else tuple(n or 0 for n in pinned))


def write(root: Root, spec: DaemonSpec) -> None:
    """The record of `spec`, replaced; nothing written when it holds that already. OSError as the write's."""
    text = render(spec)
    path = root(record_path(spec.resource))
    if _read(path) == text:
        return
    atomic_write(path, text, 0o644)


def read(root: Root, resource: str) -> Optional[DaemonSpec]:
    """What the daemon of `resource` was last started with; None when no record says it."""
    text = _read(root(record_path(resource)))
    return None if text is None else parse(resource, text)


def _read(path: Path) -> Optional[str]:
    """The record's text; None when there is none, or it is no regular file, a link or too large."""
    try:
        data = read_bounded(path, _MAX_BYTES, follow=False)
    except (NotRegular, TooLarge, OSError):
        return None
    return None if data is None else data.decode(errors="replace")
