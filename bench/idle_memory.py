"""What the agent holds at idle in bench/gpu_rss.py's configuration (driver, toolkit and Kubernetes off:
it reads NVML, samples metrics, watches XIDs, serves its endpoints), on a simulated node, broken down so
a cut can be aimed and its effect shown. Not part of `make bench` or `make test`:

    .venv/bin/python bench/idle_memory.py [--profile dgx-h100] [--idle-seconds 30] [--json out.json]

It converges a fresh simulated root once with the driver stage on (the simulated driver starts unloaded,
a real node's is loaded), then starts `gpu-agent run` read-only twice:

1. plainly, for the figures: RSS, PSS, USS (smaps_rollup) and the resident set by kind of mapping (thread
   stacks, heap, other anonymous memory, each file's mappings), the threads by name; beside it the same
   interpreter after `import pynvml` (no NVML library here, so no nvmlInit);
2. under this script's `--inside` wrapper, which records every module imported with the module that
   imported it first, and at SIGUSR2 after the idle time writes `sys.modules` and a tracemalloc snapshot (the
   wrapper and tracemalloc cost memory of their own, so this run gives no RSS figure). A module counts as
   the simulator's when gpu_agent.sim imported it first, directly or through modules it imported first:
   a real node never loads those.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SETTINGS = """driver:
  enabled: {driver}
toolkit:
  enabled: false
kubernetes:
  enabled: false
"""
# --exporter-all: every dcgm-exporter 4.8 option of docs/metrics.md on (no kubelet or API server here:
# the pod attribution runs and says why it has nothing, as on a node before its first pod).
EXPORTER_ALL = """metrics:
  pod_labels: true
  pod_uid: true
  pod_kubernetes_labels: true
  pod_label_allowlist_regex: ['^app']
  virtual_gpus: true
  hpc_job_mapping_dir: /run/slurm
  hostname_label: hostname
  exporter_series: [DCGM_EXP_XID_ERRORS_COUNT, DCGM_EXP_CLOCK_EVENTS_COUNT, DCGM_EXP_GPU_HEALTH_STATUS,
                    DCGM_EXP_P2P_STATUS]
"""
_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def smaps_by_kind(pid: int) -> dict[str, float]:
    """Resident KiB by kind of mapping: a thread's stack is an anonymous mapping of 8 MiB (glibc's default;
    its guard page is a mapping of its own), the main thread's is [stack]; a file's mappings go by its name."""
    kinds: dict[str, float] = {}
    size_kib, name = 0, ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            header = _SMAPS_HEADER.match(line)
            if header:
                start, end, name = int(header[1], 16), int(header[2], 16), header[3].strip()
                size_kib = (end - start) // 1024
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
                if not name:
                    kind = "thread stacks (8 MiB anonymous)" if size_kib in (8192, 8188) else "anonymous"
                elif name.startswith("/"):
                    kind = os.path.basename(name)
                else:
                    kind = name
                kinds[kind] = kinds.get(kind, 0) + rss
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def rollup(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Anonymous"):
            out[key] = int(rest.split()[0]) / 1024
    out["Uss"] = out.pop("Private_Clean") + out.pop("Private_Dirty")
    return {k: round(v, 2) for k, v in out.items()}


def threads(pid: int) -> list[str]:
    return sorted((Path(f"/proc/{pid}/task") / tid / "comm").read_text().strip()
                  for tid in os.listdir(f"/proc/{pid}/task"))


def settle(pid: int, seconds: float) -> dict[str, float]:
    """The rollup with the median RSS of one sample a second over the last five seconds of `seconds`."""
    time.sleep(max(0.0, seconds - 5))
    samples = []
    for _ in range(5):
        samples.append(rollup(pid))
        time.sleep(1)
    samples.sort(key=lambda s: s["Rss"])
    return samples[len(samples) // 2]


class Run:
    """`gpu-agent run` on the converged simulated root, ready when READY=1 arrives."""

    def __init__(self, workdir: Path, profile: str, wrapper: Optional[Path] = None) -> None:
        self.workdir, self.profile = workdir, profile
        notify_path = workdir / "notify.sock"
        notify_path.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(notify_path))
        self.notify.settimeout(120)
        head = [sys.executable, __file__, "--inside", str(wrapper)] if wrapper else [sys.executable]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "WATCHDOG_"))}
        with open(workdir / "agent.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*head, "-m", "gpu_agent", "--root", str(workdir / "root"), "--config", str(workdir / "run.yaml"),
                 "--simulate", profile, "run"], env={**env, "NOTIFY_SOCKET": str(notify_path)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while "READY=1" not in self.notify.recv(65536).decode().splitlines():
            pass

    def stop(self) -> None:
        self.notify.close()
        self.proc.terminate()
        self.proc.wait(30)


def prepare(workdir: Path, profile: str, exporter_all: bool = False) -> None:
    (workdir / "root").mkdir()
    for name, driver in (("apply.yaml", "true"), ("run.yaml", "false")):
        (workdir / name).write_text("version: v1\nhttp:\n  listen: 127.0.0.1:0\n  socket: /run/gpu-agent/bench.sock\n"
                                    + SETTINGS.format(driver=driver)
                                    + (EXPORTER_ALL if exporter_all and name == "run.yaml" else ""))
    subprocess.run([sys.executable, "-m", "gpu_agent", "--root", str(workdir / "root"), "--config",
                    str(workdir / "apply.yaml"), "--simulate", profile, "apply", "--once"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, timeout=300)


def baseline(seconds: float) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-c", "import pynvml, sys; print('ready', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        return {"rollup_mib": settle(proc.pid, seconds), "modules": None}
    finally:
        proc.kill()
        proc.wait(30)


def module_count() -> int:
    out = subprocess.run([sys.executable, "-c", "import sys, pynvml; print(len(sys.modules))"], text=True,
                         capture_output=True, check=True, timeout=60)
    return int(out.stdout)


def summarise_inside(dump: dict[str, Any]) -> dict[str, Any]:
    importer: dict[str, str] = dump["importer"]

    def of_sim(name: str) -> bool:
        seen = set()
        while name and name not in seen:
            if name == "gpu_agent.sim" or name.startswith("gpu_agent.sim."):
                return True
            seen.add(name)
            name = importer.get(name, "")
        return False

    modules = dump["modules"]
    sim = sorted(m for m in modules if of_sim(m))
    sim_kib = sum(kib for m, kib in dump["by_gpu_agent_module_kib"].items() if of_sim(m))
    return {"modules": len(modules), "modules_of_the_simulator": len(sim),
            "simulator_modules": sim, "traced_kib": dump["traced_kib"],
            "traced_kib_of_the_simulator": round(sim_kib), "by_module_kib": dump["by_module_kib"],
            "by_gpu_agent_module_kib": dump["by_gpu_agent_module_kib"],
            "by_gpu_agent_line_kib": dump["by_gpu_agent_line_kib"], "imported_first_by": importer,
            "thread_stack_size": dump["stack_size"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="dgx-h100")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--no-inside", action="store_true", help="skip the second (tracemalloc) run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--exporter-all", action="store_true", help="every dcgm-exporter 4.8 option on")
    args = parser.parse_args()
    report: dict[str, Any] = {"python": sys.version.split()[0], "profile": args.profile,
                              "exporter_all": args.exporter_all}
    report["python_import_pynvml"] = baseline(args.idle_seconds)
    report["python_import_pynvml"]["modules"] = module_count()
    with tempfile.TemporaryDirectory(prefix="gpu-agent-idle-") as tmp:
        workdir = Path(tmp)
        prepare(workdir, args.profile, args.exporter_all)
        run = Run(workdir, args.profile)
        try:
            report["agent"] = {"rollup_mib": settle(run.proc.pid, args.idle_seconds),
                               "resident_kib_by_mapping": smaps_by_kind(run.proc.pid),
                               "threads": threads(run.proc.pid)}
        finally:
            run.stop()
        if not args.no_inside:
            dump_path = workdir / "inside.json"
            run = Run(workdir, args.profile, wrapper=dump_path)
            try:
                time.sleep(args.idle_seconds)
                run.proc.send_signal(signal.SIGUSR2)
                deadline = time.monotonic() + 120
                while not dump_path.exists() and time.monotonic() < deadline:
                    time.sleep(1)
                time.sleep(1)
            finally:
                run.stop()
            report["agent"]["inside"] = summarise_inside(json.loads(dump_path.read_text()))
    agent, base = report["agent"]["rollup_mib"], report["python_import_pynvml"]["rollup_mib"]
    report["agent_minus_baseline_rss_mib"] = round(agent["Rss"] - base["Rss"], 2)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    short = {k: v for k, v in report.items() if k != "agent"}
    short["agent"] = {k: v for k, v in report["agent"].items() if k != "inside"}
    short["agent"]["resident_kib_by_mapping"] = dict(list(short["agent"]["resident_kib_by_mapping"].items())[:12])
    if "inside" in report["agent"]:
        inside = report["agent"]["inside"]
        short["agent"]["inside"] = {k: v for k, v in inside.items()
                                    if k not in ("simulator_modules", "imported_first_by")}
        for key in ("by_module_kib", "by_gpu_agent_module_kib", "by_gpu_agent_line_kib"):
            short["agent"]["inside"][key] = dict(list(inside[key].items())[:25])
    print(json.dumps(short, indent=1))
    return 0


# --- the --inside wrapper: runs in the agent's process ------------------------------------------------------

def _importer_hook(importer: dict[str, str]) -> Any:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "import" or args[0] in importer:
            return
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or frame.f_globals.get("__name__", "").startswith("importlib")):
            frame = frame.f_back  # type: ignore[assignment]
        importer[args[0]] = frame.f_globals.get("__name__", "") if frame is not None else ""
    return hook


@functools.cache
def _package_of(filename: str) -> str:
    """A traced file's module (dotted, from its path under sys.path); the path itself where none fits."""
    best = ""
    for entry in [str(REPO), *sys.path]:
        if entry and filename.startswith(entry.rstrip("/") + "/") and len(entry) > len(best):
            best = entry.rstrip("/")
    if not best:
        return filename
    rel = filename[len(best) + 1:]
    rel = rel[:-3] if rel.endswith(".py") else rel
    return rel.replace("/", ".").removesuffix(".__init__")


def _dump_on(signalled: threading.Event, path: Path, importer: dict[str, str]) -> None:
    import tracemalloc

    signalled.wait()
    snapshot = tracemalloc.take_snapshot()
    by_module: dict[str, int] = {}
    by_agent: dict[str, int] = {}
    by_line: dict[str, int] = {}
    for trace in snapshot.traces:
        frames = [f for f in reversed(trace.traceback) if not f.filename.startswith("<frozen")]  # innermost first
        module = _package_of(frames[0].filename) if frames else "(importlib)"
        by_module[module] = by_module.get(module, 0) + trace.size
        own = next((f for f in frames if _package_of(f.filename).startswith("gpu_agent")), None)
        agent = _package_of(own.filename) if own else "(none)"
        by_agent[agent] = by_agent.get(agent, 0) + trace.size
        line = f"{agent}:{own.lineno}" if own else "(none)"
        by_line[line] = by_line.get(line, 0) + trace.size

    def kib(d: dict[str, int]) -> dict[str, int]:
        return {k: round(v / 1024) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 1024}

    path.write_text(json.dumps({
        "modules": sorted(sys.modules), "importer": importer,
        "traced_kib": round(tracemalloc.get_traced_memory()[0] / 1024),
        "by_module_kib": kib(by_module), "by_gpu_agent_module_kib": kib(by_agent),
        "by_gpu_agent_line_kib": kib(by_line),
        "stack_size": threading.stack_size()}))


def inside(dump: Path, argv: list[str]) -> None:
    import tracemalloc

    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: idle_memory.py --inside DUMP -m MODULE [ARGS...]")
    tracemalloc.start(40)
    importer: dict[str, str] = {}
    sys.addaudithook(_importer_hook(importer))
    signalled = threading.Event()
    signal.signal(signal.SIGUSR2, lambda *_: signalled.set())
    threading.Thread(target=_dump_on, args=(signalled, dump, importer), daemon=True).start()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--inside":
        inside(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(main())
