"""`make bench`: every figure against the simulation, into bench/results.json and bench/README.md's
table (between `<!-- bench:begin -->` and `<!-- bench:end -->`).

    python bench/run.py [--quick] [--only 1,5,10] [--no-readme]

BENCH_QUICK=1 (or --quick) runs everything short, for development; the full run takes about 20 minutes.
As root it installs Debian's prometheus-node-exporter with apt-get when it is missing (the peer of item 11),
and runs itself in a private network namespace (`unshare -n`) so no other process's traffic shares the
loopback it measures; otherwise it says which of these it could not do. The daemon under test is pinned to
CPU 0 and the load generator and the bench to CPU 1; the CPU the rest of the machine used meanwhile is
reported beside the load figures.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import figures as fig
from benchkit import LOAD_CPU, REPO, Figure, can_pin, machine_facts, render_table, update_readme, write_results

IN_NETNS = "GPU_AGENT_BENCH_NETNS"
KUBELET_REQUESTS_PER_HOUR = 3600 / 10 + 3600 / 10  # node status every 10 s + Lease renewal every 10 s
NODES = 5000


def ensure_node_exporter(notes: list[str]) -> None:
    if Path(fig.NODE_EXPORTER).exists():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        notes.append("prometheus-node-exporter is missing and this is not a root Debian: item 11 not measured")
        return
    print("installing prometheus-node-exporter with apt-get (the peer of item 11)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                 "prometheus-node-exporter"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            notes.append(f"apt-get could not install prometheus-node-exporter: {done.stderr.strip()[-300:]}")
            return
    # The package starts its own service where systemd runs; the bench starts the binary itself.
    notes.append("installed prometheus-node-exporter with apt-get")


def reexec_in_netns(notes: list[str]) -> None:
    """Run the rest of the bench in a private network namespace with only loopback, when we can."""
    if os.environ.get(IN_NETNS):
        return
    if os.geteuid() != 0 or not shutil.which("unshare"):
        notes.append("not root: the daemons share the host's network namespace")
        return
    if subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode != 0:
        notes.append("unshare -n refused (no CAP_SYS_ADMIN here): the daemons share the host's network namespace")
        return
    script = "ip link set lo up 2>/dev/null || true; exec \"$@\""
    env = {**os.environ, IN_NETNS: "1", "GPU_AGENT_BENCH_NOTES": "\n".join(notes)}
    os.execvpe("unshare", ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, *sys.argv], env)


def fleet_section(steady: Optional[dict[str, Any]], storm: Optional[dict[str, Any]]) -> str:
    if not steady or not storm:
        return "Fleet arithmetic: not measured in this run."
    kubelet_fleet = KUBELET_REQUESTS_PER_HOUR * NODES / 3600
    rows = []
    for name, m in (("steady state", steady), ("storm (an XID every 2 s, cleared after 1 s)", storm)):
        per_node = m["per_hour"]
        fleet = per_node * NODES / 3600
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(m["by_kind"].items())) or "none"
        rows.append(f"| {name} | {m['requests']} in {m['seconds']:.0f} s ({kinds}) | {per_node:.0f} | "
                    f"{fleet:.2f} req/s | {fleet / kubelet_fleet * 100:.2f} % |")
    return "\n".join([
        "Fleet arithmetic (measured from the API emulator's request log, tests/kube_emulator.py):",
        "",
        f"| agent at | requests seen | per node per hour | {NODES:,} nodes | of the kubelets' own |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"The kubelets' own traffic at {NODES:,} nodes, counted this way: the Node status every 10 s "
        "(`nodeStatusUpdateFrequency`, default 10 s) and the node's Lease renewed every 10 s, "
        f"{KUBELET_REQUESTS_PER_HOUR:.0f} requests per node per hour, {kubelet_fleet:,.0f} req/s in all. "
        "Since node leases (KEP 0009, Efficient Node Heartbeats) the kubelet posts its status only when it "
        "changes or every `nodeStatusReportFrequency` (5 min), so a current kubelet's floor is nearer 372 per node "
        "per hour (517 req/s at 5,000 nodes), and the agent's share of it is 1.9× the last column. Sources: "
        "https://kubernetes.io/docs/reference/node/node-status/ (heartbeats: .status updates and the Lease), "
        "https://kubernetes.io/docs/reference/config-api/kubelet-config.v1beta1/ (the two frequencies) and "
        "https://github.com/kubernetes/enhancements/blob/0460fcf4637d440ce7d539a931e44dae931f9849/keps/sig-node/"
        "0009-node-heartbeat.md (the 10 s heartbeat that leases were made to relieve). "
        "The agent's requests are capped by its node-wide budget (gpu_agent/kube/budget.py: 12 a minute), "
        "so no storm can exceed 720 per node per hour.",
    ])


HOW_TO_READ = """How to read it: every figure is measured by `make bench` on the simulated nodes of gpu_agent/sim, on
the machine named above, with its baselines taken in the same run (the same interpreter starting `pass`,
Debian's prometheus-node-exporter beside the agent). Times are medians unless the row says otherwise; latencies
under load are open loop (each request is due at its time, and late answers are charged from that time, so
a stall is never hidden) and include the loopback round trip. "miss" means the row's goal is not met on
this run; the cause is in bench/results.json (`note` and `details`) and in the text below the table. The daemon
runs pinned to CPU 0 and the load generator to CPU 1; `machine_busy_pct` in results.json says how much of the
machine everything together used, so contention from other work shows. bench/results.json holds every sample."""


def compile_bytecode(notes: list[str]) -> None:
    """The installed agent runs from bytecode (the packages' postinst compiles it): so does the one measured,
    whatever PYTHONDONTWRITEBYTECODE says (it stops writing .pyc files, not reading them)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(REPO / "gpu_agent")],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    notes.append("gpu_agent's bytecode compiled first, as the packages' postinst does")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", default=bool(os.environ.get("BENCH_QUICK")),
                        help="short runs for development (also BENCH_QUICK=1)")
    parser.add_argument("--only", help="comma-separated item numbers to run (1-11)")
    parser.add_argument("--no-readme", action="store_true", help="leave bench/README.md alone")
    parser.add_argument("--results", type=Path, default=REPO / "bench/results.json")
    args = parser.parse_args()

    notes = [n for n in os.environ.get("GPU_AGENT_BENCH_NOTES", "").split("\n") if n]
    if not os.environ.get(IN_NETNS):
        ensure_node_exporter(notes)
        reexec_in_netns(notes)
    else:
        notes.append("daemons ran in a private network namespace (unshare -n), loopback only")
    if can_pin():
        os.sched_setaffinity(0, {LOAD_CPU})
        notes.append("daemon under test pinned to CPU 0; load generator and bench pinned to CPU 1")
    else:
        notes.append("one CPU only: daemon and load generator share it, so load latencies include the generator")
    compile_bytecode(notes)
    scale = fig.Scale.quick() if args.quick else fig.Scale()
    if args.quick:
        notes.append("QUICK run: shortened windows, not the figures of record")
    only = {int(x) for x in args.only.split(",")} if args.only else set(range(1, 12))
    facts = machine_facts()
    tmp = fig.new_tmp()
    results: list[Figure] = []
    steady: Optional[dict[str, Any]] = None
    storm_figures: Optional[dict[str, Any]] = None
    peer_idle: Optional[dict[str, float]] = None
    started = time.monotonic()

    def step(item: int, name: str, fn: Callable[[], list[Figure]]) -> None:
        if item not in only:
            return
        print(f"[{time.monotonic() - started:6.0f} s] {item}: {name}", flush=True)
        try:
            for figure in fn():
                results.append(figure)
                result = "pass" if figure.passed else "-" if figure.passed is None else "MISS"
                print(f"         {figure.name}: {figure.value} {figure.unit} [{result}] {figure.note}", flush=True)
        except Exception as exc:  # one broken figure must not lose the others
            traceback.print_exc()
            results.append(Figure(item, name, None, "", "—", False, note=f"the bench failed: {exc}"))

    def run_peer() -> list[Figure]:
        nonlocal peer_idle
        figures, peer_idle = fig.peer(scale, tmp)
        return figures

    def run_soak() -> list[Figure]:
        nonlocal steady
        figures, steady = fig.soak(scale, tmp)
        return figures

    def run_storm() -> list[Figure]:
        nonlocal storm_figures
        figures = fig.xid(scale, tmp)
        storm_figures = fig.storm(scale, tmp)
        return figures

    try:
        step(11, "prometheus-node-exporter side by side", run_peer)
        step(1, "spawn → READY=1", lambda: fig.startup(scale, tmp))
        step(2, "gpu-agent status", lambda: fig.cli_status(scale, tmp))
        step(3, "idle", lambda: fig.idle(scale, tmp, peer_idle))
        step(4, "no-op reconcile", lambda: fig.noop_reconcile(scale, tmp))
        step(5, "endpoints at 1,000 req/s", lambda: fig.endpoints(scale, tmp))
        step(7, "XID latency and the storm", run_storm)
        step(8, "MIG change on one GPU", lambda: fig.mig_change(scale, tmp))
        step(9, "CDI spec generation", lambda: fig.cdi_generation(scale, tmp))
        step(10, "scale", lambda: fig.scale_figures(scale, tmp))
        step(6, "RSS soak", run_soak)
    finally:
        fig.cleanup(tmp)
    results.sort(key=lambda f: f.item)
    facts["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    facts["bench_seconds"] = round(time.monotonic() - started)
    fleet = fleet_section(steady, storm_figures)
    notes.append(fleet.split("\n", 1)[0])
    write_results(args.results, {**facts, "fleet": {"steady": steady, "storm": storm_figures}}, results, notes)
    print(f"wrote {args.results}")
    if not args.no_readme and only == set(range(1, 12)):
        block = "\n\n".join([
            render_table(results),
            f"Measured {facts['date']} on {facts['cpu_count']} × {facts['cpu_model']}, Python {facts['python']}, "
            f"load average {' '.join(facts['loadavg_at_start'])} at the start and "
            f"{' '.join(facts['loadavg_at_end'])} at the end (other work on the machine shows here)"
            + (" (QUICK run)" if args.quick else "") + ". " + " ".join(n.rstrip(".") + "." for n in notes[:-1]),
            HOW_TO_READ,
            fleet,
        ])
        update_readme(REPO / "bench/README.md", block)
        print("updated the table of bench/README.md")
    missed = [f for f in results if f.passed is False]
    print(f"{len(results)} figures, {len(missed)} missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
