"""Run `python -m gpu_agent ...` while counting what it does to the host, without strace.

    python bench/probe.py EVENTS -m gpu_agent --root R --simulate dgx-h100 run

Appends one line per event to EVENTS, `<wall time> <kind> <detail>`:
- `write PATH`: a file opened for writing (Python's audit event "open" with a write flag);
- `change EVENT PATH`: a rename, link, symlink, removal, mkdir, chmod, chown, truncate or utime;
- `spawn ARGV0`: a subprocess, an exec, a fork or a posix_spawn (audit events);
- `nvml CALL GPU`: a mutating call into the simulated NVML (nvmlDevice/GpuInstance/ComputeInstance +
  Set*, Create*, Destroy*, Reset*, Clear*),
  counted by wrapping the simulator's methods, with the GPU index it touched.
The bench reads the lines between two moments (before and after a SIGHUP) and counts them. Audit hooks
see every open and spawn made through Python, which is all the agent does; C extensions that write on
their own (none here) would be missed.
"""
from __future__ import annotations

import functools
import os
import re
import runpy
import sys
import time
from typing import Any, Callable

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR
_CHANGE_EVENTS = {"os.rename", "os.symlink", "os.link", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                  "os.truncate", "os.utime"}
_REMOVALS = ("os.remove", "os.rmdir")
_SPAWN_EVENTS = {"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty"}
_MUTATING = re.compile(r"^nvml(Device|GpuInstance|ComputeInstance)(Set|Create|Destroy|Reset|Clear)\w*$")


def _emit(fd: int, kind: str, detail: str) -> None:
    os.write(fd, f"{time.time():.6f} {kind} {detail}\n".encode(errors="replace"))


def _hook(fd: int) -> Callable[[str, tuple[Any, ...]], None]:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, _, flags = args
            if isinstance(flags, int) and flags & _WRITE_FLAGS and isinstance(path, (str, bytes)):
                shown = os.fsdecode(path)
                if not shown.startswith(("/dev/", "/proc/")):
                    _emit(fd, "write", shown)
        elif event in _CHANGE_EVENTS:
            first = args[0] if args else "?"
            shown = os.fsdecode(first) if isinstance(first, (str, bytes)) else str(first)
            # The hook runs before the call: a mkdir of a directory that exists (exist_ok) or a removal of
            # nothing changes nothing, and is not counted.
            exists = os.path.lexists(shown)
            pointless = (event in ("os.mkdir", "os.symlink") and exists) or (event in _REMOVALS and not exists)
            if not pointless and not shown.startswith(("/dev/pts", "/proc/")):
                _emit(fd, "change", f"{event} {shown}")
        elif event in _SPAWN_EVENTS:
            first = args[0] if args else "?"
            _emit(fd, "spawn", os.fsdecode(first) if isinstance(first, (str, bytes)) else event)
    return hook


def _wrap_simulated_nvml(fd: int) -> None:
    from gpu_agent.sim.fake import FakeNvml

    for name in dir(FakeNvml):
        if not _MUTATING.match(name):
            continue
        method = getattr(FakeNvml, name)

        def counted(*args: Any, __method: Any = method, __name: str = name, **kwargs: Any) -> Any:
            target = args[1] if len(args) > 1 else None
            gpu = getattr(target, "gpu", "-")
            _emit(fd, "nvml", f"{__name} {gpu}")
            return __method(*args, **kwargs)

        setattr(FakeNvml, name, functools.wraps(method)(counted))


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: probe.py EVENTS -m MODULE [ARGS...]")
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    module = sys.argv[3]
    _wrap_simulated_nvml(fd)
    sys.argv = [module, *sys.argv[4:]]
    sys.addaudithook(_hook(fd))
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
