"""Where the MPS pieces live: on the host, each shared resource's pipe and log directories under
/run/nvidia/mps/<resource>/ and the tmpfs all daemons share, /run/nvidia/mps/shm (NVIDIA's --mps-root
default and its Root.PipeDir/LogDir/ShmDir layout); in a client container, the pipe directory under
/mps/ and that tmpfs as /dev/shm, the shared memory of MPS clients and their server (the control
daemon has it as its /dev/shm too: mps.launch, or the template unit's BindPaths=); the names systemd
knows them by."""
from __future__ import annotations

MPS_ROOT = "/run/nvidia/mps"
CONTAINER_ROOT = "/mps"  # NVIDIA's mps.ContainerRoot
SHM_DIR = f"{MPS_ROOT}/shm"  # NVIDIA's Root.ShmDir: one for all resources
CLIENT_SHM = "/dev/shm"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the control daemon writes it in its pipe directory
TEMPLATE = "gpu-agent-mps@.service"  # systemd/: one instance per resource (mps.instance)
SHM_UNIT = "run-nvidia-mps-shm.mount"  # systemd/: the tmpfs at SHM_DIR, under systemd
RECORD = "daemon.env"  # in the resource's directory: what its daemon was started with (mps.instance)


def resource_dir(resource: str) -> str:
    """/run/nvidia/mps/nvidia.com/gpu: one per shared resource."""
    return f"{MPS_ROOT}/{resource}"


def pipe_dir(resource: str) -> str:
    return f"{resource_dir(resource)}/pipe"


def log_dir(resource: str) -> str:
    return f"{resource_dir(resource)}/log"


def container_pipe_dir(resource: str) -> str:
    return f"{CONTAINER_ROOT}/{resource}/pipe"


def client_envs(resource: str) -> dict[str, str]:
    """What an MPS client in a container reads, as NVIDIA's plugin sets it."""
    return {PIPE_ENV: container_pipe_dir(resource)}


def client_mounts(resource: str) -> tuple[tuple[str, str], ...]:
    """(container path, host path): the pipe directory, and the daemons' tmpfs as /dev/shm."""
    return (container_pipe_dir(resource), pipe_dir(resource)), (CLIENT_SHM, SHM_DIR)


def escape(resource: str) -> str:
    """The resource as systemd-escape(1) writes it: `/` as `-`, what a unit name cannot hold (a `-`, a
    leading `.`) as \\xNN; systemd's %I gives the resource back."""
    escaped = []
    for n, char in enumerate(resource):
        if char == "/":
            escaped.append("-")
        elif char.isascii() and (char.isalnum() or char in ":_" or (char == "." and n > 0)):
            escaped.append(char)
        else:
            escaped.append("".join(f"\\x{byte:02x}" for byte in char.encode()))
    return "".join(escaped)


def unit_name(resource: str) -> str:
    """gpu-agent-mps@nvidia.com-gpu.service: the instance of the template for `resource`."""
    return TEMPLATE.replace("@", f"@{escape(resource)}")


def record_path(resource: str) -> str:
    """/run/nvidia/mps/nvidia.com/gpu/daemon.env: what the resource's daemon was last started with."""
    return f"{resource_dir(resource)}/{RECORD}"
