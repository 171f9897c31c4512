"""What every figure of `make bench` shares: starting the agent on a simulated node with a notify socket the
bench owns, reading its CPU and memory from /proc, machine facts, percentiles, results.json and the README table.

Nothing here asserts; tests/test_bench_harness.py checks the arithmetic (percentiles, table rendering).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PYTHON = sys.executable
AGENT_CPU = 0  # the daemon under test; the load generator gets the other core
LOAD_CPU = 1
CLK_TCK = os.sysconf("SC_CLK_TCK")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python does not name it


# --- arithmetic --------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank: the smallest value with at least q % of values at or
    below it. Nearest rank never invents a latency nobody saw."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(min(rank, len(ordered))) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass
class Figure:
    """One line of the table: a measured value beside its goal. `passed` is None where no goal applies."""

    item: int
    name: str
    value: Optional[float]
    unit: str
    goal: str
    passed: Optional[bool]
    baselines: dict[str, Any] = field(default_factory=dict)  # same-run baselines and peers
    details: dict[str, Any] = field(default_factory=dict)  # everything else measured
    note: str = ""  # why it missed, or what was not measured and why


def fmt(value: Optional[float], unit: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not value.is_integer():
        digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
        return f"{value:.{digits}f} {unit}".strip()
    return f"{int(value)} {unit}".strip()


def render_table(figures: Sequence[Figure]) -> str:
    rows = ["| # | figure | measured | goal | result | same-run baseline / peer |", "|---|---|---|---|---|---|"]
    for f in figures:
        result = "pass" if f.passed else "n/a" if f.passed is None else "**miss**"
        baselines = "; ".join(f"{k} {v}" for k, v in f.baselines.items()) or "—"
        rows.append(f"| {f.item} | {f.name} | {fmt(f.value, f.unit)} | {f.goal} | {result} | {baselines} |")
    return "\n".join(rows)


def replace_between_markers(text: str, block: str) -> str:
    """`text` with what lies between the bench markers replaced by `block`; the markers must be there once."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README.md needs exactly one {BEGIN} followed by one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block.strip()}\n{END}{tail}"


# --- the machine -------------------------------------------------------------------------------------------

def machine_facts() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
        "kernel": platform.release(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads, in nanoseconds of precision (schedstat: time on CPU), plus what
    its exited threads left in /proc/PID/stat's ticks. A thread that started and exited between two readings
    is counted only in ticks (10 ms), so short windows should not rely on threads that come and go."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited while we read
    return total / 1e9


def cpu_ticks_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads, exited ones included), in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_mib(pid: int) -> dict[str, float]:
    """RSS and PSS from smaps_rollup (PSS shares libraries fairly between the processes that map them)."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            out[key.lower() + "_mib"] = int(rest.split()[0]) / 1024
    return out


def can_pin() -> bool:
    return len(os.sched_getaffinity(0) | {AGENT_CPU, LOAD_CPU}) >= 2 and (os.cpu_count() or 1) >= 2


def pinned_to(cpu: int) -> Optional[Any]:
    """A preexec_fn that pins the child (and every thread it starts) to one CPU, or None where we cannot."""
    if not can_pin():
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def pinned(argv: list[str], cpu: int) -> list[str]:
    """`argv` run pinned to one CPU by taskset (it execs the command: same pid), as `argv` where we cannot pin.
    Where the bench process runs gRPC servers (grpcio's threads: the pod-resources stand-in), a preexec_fn
    made subprocess fork it and run Python in the child, which grpcio's fork handlers broke (the load
    generator died with "epoll_wait: Bad file descriptor"); without one, subprocess uses vfork."""
    taskset = shutil.which("taskset")
    if not can_pin() or taskset is None:
        return argv
    return [taskset, "-c", str(cpu), *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def parse_importtime(text: str) -> dict[str, Any]:
    """`python -X importtime`'s report: total import time (the sum of every module's own time) and the
    top-level imports that cost the most, with everything they pulled in."""
    total_us, top = 0, []
    for line in text.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, cumulative, name = line[len("import time:"):].split("|", 2)
        if not own.strip().isdigit():
            continue  # the header line
        total_us += int(own)
        if not name[1:].startswith(" "):  # one space after the bar: imported by the program itself
            top.append((int(cumulative), name.strip()))
    top.sort(reverse=True)
    return {"imports_ms": round(total_us / 1000, 1),
            "largest": [f"{name} {us / 1000:.0f} ms" for us, name in top[:6]]}


def wakeups(pid: int) -> dict[str, int]:
    """Context switches so far by thread (voluntary + involuntary): a thread that wakes for a timer shows here,
    so two readings apart tell how many threads keep an idle daemon busy, and how often. Threads go by the
    names the agent gives the kernel (gpu_agent/host/threads.py: nvml-N, stage-N, xid-watcher ...), `main`
    for the event loop; an unnamed one (a library's) is `thread-TID`."""
    counts: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else _thread_name(task)
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError, ValueError):
            continue
        counts[name] = counts.get(name, 0) + switches
    return counts


def _thread_name(task: Path) -> str:
    comm = (task / "comm").read_text().strip()
    # an unnamed thread keeps the process's name (python3): tell those apart by TID
    return f"thread-{task.name}" if comm.startswith("python") else comm


# --- the agent ---------------------------------------------------------------------------------------------

class NotifyListener:
    """The notify socket systemd would own: every datagram with the kernel's receive time (SO_TIMESTAMPNS),
    so a busy bench process reading late does not stretch the watchdog gaps it reports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []  # (CLOCK_REALTIME seconds, text)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True, name="notify")
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, 64)
            except socket.timeout:
                continue
            except OSError:
                return
            stamp = time.time()
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
                    stamp = int.from_bytes(raw[:8], sys.byteorder) + int.from_bytes(raw[8:16], sys.byteorder) / 1e9
            with self._cond:
                self.messages.append((stamp, data.decode(errors="replace")))
                self._cond.notify_all()

    def wait_for(self, line: str, after: float = 0.0, timeout: float = 60.0) -> float:
        """Wall-clock time of the first message received at or after `after` holding `line`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for stamp, text in self.messages:
                    if stamp >= after and line in text.splitlines():
                        return stamp
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {line} on the notify socket within {timeout:g} s")
                self._cond.wait(left)

    def times_of(self, line: str, start: float, end: float) -> list[float]:
        with self._cond:
            return [s for s, text in self.messages if start <= s <= end and line in text.splitlines()]

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self.sock.close()
        self.path.unlink(missing_ok=True)


@dataclass
class AgentOptions:
    profile: str = "dgx-h100"
    settings: str = ""  # YAML appended to the config (after version and http)
    watchdog_usec: Optional[int] = None  # WATCHDOG_USEC, as systemd's WatchdogSec= sets it
    probe: Optional[Path] = None  # run under bench/probe.py, writing its event log here
    pin: bool = True
    env: dict[str, str] = field(default_factory=dict)
    port: Optional[int] = None  # the same port (and so the same config file) as an earlier start


class Agent:
    """`gpu-agent run` on a simulated node in `workdir`, started by exec, ready when READY=1 arrives."""

    def __init__(self, workdir: Path, options: Optional[AgentOptions] = None) -> None:
        self.options = options or AgentOptions()
        self.workdir = workdir
        self.port = self.options.port or free_port()
        self.root = workdir / "root"
        self.root.mkdir(exist_ok=True)
        self.config = workdir / "config.yaml"
        self.config.write_text(f"version: v1\nhttp:\n  listen: 127.0.0.1:{self.port}\n{self.options.settings}")
        self.notify = NotifyListener(workdir / f"notify-{self.port}.sock")
        self.log_path = workdir / f"agent-{self.port}.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.started_wall = 0.0
        self.ready_wall = 0.0

    def argv(self, *args: str) -> list[str]:
        head = [PYTHON, str(BENCH / "probe.py"), str(self.options.probe)] if self.options.probe else [PYTHON]
        return [*head, "-m", "gpu_agent", "--root", str(self.root), "--config", str(self.config), *args]

    def start(self, wait: bool = True) -> Agent:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "WATCHDOG_"))}
        env.update(self.options.env, NOTIFY_SOCKET=str(self.notify.path))
        if self.options.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.options.watchdog_usec)
        log = open(self.log_path, "ab")
        self.started_wall = time.time()
        argv = self.argv("--simulate", self.options.profile, "run")
        self.proc = subprocess.Popen(pinned(argv, AGENT_CPU) if self.options.pin else argv, env=env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 120) -> float:
        try:
            self.ready_wall = self.notify.wait_for("READY=1", after=self.started_wall, timeout=timeout)
        except TimeoutError:
            raise RuntimeError(f"the agent sent no READY=1 within {timeout:g} s; its log: "
                               f"{self.log_path.read_text(errors='replace')[-2000:]}") from None
        return self.ready_wall - self.started_wall

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        return subprocess.run([PYTHON, "-m", "gpu_agent", "--root", str(self.root), "--config", str(self.config),
                               *args], capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)

    def stop(self) -> int:
        code = -1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                code = self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(5)
        elif self.proc is not None:
            code = self.proc.returncode
        self.notify.close()
        return code

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def cpu_over(pid: int, seconds: float) -> float:
    """Percent of one core `pid` used over the next `seconds`."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started) * 100


# --- results -----------------------------------------------------------------------------------------------

def write_results(path: Path, facts: dict[str, Any], figures: Sequence[Figure], notes: Sequence[str]) -> None:
    payload = {"machine": facts, "notes": list(notes), "figures": [asdict(f) for f in figures]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def update_readme(readme: Path, block: str) -> None:
    text = replace_between_markers(readme.read_text(), block)
    tmp = readme.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, readme)
