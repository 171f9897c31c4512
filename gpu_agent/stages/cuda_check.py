"""Host-native CUDA validation (the GPU Operator's vectorAdd check): through ctypes on libcuda.so.1,
cuInit, count the devices, and on each create a context and allocate and free memory.

It runs in a child process with a timeout: a CUDA call can hang on a sick GPU, and a context left
in the daemon would hold GPU memory for as long as the agent runs.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Optional

from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import ldcache, proc
from gpu_agent.host.paths import Root, resolve
from gpu_agent.numbers import decimal

TIMEOUT_S = 120.0
ALLOCATION = 1 << 20
LIBCUDA = "libcuda.so.1"


def find_libcuda(root: Root) -> Path:
    """libcuda.so.1 where the dynamic loader finds it: through the ld.so cache under the root, so a
    driver under a non-distribution prefix (/usr/local/nvidia/lib64) is found too."""
    try:
        host_path = ldcache.find(root, LIBCUDA)
    except AgentError as exc:
        raise StageError(f"CUDA validation (driver.validate_cuda): cannot find {LIBCUDA}: {exc}") from None
    real = resolve(root, host_path) if host_path is not None else None
    if real is None:
        raise StageError(f"CUDA validation (driver.validate_cuda): the ld.so cache under {root.path} leads to "
                         f"no {LIBCUDA}; install the driver's CUDA library (libcuda) and run ldconfig")
    return root(real)


def run(root: Root, expected_gpus: Optional[int] = None) -> str:
    """A note for the stage's message; raises StageError when CUDA cannot use a GPU."""
    library = find_libcuda(root)
    code = (f"import sys; sys.path[:0] = {sys.path!r}; "
            f"from gpu_agent.stages.cuda_check import main; sys.exit(main({str(library)!r}))")
    done = proc.run([sys.executable, "-I", "-c", code], timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise StageError(f"CUDA validation failed: {done.output or f'exit status {done.returncode}'}")
    words = done.stdout.split()
    count = decimal(words[-1]) if words else None  # our last line; the library may print before it
    if count is None:
        raise StageError(f"CUDA validation printed no device count: {done.output[-200:]!r}")
    if expected_gpus is not None and count < expected_gpus:
        raise StageError(f"CUDA validation: CUDA sees {count} devices, {expected_gpus} GPUs are present")
    return f"CUDA validated on {count} device{'s' if count != 1 else ''}"


def main(library: str) -> int:
    """In the child: exit 0 and print the device count, or print the failing call and exit 1."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError as exc:
        print(f"cannot load {library}: {exc}", file=sys.stderr)
        return 1

    def check(call: str, result: int) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(result, ctypes.byref(name))
            print(f"{call} returned {(name.value or b'?').decode()} ({result})", file=sys.stderr)
            raise SystemExit(1)

    check("cuInit", cuda.cuInit(0))
    count = ctypes.c_int()
    check("cuDeviceGetCount", cuda.cuDeviceGetCount(ctypes.byref(count)))
    for ordinal in range(count.value):
        device = ctypes.c_int()
        check(f"cuDeviceGet({ordinal})", cuda.cuDeviceGet(ctypes.byref(device), ordinal))
        context = ctypes.c_void_p()
        check(f"cuCtxCreate on device {ordinal}", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
        pointer = ctypes.c_uint64()
        check(f"cuMemAlloc on device {ordinal}", cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(ALLOCATION)))
        check(f"cuMemFree on device {ordinal}", cuda.cuMemFree_v2(pointer))
        check(f"cuCtxDestroy on device {ordinal}", cuda.cuCtxDestroy_v2(context))
    print(count.value)
    return 0
