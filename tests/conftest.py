"""Fixtures that run the real agent as a subprocess against a sandbox root, with its own NOTIFY_SOCKET."""
from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Generator, Iterator, Optional

import pytest
import yaml


# --- no real subprocess, no host path, unless a test says so -------------------------------------
#
# Like cloud-init's disable_subp_usage: an audit hook fails any test that starts a real process or
# touches a path outside its temporary directories, unless it is marked
#   @pytest.mark.subprocess   the test exercises the process contract (signals, notify, CLI, packages)
#   @pytest.mark.host_paths   the test reads or writes real host paths on purpose
# Reading the project, the Python installation and /dev/null is always allowed.

_SUBPROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                      "os.forkpty", "pty.spawn")
_PATH_EVENTS = {"open": 0, "os.mkdir": 0, "os.remove": 0, "os.rmdir": 0, "os.rename": 0, "os.replace": 0,
                "os.symlink": 1, "os.link": 1, "os.chmod": 0, "os.chown": 0, "os.truncate": 0, "os.utime": 0,
                "os.listdir": 0, "os.scandir": 0, "shutil.rmtree": 0, "shutil.copyfile": 1, "os.mknod": 0}


def _prefixes(folders: tuple[str, ...]) -> tuple[str, ...]:
    """`folders` as the prefixes of what is in them: the guard runs at every file event, and one
    str.startswith over a tuple is what it can afford."""
    return tuple(folder.rstrip("/") + "/" for folder in folders)


_PROJECT = Path(__file__).resolve().parent.parent
_ALWAYS_AS_GIVEN = {
    _PROJECT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
    Path(tempfile.gettempdir()), Path("/dev/null"), Path("/dev/urandom"), Path("/proc/self"),
    Path(os.path.realpath("/proc/self")),  # paths are compared resolved: /proc/self is /proc/<this pid>
    Path("/usr/lib/python3"), Path("/usr/share/zoneinfo"), Path("/etc/localtime"), Path("/usr/lib/ssl"),
    Path("/etc/ssl"), Path("/etc/mime.types"),
    Path("/proc/stat"),  # the process collector's boot time, for the agent's own metrics
}
# Opened paths are compared resolved, so the allowed ones are too.
_ALWAYS = tuple(sorted({str(p) for p in _ALWAYS_AS_GIVEN} | {os.path.realpath(p) for p in _ALWAYS_AS_GIVEN}))
# Test data is in tests/data; upstream's own data files are read from ../shared/upstream and
# ../shared/schemas (tests/upstream_data.py), and only read. The rest of a checkout beside the clone is
# refused even where the clone's folder is also the temporary one (a clone in /tmp).
_NEVER = _prefixes((os.path.realpath(_PROJECT.parent / "shared"),))
_READ_ONLY = _prefixes(tuple(os.path.realpath(_PROJECT.parent / "shared" / name) for name in ("upstream", "schemas")))


def _inside(path: str, prefixes: tuple[str, ...]) -> bool:
    return (path + "/").startswith(prefixes)


def _resolved(path: str) -> str:
    """os.path.realpath(path), with the folder resolved once per folder: realpath stats every component
    of the deep sandbox paths at every open, which made the guard most of an in-process pass's CPU. The
    folder's own lstat, kept with it, notices one replaced by a link; a name that is a link, or a path
    with "..", is resolved in full."""
    folder, name = os.path.split(path)
    if ("/.." in path and ".." in path.split(os.sep)) or name in ("", "."):
        return os.path.realpath(path)
    try:
        folder_stat = os.lstat(folder)
    except OSError:
        return os.path.realpath(path)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return os.path.realpath(path)
    except OSError:
        pass  # not there (yet): the folder says where it would be
    key = (folder, folder_stat.st_dev, folder_stat.st_ino)
    real = _FOLDERS.get(key)
    if real is None:
        real = _FOLDERS[key] = os.path.realpath(folder)
        if len(_FOLDERS) > 8192:
            _FOLDERS.clear()
    return os.path.join(real, name)


_FOLDERS: dict[tuple[str, int, int], str] = {}


def _only_reads(event: str, args: tuple) -> bool:
    if event in ("os.listdir", "os.scandir"):
        return True
    return event == "open" and isinstance(args[2], int) and args[2] & os.O_ACCMODE == os.O_RDONLY \
        and not args[2] & (os.O_CREAT | os.O_TRUNC) and (not isinstance(args[1], str) or args[1] in ("r", "rb", "rt"))


class _Guard:
    active = False
    subprocess = False
    host_paths = False
    allowed = _prefixes(_ALWAYS)  # and --basetemp, where `make test` puts the tests' folders (on a tmpfs)

    @classmethod
    def audit(cls, event: str, args: tuple) -> None:
        if not cls.active:
            return
        if event in _SUBPROCESS_EVENTS and not cls.subprocess:
            raise RuntimeError(f"this test started a real process ({event} {args[:2]!r}); mark it "
                               "@pytest.mark.subprocess if it tests the process contract, or test in-process")
        index = _PATH_EVENTS.get(event)
        if index is None or cls.host_paths or len(args) <= index:
            return
        path = args[index]
        if isinstance(path, (bytes, bytearray)):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)) or not os.path.isabs(os.fspath(path)):
            return  # a file descriptor, or relative to one the test already opened
        real = _resolved(os.fspath(path))
        if _inside(real, _READ_ONLY) and _only_reads(event, args):
            return
        if _inside(real, _NEVER) or not _inside(real, cls.allowed):
            raise RuntimeError(f"this test touched the host path {real} ({event}); use a tmp root, or mark "
                               "it @pytest.mark.host_paths")


sys.addaudithook(_Guard.audit)

# In this process, fsync returns at once (as eatmydata makes it): the in-process tests write sandbox
# trees that nothing needs after a power cut, and a pass of the simulated node makes hundreds of
# fsyncs that cost seconds on a busy disk. The agents the tests start as processes keep the real
# fsync, and their kill -9 trials count every fsync as a crash point (gpu_agent/sim/crash.py).
os.fsync = lambda fd: None


# asyncio.run puts its own SIGINT handler in place only while SIGINT has Python's default one, and
# taking it out again formats its repr: the finished task's, with its result (every stage run of a
# pass), about a tenth of an in-process pass's CPU. With this handler in place it leaves SIGINT alone;
# Ctrl-C still interrupts the tests.
def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, _interrupt)


# --- no test over 10 s, but those marked slow ---------------------------------------------------
#
# The call phase of a test not marked slow fails when it runs past call_limit() seconds of wall-clock
# time (fixtures such as a daemon's start are not counted). Wall time, because most of the suite's time
# is spent waiting on daemons, deadlines and sockets, which CPU time would not see. Wall time stretches
# with load, though: `make test` runs two workers per CPU, and other work may share the machine. So the
# 10 s are scaled by the load per CPU (the 1-minute load average, the higher of its values when the call
# began and ended), and given half again as headroom, since that average lags a burst of load by tens of
# seconds: 15 s on an idle machine, 30 s in a `make test` of its own. The guard fails a test that is well
# over 10 s, and no test for the machine being busy; `--durations` measures the rest.
CALL_LIMIT_S = 10.0
CALL_HEADROOM = 1.5


def call_limit(load_per_cpu: float) -> float:
    """The wall-clock seconds a test's call phase may take at this load per CPU."""
    return CALL_LIMIT_S * max(1.0, load_per_cpu) * CALL_HEADROOM


def _load_per_cpu() -> float:
    return os.getloadavg()[0] / len(os.sched_getaffinity(0))


def at_this_load(seconds: float) -> float:
    """A wait that is `seconds` on an idle machine, stretched by the load per CPU as the call limit is: for
    a test's answer deadlines, which measure the agent's behaviour, not the machine's."""
    return seconds * max(1.0, _load_per_cpu())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if item.get_closest_marker("slow") is not None:
        return (yield)
    load, started = _load_per_cpu(), time.monotonic()
    result = yield  # a test that failed already raises here, with its own error
    took, limit = time.monotonic() - started, call_limit(max(load, _load_per_cpu()))
    if took > limit:
        pytest.fail(f"this test took {took:.1f} s, over the {limit:.3g} s a test may take at this load "
                    f"({CALL_LIMIT_S:g} s alone): make it faster, or mark it slow where a fast case of its "
                    "family stays in `make test`", pytrace=False)
    return result


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "subprocess: the test may start real processes (the process contract)")
    config.addinivalue_line("markers", "host_paths: the test may touch real host paths")
    if config.option.basetemp:
        _Guard.allowed = _prefixes((*_ALWAYS, os.path.realpath(config.option.basetemp)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collected tests, and the modules they imported, live as long as the run: frozen out of the garbage
    collector's generations, its full collections stop walking them again (40% of its time in a worker)."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A passing run leaves no folders in the tmpfs `make test` gives it (a failing one keeps them to look
    at; the next run removes them)."""
    basetemp = session.config.option.basetemp
    if basetemp and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        shutil.rmtree(basetemp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _guard(request: pytest.FixtureRequest) -> Iterator[None]:
    _Guard.subprocess = request.node.get_closest_marker("subprocess") is not None
    _Guard.host_paths = request.node.get_closest_marker("host_paths") is not None
    _Guard.active = True
    try:
        yield
    finally:
        _Guard.active = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, root: Path, config: Optional[Path] = None, timeout: float = 30,
        env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """Run `gpu-agent ARGS` the way a user would."""
    argv = [sys.executable, "-m", "gpu_agent", "--root", str(root)]
    if config is not None:
        argv += ["--config", str(config)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**clean, **(env or {})}, stdin=subprocess.DEVNULL)


class AgentProcess:
    """`gpu-agent run` in a subprocess, with the notify messages it sends to its own socket."""

    def __init__(self, root: Path, config: Path, port: int, notify_path: Path) -> None:
        self.root, self.config, self.port = root, config, port
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(notify_path))
        self.notify.settimeout(0.1)
        self.notify_path = notify_path
        self.messages: list[str] = []
        self.proc: Optional[subprocess.Popen[str]] = None
        self.started_at = 0.0

    def start(self, *args: str, env: Optional[dict[str, str]] = None) -> AgentProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "WATCHDOG_"))}
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_agent", "--root", str(self.root), "--config", str(self.config), *args, "run"],
            env={**clean, "NOTIFY_SOCKET": str(self.notify_path), **(env or {})},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        return self

    def _drain(self) -> None:
        while True:
            try:
                self.messages.append(self.notify.recv(65536).decode())
            except socket.timeout:
                return

    def wait_message(self, predicate: Callable[[str], bool], timeout: float = 15.0) -> str:
        """The first message (seen so far or arriving within `timeout`) that satisfies predicate."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for message in self.messages[seen:]:
                if predicate(message):
                    return message
            seen = len(self.messages)
            if time.monotonic() > deadline:
                raise AssertionError(f"no such notify message within {timeout} s; got {self.messages}\n{self.output()}")
            if self.proc is not None and self.proc.poll() is not None:
                self._drain()
                if len(self.messages) == seen:
                    raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.output()}")
            self._drain()

    def wait_ready(self) -> str:
        return self.wait_message(lambda m: "READY=1" in m.splitlines())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def wait_http(self, path: str, predicate: Callable[[int, str], bool], timeout: float = 10.0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.get(path)
            if predicate(status, body):
                return status, body
            if time.monotonic() > deadline:
                raise AssertionError(f"{path}: still {status} after {timeout} s:\n{body}")
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._drain()
        return code

    def output(self) -> str:
        if self.proc is None or self.proc.poll() is None:
            return "(still running)"
        return self.proc.stdout.read() if self.proc.stdout else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.notify.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a config file; returns its path. Keys given are merged over a base with a free port."""
    port = free_port()

    def write(settings: Optional[dict] = None, text: Optional[str] = None) -> Path:
        path = tmp_path / "config.yaml"
        if text is None:
            document = {"version": "v1", "http": {"listen": f"127.0.0.1:{port}"}}
            for key, value in (settings or {}).items():
                document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) else value
            text = yaml.safe_dump(document)
        path.write_text(text)
        return path

    write.port = port  # type: ignore[attr-defined]
    return write


@pytest.fixture
def agent(root: Path, write_config: Callable[..., Path], tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start the daemon: agent(simulate="dgx-h100", settings={...})."""
    started: list[AgentProcess] = []

    def start(simulate: str = "dgx-h100", settings: Optional[dict] = None,
              env: Optional[dict[str, str]] = None) -> AgentProcess:
        config = write_config(settings)
        process = AgentProcess(root, config, write_config.port, tmp_path / f"notify{len(started)}.sock")
        started.append(process)
        return process.start("--simulate", simulate, env=env)

    yield start
    for process in started:
        process.close()
