"""The figures of issue 15, one function each. Every function starts what it measures, measures it with its
same-run baselines, and returns Figures; `run.py` calls them in order and writes the results.

`Scale` holds the lengths: the full run (about 20 minutes) or BENCH_QUICK's short one for development.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from idle_memory import EXPORTER_ALL

from benchkit import (
    AGENT_CPU, BENCH, LOAD_CPU, PYTHON, REPO, Agent, AgentOptions, Figure, busy_jiffies, cpu_seconds,
    free_port, http_get, median, memory_mib, parse_importtime, percentile, pinned, pinned_to, wakeups,
)

GPU_AGENT = str(Path(PYTHON).parent / "gpu-agent")  # the console script a person types
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
WATCHDOG_USEC = 1_000_000  # a ping every 0.5 s, so a starved event loop shows as a gap well above 0.5 s
XID_FATAL = 79  # fallen off the bus: the GPU is unhealthy until reset


@dataclass(frozen=True)
class Scale:
    starts: int = 10  # spawn -> READY runs
    cli_runs: int = 10
    idle_s: float = 60.0
    reconciles: int = 5
    load_s: float = 30.0
    soak_minutes: float = 10.0
    soak_idle_s: float = 60.0
    xid_runs: int = 3
    cdi_runs: int = 20
    scrapes: int = 50
    scale_starts: int = 3  # spawn -> READY runs per machine size
    peer_s: float = 10.0
    storm_s: float = 120.0  # at least a minute: the node's API budget is per minute

    @classmethod
    def quick(cls) -> Scale:
        return cls(starts=3, cli_runs=3, idle_s=10.0, reconciles=2, load_s=5.0, soak_minutes=1.0,
                   soak_idle_s=15.0, xid_runs=1, cdi_runs=5, scrapes=10, scale_starts=1, peer_s=3.0, storm_s=60.0)


# --- shared set-ups ----------------------------------------------------------------------------------------

def machine_file(directory: Path, gpus: int, mig_devices: int = 0, name: str = "bench") -> Path:
    """A simulated machine of `gpus` H100s, each with `mig_devices` 1g.10gb MIG devices."""
    path = directory / f"{name}-{gpus}gpu-{mig_devices}mig.yaml"
    lines = [f"name: {name}-{gpus}", "gpus:", "  - model: H100-80GB-HBM3", f"    count: {gpus}"]
    if mig_devices:
        lines += ["    mig:", "      enabled: true", "      devices: [" + ", ".join(["1g.10gb"] * mig_devices) + "]"]
    path.write_text("\n".join(lines) + "\n")
    return path


MIG_YAML = """version: v1
mig-configs:
  all-1g:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  first-3g:
    - devices: [1, 2, 3, 4, 5, 6, 7]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [0]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""


class Cluster:
    """The API server emulator of tests/kube_emulator.py with this node's kubeconfig under an agent root."""

    NODE = "gpu-node-1"

    def __init__(self, directory: Path) -> None:
        if str(REPO / "tests") not in sys.path:
            sys.path.append(str(REPO / "tests"))  # after bench/: neither shadows the other
        from kube_emulator import KubeEmulator

        self.api = KubeEmulator(directory / "pki", nodes=(self.NODE,)).start()

    def install(self, root: Path) -> str:
        """Write the kubelet's kubeconfig under `root`; returns the agent settings that turn Kubernetes on."""
        self.api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
        return f"kubernetes:\n  enabled: true\n  node_name: {self.NODE}\n"

    def requests_between(self, start: float, end: float) -> list[Any]:
        return [r for r in self.api.requests if start <= r.time <= end]

    def close(self) -> None:
        self.api.close()


def all_stages(workdir: Path, cluster: Cluster, mig_config: str = "all-1g") -> str:
    """Settings with every stage on: driver, features, mig, discovery, toolkit, cdi, labels, owned files, and
    the device plugin (its kubelet directory exists; no kubelet listens there, tests/kubelet_standin is Go and
    built only by its tests, so the plugin waits for one as on a node whose kubelet is down)."""
    root = workdir / "root"
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpu-agent").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpu-agent/mig.yaml").write_text(MIG_YAML)
    return cluster.install(root) + f"mig:\n  config: {mig_config}\n"


def spawn_wall_ms(argv: list[str], cpu: int = AGENT_CPU) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   preexec_fn=pinned_to(cpu), timeout=120)
    return (time.perf_counter() - started) * 1000


def loadgen(port: int, path: str, rate: float, seconds: float, gzip: bool = False) -> dict[str, Any]:
    argv = [PYTHON, str(BENCH / "loadgen.py"), "--port", str(port), "--path", path, "--rate", str(rate),
            "--seconds", str(seconds)] + (["--gzip"] if gzip else [])
    done = subprocess.run(pinned(argv, LOAD_CPU), capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def events(path: Path, start: float, end: float) -> list[tuple[float, str, str]]:
    """The probe's event lines between two wall-clock times."""
    out: list[tuple[float, str, str]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        stamp, _, rest = line.partition(" ")
        kind, _, detail = rest.partition(" ")
        if start <= float(stamp) <= end:
            out.append((float(stamp), kind, detail))
    return out


def host_writes(evts: list[tuple[float, str, str]], root: Path) -> list[str]:
    """Files opened for writing, renamed, linked, removed or re-moded, the simulator's own machine state left
    out (its writes are the simulated hardware changing, counted as NVML mutations)."""
    sim_state = str(root / "var/lib/gpu-agent/sim")
    return [d for _, k, d in evts if (k == "write" and not d.startswith(sim_state))
            or (k == "change" and sim_state not in d)]


# --- 1, 2: start-up and the CLI ----------------------------------------------------------------------------

def startup(scale: Scale, tmp: Path) -> list[Figure]:
    pass_ms = [spawn_wall_ms([PYTHON, "-c", "pass"]) for _ in range(scale.starts)]
    web_ms = [spawn_wall_ms([PYTHON, "-c", "import aiohttp.web"]) for _ in range(scale.starts)]
    workdir = tmp / "startup"
    workdir.mkdir()
    # The first start converges the node and validates the config; the timed ones restart the agent as
    # systemd does, with the same config file, and find the node converged.
    first = Agent(workdir).start()
    first.stop()
    again = AgentOptions(port=first.port)
    ready_ms, rss = [], []
    for _ in range(scale.starts):
        agent = Agent(workdir, again).start()
        try:
            ready_ms.append((agent.ready_wall - agent.started_wall) * 1000)
            rss.append(memory_mib(agent.pid)["rss_mib"])
        finally:
            agent.stop()
    profiled = Agent(workdir, AgentOptions(env={"PYTHONPROFILEIMPORTTIME": "1"}, port=first.port))
    profiled.start().stop()
    edited = []  # a start after the config file changed
    for _ in range(3):
        agent = Agent(workdir).start()
        edited.append((agent.ready_wall - agent.started_wall) * 1000)
        agent.stop()
    imports = parse_importtime(profiled.log_path.read_text(errors="replace"))
    ready, base = median(ready_ms), median(pass_ms)
    return [Figure(1, "spawn → READY=1, converged dgx-h100 (median)", round(ready, 1), "ms",
                   "≤ 500 ms", ready <= 500,
                   {"python3 -c pass": f"{base:.0f} ms", "import aiohttp.web": f"{median(web_ms):.0f} ms",
                    "ratio": f"{ready / base:.1f}×", "after a config change": f"{median(edited):.0f} ms"},
                   {"ready_ms": ready_ms, "ready_ms_config_changed": edited, "pass_ms": pass_ms,
                    "aiohttp_web_ms": web_ms, "rss_at_ready_mib": rss,
                    "imports_one_start": imports},
                   note=f"imports {imports['imports_ms']:.0f} ms of one start (-X importtime, which adds its own "
                        f"cost); largest: {', '.join(imports['largest'][:4])}")]


def cli_status(scale: Scale, tmp: Path) -> list[Figure]:
    workdir = tmp / "cli"
    workdir.mkdir()
    with Agent(workdir).start() as agent:
        argv = [GPU_AGENT, "--root", str(agent.root), "--config", str(agent.config), "status"]
        spawn_wall_ms(argv)  # warm the page cache
        status_ms = [spawn_wall_ms(argv, cpu=LOAD_CPU) for _ in range(scale.cli_runs)]
        pass_ms = [spawn_wall_ms([PYTHON, "-c", "pass"], cpu=LOAD_CPU) for _ in range(scale.cli_runs)]
        profile = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    imports = parse_importtime(profile.stderr)
    value = median(status_ms)
    return [Figure(2, "`gpu-agent status`, daemon running (median)", round(value, 1), "ms", "≤ 150 ms",
                   value <= 150, {"python3 -c pass": f"{median(pass_ms):.0f} ms"},
                   {"status_ms": status_ms, "pass_ms": pass_ms, "imports": imports},
                   note=f"imports {imports['imports_ms']:.0f} ms; largest: {', '.join(imports['largest'][:4])}")]


# --- 3, 4: idle and the no-op reconcile --------------------------------------------------------------------

def idle(scale: Scale, tmp: Path, peer: Optional[dict[str, float]]) -> list[Figure]:
    workdir = tmp / "idle"
    workdir.mkdir()
    cluster = Cluster(workdir)
    try:
        settings = all_stages(workdir, cluster)
        with Agent(workdir, AgentOptions(settings=settings)).start() as agent:
            time.sleep(5)  # first samples, the XID watcher, lazily imported request paths
            status = json.loads(http_get(agent.port, "/status")[1])
            stages, plugin = status.get("stages", []), status.get("plugin")
            cpu_before, started, woken = cpu_seconds(agent.pid), time.monotonic(), wakeups(agent.pid)
            api_start = time.time()
            time.sleep(scale.idle_s)
            elapsed = time.monotonic() - started
            cpu_pct = (cpu_seconds(agent.pid) - cpu_before) / elapsed * 100
            per_s = {name: round((n - woken.get(name, 0)) / elapsed, 1) for name, n in wakeups(agent.pid).items()}
            per_s = {name: rate for name, rate in sorted(per_s.items(), key=lambda kv: -kv[1]) if rate > 0}
            memory = memory_mib(agent.pid)
            api = len(cluster.requests_between(api_start, time.time()))
    finally:
        cluster.close()
    stage_names = {s.get("name"): s.get("state") or s.get("status") for s in stages if isinstance(s, dict)}
    peer_note = {"node_exporter": f"{peer['cpu_pct']:.2f} % CPU, {peer['rss_mib']:.1f} MiB RSS"} if peer else {}
    details = {"stages": stage_names, "plugin": plugin, "seconds": scale.idle_s, "api_requests": api,
               "wakeups_per_s_by_thread": per_s, **memory}
    woke = ", ".join(f"{name} {rate}/s" for name, rate in list(per_s.items())[:5]) or "nothing"
    return [
        Figure(3, f"idle CPU over {scale.idle_s:g} s, all stages on", round(cpu_pct, 3), "% of a core", "≤ 0.1 %",
               cpu_pct <= 0.1, peer_note, details, note=f"thread wake-ups: {woke}"),
        Figure(3, "idle RSS / PSS, all stages on", round(memory["rss_mib"], 1), "MiB",
               "RSS ≤ 60 MiB", memory["rss_mib"] <= 60, {"PSS": f"{memory['pss_mib']:.1f} MiB", **peer_note},
               details),
    ]


def noop_reconcile(scale: Scale, tmp: Path) -> list[Figure]:
    """SIGHUP passes on a converged node: first timed on a plain agent, then counted on one run under
    bench/probe.py (whose audit hook costs CPU of its own, so it times nothing)."""
    passes: list[dict[str, Any]] = []
    counted: list[dict[str, Any]] = []
    for probed in (False, True):
        workdir = tmp / f"reconcile-{'probe' if probed else 'plain'}"
        workdir.mkdir()
        probe = workdir / "events.log"
        cluster = Cluster(workdir)
        try:
            settings = all_stages(workdir, cluster)
            options = AgentOptions(settings=settings, probe=probe if probed else None)
            with Agent(workdir, options).start() as agent:
                time.sleep(5)
                for _ in range(scale.reconciles):
                    time.sleep(1)
                    cpu_before = cpu_seconds(agent.pid)
                    hup = time.time()
                    os.kill(agent.pid, signal.SIGHUP)
                    ready = agent.notify.wait_for("READY=1", after=hup, timeout=60)
                    cpu = cpu_seconds(agent.pid) - cpu_before
                    time.sleep(1.0)  # anything the pass set off (a sink's patch) shows within this second
                    end = time.time()
                    if not probed:
                        passes.append({"wall_ms": (ready - hup) * 1000, "cpu_ms": cpu * 1000})
                        continue
                    evts = events(probe, hup, end)
                    counted.append({
                        "writes": host_writes(evts, agent.root),
                        "spawns": [d for _, k, d in evts if k == "spawn"],
                        "nvml_mutations": [d for _, k, d in evts if k == "nvml"],
                        "api_requests": [f"{r.method} {r.path}" for r in cluster.requests_between(hup, end)],
                    })
        finally:
            cluster.close()
    cpu_ms = median([p["cpu_ms"] for p in passes])
    wall_ms = median([p["wall_ms"] for p in passes])
    counts = {k: max(len(p[k]) for p in counted) for k in ("writes", "spawns", "nvml_mutations", "api_requests")}
    zero = not any(counts.values())
    text = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()).replace("writes", "file changes")
    return [
        Figure(4, "no-op reconcile (SIGHUP): CPU (median)", round(cpu_ms, 2), "ms", "≤ 10 ms on dgx-h100",
               cpu_ms <= 10, {}, {"passes": passes, "cpu_from": "the daemon threads' schedstat, SIGHUP to READY=1"}),
        Figure(4, "no-op reconcile: wall time, SIGHUP → READY=1 (median)", round(wall_ms, 1), "ms", "—", None, {},
               {}),
        Figure(4, "no-op reconcile: file changes, spawns, NVML mutations, API requests (most in one pass)",
               float(sum(counts.values())), "", "0 of each", zero, {}, {"counts": counts, "passes": counted},
               note=text),
    ]


# --- 5: endpoints under open-loop load ---------------------------------------------------------------------

def generator_capacity(scale: Scale) -> tuple[Figure, dict[str, Any]]:
    """The load generator against a server that does nothing, on the daemon's core: what it can send (3,000
    req/s asked), and the latency floor at the 1,000 req/s the endpoints get (the loopback, both processes'
    scheduling, and whatever else the machine runs meanwhile)."""
    port = free_port()
    server = subprocess.Popen([PYTHON, str(BENCH / "loadgen.py"), "--serve", str(port)],
                              preexec_fn=pinned_to(AGENT_CPU))
    try:
        time.sleep(0.5)
        seconds = max(3.0, scale.load_s / 5)
        capacity = loadgen(port, "/", 3000, seconds)
        floor = loadgen(port, "/", 1000, seconds)
    finally:
        server.terminate()
        server.wait(5)
    ok = capacity["achieved_rps"] >= 2900 and capacity["errors"] == 0
    figure = Figure(5, "load generator capacity (against a do-nothing server, 3,000 req/s asked)",
                    capacity["achieved_rps"], "req/s", "≥ 2,900 req/s: 3× what it must send", ok,
                    {"floor at 1,000 req/s": f"p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms, "
                                             f"p99.9 {floor['p999_ms']} ms"},
                    {"capacity": capacity, "floor": floor},
                    note="" if ok else "the generator could not send 3× the rate asked of it; latencies below "
                                       "are upper bounds")
    return figure, floor


def endpoints(scale: Scale, tmp: Path) -> list[Figure]:
    workdir = tmp / "endpoints"
    workdir.mkdir()
    profile = str(machine_file(workdir, 8, mig_devices=7))
    capacity, floor = generator_capacity(scale)
    figures = [capacity]
    goals = {"/readyz": ("p99 ≤ 2 ms, p99.9 ≤ 10 ms", lambda r: r["p99_ms"] <= 2 and r["p999_ms"] <= 10),
             "/status": ("p99 ≤ 10 ms", lambda r: r["p99_ms"] <= 10),
             "/metrics": ("≥ 1,000 req/s, p99 ≤ 10 ms (8 GPUs × 7 MIG)", _metrics_goal)}
    options = AgentOptions(profile=profile, watchdog_usec=WATCHDOG_USEC)
    with Agent(workdir, options).start() as agent:
        time.sleep(3)
        for path, (goal, met) in goals.items():
            figures.append(_under_load(scale, agent, path, f"{path} at 1,000 req/s for {scale.load_s:g} s, open "
                                       "loop: p99", goal, met, floor))
    figures.append(metrics_exporter_all(scale, tmp, floor))
    return figures


def _metrics_goal(result: dict[str, Any]) -> bool:
    return bool(result["achieved_rps"] >= 990 and result["p99_ms"] <= 10)


def _under_load(scale: Scale, agent: Agent, path: str, name: str, goal: str, met: Any,
                floor: dict[str, Any]) -> Figure:
    """`path` at 1,000 req/s for scale.load_s, open loop, with the agent's CPU, the machine's and the watchdog."""
    busy0, total0 = busy_jiffies()
    cpu0 = cpu_seconds(agent.pid)
    start = time.time()
    # gzip where a client asks for it: Prometheus does for /metrics, Go's HTTP client (a shim's) and curl
    # --compressed for /status, whose JSON is 300 kB plain on 8 GPUs with 7 MIG devices each (15 kB gzipped)
    result = loadgen(agent.port, path, 1000, scale.load_s, gzip=path in ("/metrics", "/status"))
    end = time.time()
    busy1, total1 = busy_jiffies()
    agent_cpu = cpu_seconds(agent.pid) - cpu0
    pings = agent.notify.times_of("WATCHDOG=1", start, end)
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    result["watchdog_gap_max_s"] = round(max(gaps), 3) if gaps else None
    result["watchdog_interval_s"] = WATCHDOG_USEC / 2e6
    result["agent_cpu_pct"] = round(agent_cpu / (end - start) * 100, 1)
    cores = os.cpu_count() or 1
    result["machine_busy_pct"] = round((busy1 - busy0) / max(total1 - total0, 1) * 100 * cores, 1)
    result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    ok = met(result) and result["errors"] == 0 and (result["watchdog_gap_max_s"] or 99) <= 1.0
    return Figure(
        5, name, result["p99_ms"], "ms", goal + "; no errors; watchdog gap ≤ 1 s", ok,
        {"p50": f"{result['p50_ms']} ms", "p99.9": f"{result['p999_ms']} ms",
         "served": f"{result['achieved_rps']} req/s", "shed 503": result["shed_503"],
         "queued for a connection": result["queued_for_a_connection"], "errors": result["errors"],
         "sent again after an idle close": result.get("retried_after_idle_close", 0),
         "watchdog gap": f"{result['watchdog_gap_max_s']} s", "generator floor p99": f"{floor['p99_ms']} ms",
         "machine busy": f"{result['machine_busy_pct']} % of {cores * 100} %"},
        result)


# The machine for /metrics with every dcgm-exporter 4.8 option on (idle_memory.EXPORTER_ALL), with something
# for each to write: pods on the kubelet's pod-resources socket and in the API emulator (labels the allowlist
# keeps and drops), processes of those pods on time-sliced GPUs, an hpc_job directory.
SHARED_MACHINE = """name: bench-shared
gpus:
  - model: H100-80GB-HBM3
    count: 4
    mig: {enabled: true, devices: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]}
  - model: H100-80GB-HBM3
    count: 4
"""
REPLICAS = 4  # time-slicing replicas of each whole GPU, each held by its own pod


def _exporter_node(workdir: Path, cluster: Cluster) -> tuple[Path, Any]:
    """The machine (4 GPUs × 7 MIG devices, 4 whole GPUs time-sliced 4 ways), its pods in the API emulator
    and on a pod-resources stand-in (tests/test_pod_labels.py's, grpcio), a process of each pod on its GPU,
    and hpc_job files; returns the machine file and the stand-in, to stop."""
    if str(REPO / "tests") not in sys.path:
        sys.path.append(str(REPO / "tests"))
    from test_pod_labels import Kubelet, response

    from gpu_agent.host.paths import Root
    from gpu_agent.sim.machine import MachineState

    root = workdir / "root"
    profile = workdir / "shared.yaml"
    profile.write_text(SHARED_MACHINE)
    machine = MachineState(Root(root))
    machine.ensure(str(profile))
    pods, jobs = [], {}
    with machine.edit() as doc:
        for index, gpu in enumerate(doc["gpus"]):
            jobs[str(index)] = f"job-{index}\n" + ("job-shared\n" if index % 2 else "")
            instances = (gpu.get("mig") or {}).get("gpu_instances") or []
            if instances:  # a pod on each MIG device
                ids = [ci["uuid"] for gi in instances for ci in gi["compute_instances"]]
                pods += [(f"mig-{index}-{n}", device_id, None) for n, device_id in enumerate(ids)]
                continue
            for replica in range(REPLICAS):
                uid = f"{index:08x}-0000-4000-8000-{replica:012x}"
                pods.append((f"shared-{index}-{replica}", f"{gpu['uuid']}::{replica}", uid))
                gpu.setdefault("processes", []).append(
                    {"pid": 1000 + index * 10 + replica, "name": "python3", "used_mib": 1024 * (replica + 1),
                     "sm_util": 10 + replica, "pod_uid": uid})
    for name, text in jobs.items():
        (root / "run/slurm").mkdir(parents=True, exist_ok=True)
        (root / "run/slurm" / name).write_text(text)
    kubelet = Kubelet(root)
    answer = []
    for n, (name, device_id, uid) in enumerate(pods):
        uid = uid or f"{n:08x}-1111-4000-8000-000000000000"
        cluster.api.add_pod("ml", name, Cluster.NODE, uid,
                            {"app": "llm", "app.kubernetes.io/name": name, "team": "research", "tier": "gpu"})
        answer.append(("ml", name, {"main": {"nvidia.com/gpu": [device_id]}}))
    kubelet.answer = response(*answer)
    return profile, kubelet


def metrics_exporter_all(scale: Scale, tmp: Path, floor: dict[str, Any]) -> Figure:
    """/metrics at 1,000 req/s with every dcgm-exporter 4.8 option on (issue 36)."""
    workdir = tmp / "endpoints-exporter-all"
    workdir.mkdir()
    cluster = Cluster(workdir)
    try:
        profile, kubelet = _exporter_node(workdir, cluster)
        try:
            settings = cluster.install(workdir / "root") + EXPORTER_ALL
            options = AgentOptions(profile=str(profile), settings=settings, watchdog_usec=WATCHDOG_USEC)
            with Agent(workdir, options).start() as agent:
                body = _attributed_metrics(agent)
                first, next_ = _second_boundary_scrapes(agent.port, max(5, int(scale.load_s) // 2))
                figure = _under_load(scale, agent, "/metrics", f"/metrics at 1,000 req/s for {scale.load_s:g} s, "
                                     "every dcgm-exporter 4.8 option on: p99",
                                     "≥ 1,000 req/s, p99 ≤ 10 ms (4 GPUs × 7 MIG, 4 × 4 time-sliced, 44 pods)",
                                     _metrics_goal, floor)
                figure.baselines["/metrics"] = f"{len(body)} bytes"
                figure.details["metrics_bytes"] = len(body)
                figure.details["series_with_pod_uid"] = body.count(b'pod_uid="')
                figure.baselines["first scrape of a second"] = (f"{median(first):.2f} ms (the next "
                                                                f"{median(next_):.2f} ms)")
                figure.details["first_scrape_of_a_second_ms"], figure.details["next_scrape_ms"] = first, next_
                return figure
        finally:
            kubelet.stop()
    finally:
        cluster.close()


def _second_boundary_scrapes(port: int, seconds: int) -> tuple[list[float], list[float]]:
    """A gzip /metrics just after each second of the monotonic clock begins (when the agent renders its body
    again, daemon/http.py's this_second) and another right after it (served from the cache), in ms: what a
    render costs the scrape that meets it, apart from the machine's load."""
    first, following = [], []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        for _ in range(seconds):
            time.sleep(1.005 - time.monotonic() % 1)
            first.append(_gzip_scrape(connection))
            following.append(_gzip_scrape(connection))
    return [round(ms, 3) for ms in first], [round(ms, 3) for ms in following]


def _gzip_scrape(connection: socket.socket) -> float:
    """One keep-alive GET /metrics with gzip on `connection`, read to its end; its time in ms."""
    started = time.perf_counter()
    connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: gzip\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += connection.recv(65536)
    return (time.perf_counter() - started) * 1000


def _attributed_metrics(agent: Agent, timeout: float = 60) -> bytes:
    """/metrics once the pods' UIDs and replicas, the per-process series, hpc_job and the DCGM_EXP_* series are
    on it (the pods listed and a sample taken after), so the load measures them. Pod labels are not: with
    virtual_gpus no series carries them, in dcgm-exporter as in the agent (docs/metrics.md)."""
    deadline = time.monotonic() + timeout
    body = b""
    while time.monotonic() < deadline:
        status, body = http_get(agent.port, "/metrics")
        shares = [line for line in body.split(b"\n") if line.startswith(b"DCGM_FI_DEV_FB_USED{") and b"pod_uid" in line]
        if (status == 200 and shares and b'vgpu="' in body and b'hpc_job="' in body
                and b"DCGM_EXP_P2P_STATUS{" in body):
            return body
        time.sleep(0.5)
    raise RuntimeError("/metrics never showed pod_uid, vgpu, hpc_job, the per-process and DCGM_EXP_* series: "
                       + body.decode(errors="replace")[-1500:])


# --- 6: RSS soak -------------------------------------------------------------------------------------------

class _SoakTarget:
    def __init__(self, agent: Agent) -> None:
        self.port = agent.port
        self.socket_path = agent.root / "run/gpu-agent/agent.sock"


def soak(scale: Scale, tmp: Path) -> tuple[list[Figure], dict[str, Any]]:
    """bench/soak.py's mixed and abusive load against an agent with Kubernetes on; the API requests it sends
    meanwhile are the fleet arithmetic's steady state (HTTP load causes none)."""
    from soak import Load, Tally

    workdir = tmp / "soak"
    workdir.mkdir()
    cluster = Cluster(workdir)
    try:
        settings = all_stages(workdir, cluster)
        with Agent(workdir, AgentOptions(settings=settings)).start() as agent:
            time.sleep(5)
            target, tally = _SoakTarget(agent), Tally()
            asyncio.run(Load(target, tally, 200).overload_burst(1))  # type: ignore[arg-type]
            before = median([_sleep_then(memory_mib, agent.pid)["rss_mib"] for _ in range(5)])
            start = time.time()
            asyncio.run(Load(target, tally, 200).run(scale.soak_minutes * 60))  # type: ignore[arg-type]
            end = time.time()
            peak = memory_mib(agent.pid)["rss_mib"]
            time.sleep(scale.soak_idle_s)
            after = median([_sleep_then(memory_mib, agent.pid)["rss_mib"] for _ in range(5)])
            api = cluster.requests_between(start, end)
    finally:
        cluster.close()
    growth = after - before
    steady = {"seconds": end - start, "requests": len(api),
              "by_kind": _by_kind(api), "per_hour": len(api) / (end - start) * 3600}
    details = {"minutes": scale.soak_minutes, "idle_s": scale.soak_idle_s, "requests": tally.requests,
               "failed": tally.failed, "by_status": tally.by_status, "rss_before_mib": before,
               "rss_end_of_load_mib": peak, "rss_after_mib": after}
    return [Figure(6, f"RSS after {scale.soak_minutes:g} min mixed load + {scale.soak_idle_s:g} s idle, growth",
                   round(growth, 2), "MiB", "≤ 2 MiB over idle", growth <= 2,
                   {"idle before": f"{before:.1f} MiB", "end of load": f"{peak:.1f} MiB"}, details)], steady


def _sleep_then(fn: Any, *args: Any) -> Any:
    time.sleep(1)
    return fn(*args)


def _by_kind(records: list[Any]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in records:
        key = f"{r.method} {'nodes/status' if r.path.endswith('/status') else 'nodes'}"
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


# --- 7: XID -> 503 and -> condition ------------------------------------------------------------------------

def _inject_xid(root: Path, gpu: int, xid: int) -> float:
    """What `gpu-agent sim inject-xid` does, from here so that time zero is the moment the event exists."""
    from gpu_agent.host.paths import Root
    from gpu_agent.sim.machine import MachineState

    with MachineState(Root(root)).edit() as state:
        state["xids"].append({"seq": state["next_seq"], "gpu": gpu, "xid": xid, "at": time.time()})
        state["next_seq"] += 1
    return time.time()


def xid(scale: Scale, tmp: Path) -> list[Figure]:
    to_503, to_patch = [], []
    for run in range(scale.xid_runs):
        workdir = tmp / f"xid{run}"
        workdir.mkdir()
        cluster = Cluster(workdir)
        try:
            settings = cluster.install(workdir / "root")
            with Agent(workdir, AgentOptions(settings=settings)).start() as agent:
                time.sleep(3)
                t0 = _inject_xid(agent.root, 3, XID_FATAL)
                deadline = t0 + 30
                while time.time() < deadline and http_get(agent.port, "/readyz")[0] != 503:
                    time.sleep(0.002)
                if time.time() < deadline:
                    to_503.append((time.time() - t0) * 1000)
                while time.time() < deadline:
                    patches = [r for r in cluster.requests_between(t0, time.time())
                               if r.method == "PATCH" and r.path.endswith("/status") and b'"False"' in r.body]
                    if patches:
                        to_patch.append((patches[0].time - t0) * 1000)
                        break
                    time.sleep(0.01)
        finally:
            cluster.close()
    fig_503 = median(to_503) if to_503 else None
    fig_patch = median(to_patch) if to_patch else None
    return [
        Figure(7, f"XID {XID_FATAL} → /readyz 503 (median)", fig_503, "ms", "≤ 1 s (bench's goal)",
               fig_503 is not None and fig_503 <= 1000, {}, {"runs_ms": to_503},
               note="" if to_503 else "no 503 within 30 s"),
        Figure(7, f"XID {XID_FATAL} → GPUAgentReady=False patch in the API emulator (median)", fig_patch, "ms",
               "≤ 5 s (bench's goal)", fig_patch is not None and fig_patch <= 5000, {}, {"runs_ms": to_patch},
               note="" if to_patch else "no condition patch within 30 s"),
    ]


def storm(scale: Scale, tmp: Path) -> dict[str, Any]:
    """API requests while a GPU's health flaps: an XID every 2 s on rotating GPUs, cleared between."""
    workdir = tmp / "storm"
    workdir.mkdir()
    cluster = Cluster(workdir)
    try:
        settings = cluster.install(workdir / "root")
        with Agent(workdir, AgentOptions(settings=settings)).start() as agent:
            time.sleep(3)
            start = time.time()
            n = 0
            while time.time() - start < scale.storm_s:
                _inject_xid(agent.root, n % 8, XID_FATAL)
                time.sleep(1)
                agent.cli("sim", "clear")
                time.sleep(1)
                n += 1
            end = time.time()
            api = cluster.requests_between(start, end)
    finally:
        cluster.close()
    return {"seconds": end - start, "xids": n, "requests": len(api), "by_kind": _by_kind(api),
            "per_hour": len(api) / (end - start) * 3600}


# --- 8, 9: MIG ---------------------------------------------------------------------------------------------

def mig_change(scale: Scale, tmp: Path) -> list[Figure]:
    workdir = tmp / "mig"
    workdir.mkdir()
    probe = workdir / "events.log"
    cluster = Cluster(workdir)
    try:
        settings = all_stages(workdir, cluster, "all-1g")
        with Agent(workdir, AgentOptions(settings=settings, probe=probe)).start() as agent:
            time.sleep(2)
            agent.config.write_text(agent.config.read_text().replace("config: all-1g", "config: first-3g"))
            hup = time.time()
            os.kill(agent.pid, signal.SIGHUP)
            ready = agent.notify.wait_for("READY=1", after=hup, timeout=120)
            time.sleep(0.5)
            evts = events(probe, hup, time.time())
    finally:
        cluster.close()
    mutations = [d for _, k, d in evts if k == "nvml"]
    by_gpu: dict[str, int] = {}
    for m in mutations:
        gpu = m.split()[-1]
        by_gpu[gpu] = by_gpu.get(gpu, 0) + 1
    others = sum(v for g, v in by_gpu.items() if g != "0")
    wall = (ready - hup) * 1000
    return [
        Figure(8, "MIG change on GPU 0 of 8 (7×1g → 2×3g), SIGHUP → READY=1", round(wall, 1), "ms", "—", None, {},
               {"mutations_by_gpu": by_gpu}),
        Figure(8, "MIG change: NVML mutations on the other seven GPUs", float(others), "", "0", others == 0,
               {"on GPU 0": by_gpu.get("0", 0)}, {"mutations": mutations}),
    ]


def cdi_generation(scale: Scale, tmp: Path) -> list[Figure]:
    workdir = tmp / "cdi"
    workdir.mkdir()
    profile = str(machine_file(workdir, 8, mig_devices=7))
    Agent(workdir, AgentOptions(profile=profile)).start().stop()  # converge: libraries, device nodes
    done = subprocess.run([PYTHON, str(BENCH / "cdi_time.py"), str(workdir / "root"), str(scale.cdi_runs)],
                          capture_output=True, text=True, timeout=300, preexec_fn=pinned_to(AGENT_CPU))
    if done.returncode != 0:
        raise RuntimeError(f"cdi_time.py failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    value = median(result["times_ms"])
    return [Figure(9, "CDI spec generation, dgx-h100 with 7 MIG devices per GPU (median)", round(value, 2), "ms",
                   "—", None, {"spec": f"{result['spec_bytes']} bytes, {result['cdi_devices']} devices"}, result)]


# --- 10: scale ---------------------------------------------------------------------------------------------

def scale_figures(scale: Scale, tmp: Path) -> list[Figure]:
    figures = []
    for gpus in (1, 8, 16, 64):
        workdir = tmp / f"scale{gpus}"
        workdir.mkdir()
        options = AgentOptions(profile=str(machine_file(workdir, gpus)))
        Agent(workdir, options).start().stop()
        starts = []
        for _ in range(scale.scale_starts - 1):
            agent = Agent(workdir, options).start()
            starts.append((agent.ready_wall - agent.started_wall) * 1000)
            agent.stop()
        with Agent(workdir, options).start() as agent:
            starts.append((agent.ready_wall - agent.started_wall) * 1000)
            ready_ms = median(starts)
            time.sleep(3)
            status, body = http_get(agent.port, "/metrics")
            cpu0 = cpu_seconds(agent.pid)
            latencies = []
            for _ in range(scale.scrapes):
                started = time.perf_counter()
                http_get(agent.port, "/metrics")
                latencies.append((time.perf_counter() - started) * 1000)
            cpu_per_scrape = (cpu_seconds(agent.pid) - cpu0) / scale.scrapes * 1000
            rss = memory_mib(agent.pid)["rss_mib"]
        figures.append(Figure(
            10, f"scale: {gpus} GPU{'s' if gpus > 1 else ''} (READY, converged, median of {len(starts)})",
            round(ready_ms, 1), "ms", "—", None,
            {"RSS": f"{rss:.1f} MiB", "/metrics": f"{len(body)} bytes", "CPU per scrape": f"{cpu_per_scrape:.2f} ms"},
            {"gpus": gpus, "ready_ms": starts, "rss_mib": rss, "metrics_bytes": len(body), "metrics_status": status,
             "cpu_per_scrape_ms": cpu_per_scrape, "scrape_p50_ms": percentile(latencies, 50)}))
    return figures


# --- 11: the peer ------------------------------------------------------------------------------------------

def peer(scale: Scale, tmp: Path) -> tuple[list[Figure], Optional[dict[str, float]]]:
    """Debian's prometheus-node-exporter beside the agent: idle RSS and CPU, /metrics latency at a scrape rate
    both can serve (20 req/s), measured back to back in this run."""
    if not Path(NODE_EXPORTER).exists():
        return [Figure(11, "prometheus-node-exporter side by side", None, "", "—", None, {},
                       note="prometheus-node-exporter is not installed (the bench installs it with apt-get when "
                            "run as root)")], None
    workdir = tmp / "peer"
    workdir.mkdir()
    port = free_port()
    exporter = subprocess.Popen([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned_to(AGENT_CPU))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if http_get(port, "/metrics")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        cpu0, t0 = cpu_seconds(exporter.pid), time.monotonic()
        time.sleep(scale.peer_s)
        exporter_idle_cpu = (cpu_seconds(exporter.pid) - cpu0) / (time.monotonic() - t0) * 100
        exporter_load = loadgen(port, "/metrics", 20, scale.peer_s, gzip=True)
        exporter_rss = memory_mib(exporter.pid)["rss_mib"]
    finally:
        exporter.terminate()
        exporter.wait(10)
    with Agent(workdir).start() as agent:
        time.sleep(3)
        agent_load = loadgen(agent.port, "/metrics", 20, scale.peer_s, gzip=True)
        agent_rss = memory_mib(agent.pid)["rss_mib"]
    rss_ratio = agent_rss / exporter_rss
    p50_ratio = agent_load["p50_ms"] / exporter_load["p50_ms"]
    done = subprocess.run([NODE_EXPORTER, "--version"], capture_output=True, text=True, timeout=30)
    version = (done.stdout or done.stderr).split("\n")[0]
    peer_figures = {"cpu_pct": exporter_idle_cpu, "rss_mib": exporter_rss}
    details = {"node_exporter": exporter_load, "agent": agent_load, "node_exporter_version": version,
               "node_exporter_rss_mib": exporter_rss, "agent_rss_mib": agent_rss}
    return [
        Figure(11, "RSS, agent (dgx-h100) ÷ node_exporter", round(rss_ratio, 2), "×", "—", None,
               {"agent": f"{agent_rss:.1f} MiB", "node_exporter": f"{exporter_rss:.1f} MiB"}, details),
        Figure(11, "/metrics p50 at 20 req/s, agent ÷ node_exporter", round(p50_ratio, 2), "×", "—", None,
               {"agent": f"{agent_load['p50_ms']} ms (p99 {agent_load['p99_ms']})",
                "node_exporter": f"{exporter_load['p50_ms']} ms (p99 {exporter_load['p99_ms']})"}, {}),
    ], peer_figures


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def new_tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gpu-agent-bench-"))
