"""Fault injection for the agent's own config: every malformed file, one row each.

Each row must end as a ConfigError (never another exception, a hang or a flood of output) whose
every line names the file, and the key or line at fault; nothing on disk changes. Then the same
kinds of file, given to a running daemon by SIGHUP, are a reload error and nothing more.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Callable

import pytest

from gpu_agent.config import load_config
from gpu_agent.config.loader import MAX_CONFIG_BYTES, MAX_REPORTED_ERRORS
from gpu_agent.errors import ConfigError


def laughs(levels: int) -> str:
    """The classic anchor bomb: each level is nine aliases of the one before (9**levels strings)."""
    lines = ["version: v1", "toolkit:", "  runtime_config:", "    l0: &l0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    for level in range(1, levels):
        lines.append(f"    l{level}: &l{level} [" + ",".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


BOMB = laughs(9)
assert len(BOMB) < 600  # the size of the one in issue 11 (523 bytes, 38 s and 2.6 GB before this guard)

V1 = "version: v1\n"

# (id, file content, a fragment the message must contain: ":LINE: " and the key or the reason, in the agent's
# words; where the reason is PyYAML's, only "not valid YAML", as its wording changes between versions)
ROWS: list[tuple[str, str | bytes, str]] = [
    # --- YAML that costs more to load than its size says
    ("anchor bomb", BOMB, ":9: alias *l4 makes the file expand to more than 1048576 bytes"),
    ("long string aliased 10000 times", V1 + "toolkit:\n  runtime_config:\n    a: &s " + "s" * 20_000 + "\n"
     "    b: [" + ", ".join(["*s"] * 10_000) + "]\n", ":5: alias *s makes the file expand to more than"),
    ("alias inside its own anchor", V1 + "toolkit:\n  runtime_config:\n    a: &a [1, *a]\n", ":4: alias *a is inside"),
    ("100000-deep flow nesting", V1 + "toolkit:\n  runtime_config:\n    a: " + "[" * 100_000 + "]" * 100_000,
     ":4: "),  # the agent's bound, or libyaml's own (it scans ahead): either names the line
    ("40-deep block nesting", V1 + "toolkit:\n  runtime_config:\n" + "".join(
        "  " * (depth + 2) + f"k{depth}:\n" for depth in range(40)), "nested more than 32 levels deep"),
    ("a 5000-digit number", V1 + "discovery:\n  expected_gpus: " + "9" * 5000 + "\n", ":3: a number 5000 characters"),
    ("larger than the size cap", V1 + "# padding\n" * (MAX_CONFIG_BYTES // 10), "too large for a config file"),
    # --- YAML that is not one plain mapping of settings
    ("duplicate top-level key", V1 + "log_level: info\nreconcile: {}\nlog_level: debug\n",
     ":4: duplicate key 'log_level', first given on line 2"),
    ("duplicate nested key", V1 + "reconcile:\n  interval_seconds: 1\n  interval_seconds: 2\n",
     ":4: duplicate key 'interval_seconds', first given on line 3"),
    ("duplicate key in flow style", V1 + "reconcile: {interval_seconds: 1, interval_seconds: 2}\n",
     ":2: duplicate key 'interval_seconds', first given on line 2"),
    ("two documents", V1 + "---\n" + V1, ":2: not valid YAML"),
    ("top-level list", "- version: v1\n", ":1: expected a mapping of settings at the top level, got a list"),
    ("top-level string", "version v1\n", ":1: expected a mapping of settings at the top level, got a string"),
    ("tab indentation", V1 + "http:\n\tlisten: 127.0.0.1:1\n", ":3: not valid YAML: a tab character"),
    ("unclosed flow list", V1 + "health:\n  ignored_xids: [13, 31\nlog_level: info\n", ":4: not valid YAML"),
    ("unclosed quote", V1 + 'metrics:\n  hostname: "node\n', ":4: not valid YAML"),
    ("undefined alias", V1 + "log_level: *level\n", ":2: not valid YAML"),
    ("duplicate anchor", V1 + "a: &x 1\nb: &x 2\n", ":3: not valid YAML"),
    ("mapping as a key", V1 + "? {a: b}\n: 1\n", ":2: not valid YAML"),
    ("python object tag", V1 + "log_level: !!python/object/apply:os.system [id]\n", ":2: not valid YAML"),
    ("impossible date", V1 + "metrics:\n  hostname: 2024-13-45\n",
     ":3: not valid YAML: cannot read this value as !!timestamp: '2024-13-45'"),
    ("boolean tag on a word", V1 + "toolkit:\n  enabled: !!bool maybe\n", ":3: not valid YAML: cannot read this value"),
    ("integer tag on nothing", V1 + "discovery:\n  expected_gpus: !!int ''\n", ":3: not valid YAML: cannot read"),
    ("timestamp tag on a word", V1 + "metrics:\n  hostname: !!timestamp x\n", ":3: not valid YAML: cannot read"),
    ("boolean tag on a key", V1 + "? !!bool maybe\n: 1\n", ":2: not valid YAML: cannot read this value"),
    ("merge of a scalar", V1 + "reconcile:\n  <<: 5\n", ":3: not valid YAML"),
    # --- bytes that are not UTF-8 YAML text
    ("latin-1 byte", V1.encode() + b"metrics:\n  hostname: caf\xe9\n", ":3: not UTF-8 text (byte 36)"),
    ("UTF-16 with BOM", V1.encode("utf-16"), ":1: not UTF-8 text"),
    ("binary file", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "not UTF-8 text"),
    ("BOM inside the file", V1 + "\ufefflog_level: info\n", ":2: a byte order mark (U+FEFF) in the middle"),
    ("NUL byte", V1 + "log_level: in\x00fo\n", ":2: contains the control character U+0000"),
    ("escape character", V1 + "log_level: \x1b[31minfo\n", ":2: contains the control character U+001B"),
    ("empty file", "", "version: missing"),
    # --- version
    ("version v2", "version: v2\n", ":1: version: unsupported value 'v2'"),
    ("version as a number", "log_level: info\nversion: 1\n", ":2: version: unsupported value 1"),
    ("version as a list", "version: [v1]\n", ":1: version: unsupported value ['v1']"),
    ("version missing", "log_level: info\n", "version: missing"),
    # --- unknown keys
    ("unknown top-level key", V1 + "reconcil: {}\n", ":2: reconcil: unknown key"),
    ("unknown nested key", V1 + "toolkit:\n  cdi:\n    enable: true\n", ":4: toolkit.cdi.enable: unknown key"),
    ("number as a key", V1 + "1: 2\n", ":2: 1: Keys should be strings"),
    ("20000 unknown keys", V1 + "".join(f"k{i}: 1\n" for i in range(20_000)),
     f"and {20_000 - MAX_REPORTED_ERRORS} more"),
    # --- wrong types, at every level
    ("section is a list", V1 + "reconcile: [60]\n", ":2: reconcile: Input should be a valid dictionary"),
    ("section is a string", V1 + "toolkit: yes\n", ":2: toolkit: Input should be a valid dictionary"),
    ("subsection is a string", V1 + "toolkit:\n  cdi: /var/run/cdi\n", ":3: toolkit.cdi: Input should be"),
    ("duration is a string", V1 + "reconcile:\n  interval_seconds: fast\n", ":3: reconcile.interval_seconds: "),
    ("duration is true", V1 + "reconcile:\n  interval_seconds: true\n", ":3: reconcile.interval_seconds: "),
    ("duration is a list", V1 + "nvml:\n  call_timeout_seconds: [5]\n", ":3: nvml.call_timeout_seconds: "),
    ("flag is a number", V1 + "toolkit:\n  enabled: 1\n", ":3: toolkit.enabled: Input should be a valid boolean"),
    ("choice is a list", V1 + "log_level: [info]\n", ":2: log_level: "),
    ("choice out of set", V1 + "kubernetes:\n  mig_strategy: all\n", ":3: kubernetes.mig_strategy: "),
    ("path is a mapping", V1 + "kubernetes:\n  kubeconfig: {a: b}\n", ":3: kubernetes.kubeconfig: "),
    ("list is a number", V1 + "health:\n  ignored_xids: 13\n", ":3: health.ignored_xids: "),
    ("list item is a word", V1 + "health:\n  ignored_xids:\n    - 13\n    - many\n", ":5: health.ignored_xids.1: "),
    ("runtime not known", V1 + "toolkit:\n  runtimes: [podman]\n", ":3: toolkit.runtimes"),
    ("count is a fraction", V1 + "discovery:\n  expected_gpus: 2.5\n", ":3: discovery.expected_gpus: "),
    ("binary where text belongs", V1 + "metrics:\n  hostname: !!binary aGVsbG8=\n", ":3: metrics.hostname: "),
    ("parameters not a mapping", V1 + "driver:\n  parameters:\n    nvidia: [1]\n", ":4: driver.parameters.nvidia: "),
    # --- bounds: no infinity, NaN, negative or absurd duration or count
    ("timeout 1e300", V1 + "nvml:\n  call_timeout_seconds: 1e300\n",  # YAML 1.1 reads a string: no "."
     ":3: nvml.call_timeout_seconds: Input should be a valid number (got the string '1e300'"),
    ("timeout 1.0e+300", V1 + "nvml:\n  call_timeout_seconds: 1.0e+300\n",
     ":3: nvml.call_timeout_seconds: Input should be less than or equal to 300"),
    ("infinite interval", V1 + "reconcile:\n  interval_seconds: .inf\n", ":3: reconcile.interval_seconds: "),
    ("NaN interval", V1 + "metrics:\n  sample_interval_seconds: .nan\n", ":3: metrics.sample_interval_seconds: "),
    ("negative timeout", V1 + "toolkit:\n  restart_timeout_seconds: -1\n", ":3: toolkit.restart_timeout_seconds: "),
    ("zero backoff", V1 + "reconcile:\n  backoff_initial_seconds: 0\n", ":3: reconcile.backoff_initial_seconds: "),
    ("week-long modprobe", V1 + "driver:\n  modprobe_timeout_seconds: 604800\n",
     ":3: driver.modprobe_timeout_seconds: "),
    ("huge request timeout", V1 + "kubernetes:\n  request_timeout_seconds: 1e9\n",
     ":3: kubernetes.request_timeout_seconds: "),
    ("negative GPU count", V1 + "discovery:\n  expected_gpus: -1\n", ":3: discovery.expected_gpus: "),
    ("absurd GPU count", V1 + "discovery:\n  expected_gpus: 100000\n", ":3: discovery.expected_gpus: "),
    ("negative XID", V1 + "health:\n  ignored_xids: [13, -31]\n", ":3: health.ignored_xids.1: "),
    ("2000 XIDs", V1 + "health:\n  ignored_xids: [" + ", ".join(["13"] * 2000) + "]\n", ":3: health.ignored_xids: "),
    # --- paths: absolute, sane
    ("relative kubeconfig", V1 + "kubernetes:\n  kubeconfig: kubelet.conf\n",
     ":3: kubernetes.kubeconfig: must be an absolute path, got 'kubelet.conf'"),
    ("relative CDI spec path", V1 + "toolkit:\n  cdi:\n    path: cdi/nvidia.yaml\n",
     ":4: toolkit.cdi.path: must be an absolute"),
    ("relative runtime binary", V1 + "toolkit:\n  runtime_binary: nvidia-container-runtime\n",
     ":3: toolkit.runtime_binary: must be an absolute path"),
    ("relative socket", V1 + "http:\n  socket: agent.sock\n", ":3: http.socket: must be an absolute path"),
    ("NUL in a path", V1 + 'toolkit:\n  runtime_binary: "/usr/bin/nvidia\\0x"\n',
     ":3: toolkit.runtime_binary: contains a control"),
    ("newline in a path", V1 + 'kubernetes:\n  kubeconfig: "/etc/k\\n.conf"\n',
     ":3: kubernetes.kubeconfig: contains a control"),
    ("path longer than PATH_MAX", V1 + "toolkit:\n  cdi:\n    path: /" + "a" * 5000 + "\n", ":4: toolkit.cdi.path: "),
    # --- huge strings
    ("200 kB node name", V1 + "kubernetes:\n  node_name: " + "n" * 200_000 + "\n", ":3: kubernetes.node_name: "),
    # --- the node name goes into API request paths: a Kubernetes Node name or nothing
    ("node name with a path", V1 + "kubernetes:\n  node_name: ../../api/v1/namespaces/kube-system/secrets/x\n",
     ":3: kubernetes.node_name: '../../api/v1/namespaces/kube-system/secrets/x' is not a Kubernetes Node name"),
    ("node name with a query", V1 + "kubernetes:\n  node_name: 'a?watch=1#x'\n",
     ":3: kubernetes.node_name: 'a?watch=1#x' is not a Kubernetes Node name"),
    ("non-ASCII node name", V1 + "kubernetes:\n  node_name: nœud-1\n", ":3: kubernetes.node_name: 'nœud-1' is not a"),
    ("upper-case node name", V1 + "kubernetes:\n  node_name: GPU-Node-1\n",
     ":3: kubernetes.node_name: 'GPU-Node-1' is not"),
    ("node name ending in a dot", V1 + "kubernetes:\n  node_name: node-1.\n",
     ":3: kubernetes.node_name: 'node-1.' is not"),
    ("empty node name", V1 + "kubernetes:\n  node_name: ''\n", ":3: kubernetes.node_name: '' is empty"),
    ("254-character node name", V1 + "kubernetes:\n  node_name: " + "n" * 254 + "\n",
     ":3: kubernetes.node_name: String should have at most 253 characters"),
    ("huge driver pin", V1 + "driver:\n  version: '" + "5" * 10_000 + "'\n", ":3: driver.version: "),
    ("huge listen address", V1 + "http:\n  listen: '" + "h" * 10_000 + ":1'\n", ":3: http.listen: "),
    ("huge version", "version: " + "v" * 200_000 + "\n", ":1: version: unsupported value 'vvvv"),
    ("huge key", V1 + "k" * 200_000 + ": 1\n", ":2: not valid YAML"),
    # --- driver.parameters: what would break /etc/modprobe.d
    ("parameter value ends in a newline", V1 + 'driver:\n  parameters:\n    nvidia:\n      NVreg_X: "1\\n"\n',
     ":3: driver.parameters: nvidia.NVreg_X: '1\\n' cannot be written to modprobe.d"),
    ("parameter name ends in a newline", V1 + 'driver:\n  parameters:\n    nvidia:\n      "NVreg_X\\n": 1\n',
     ":3: driver.parameters: nvidia: 'NVreg_X\\n' is not a module parameter name"),
    ("parameter value with a comment", V1 + "driver:\n  parameters:\n    nvidia:\n      NVreg_X: '1#x'\n",
     ":3: driver.parameters: nvidia.NVreg_X: '1#x' cannot be written"),
    ("parameter of an unknown module", V1 + "driver:\n  parameters:\n    nouveau:\n      modeset: 0\n",
     ":3: driver.parameters: unknown module 'nouveau'"),
    ("parameter name not a string", V1 + "driver:\n  parameters:\n    nvidia:\n      1: x\n",
     ":5: driver.parameters.nvidia.1"),
    # --- toolkit.runtime_config: what TOML and the runtime's config.toml can hold, refused before any stage runs
    ("runtime_config null value", V1 + "toolkit:\n  runtime_config:\n    nvidia-container-runtime.mode: null\n",
     ":4: toolkit.runtime_config.nvidia-container-runtime.mode: must be a string, boolean, number or a list of those; "
     "got null"),
    ("runtime_config empty mapping", V1 + "toolkit:\n  runtime_config:\n    nvidia-container-cli: {}\n",
     ":4: toolkit.runtime_config.nvidia-container-cli: must be a string, boolean, number or a list of those; "
     "got an empty mapping"),
    ("runtime_config null in a table", V1 + "toolkit:\n  runtime_config:\n    nvidia-container-cli:\n      debug: ~\n",
     "toolkit.runtime_config.nvidia-container-cli.debug: must be a string, boolean, number or a list of those; "
     "got null"),
    ("runtime_config empty key", V1 + "toolkit:\n  runtime_config:\n    '': 1\n",
     ":4: toolkit.runtime_config..[key]: '' is not a dotted key of the runtime's config.toml"),
    ("runtime_config empty part", V1 + "toolkit:\n  runtime_config:\n    a..b: 2\n", "'a..b' is not a dotted key"),
    ("runtime_config quoted part", V1 + "toolkit:\n  runtime_config:\n    'a.\"b c\"': 2\n", "is not a dotted key"),
    ("runtime_config nested list", V1 + "toolkit:\n  runtime_config:\n    a: [[1]]\n", "got a list inside a list"),
    ("runtime_config int64 overflow", V1 + "toolkit:\n  runtime_config:\n    a: 9223372036854775808\n",
     "got 9223372036854775808"),
    ("runtime_config infinity", V1 + "toolkit:\n  runtime_config:\n    a: .inf\n", "got inf"),
    # --- paths the agent writes that would name a system file it does not manage (the CDI spec: a .yaml or
    # .json file directly in a CDI spec directory)
    *[(f"cdi path {path}", V1 + f"toolkit:\n  cdi:\n    path: '{path}'\n",
       ":4: toolkit.cdi.path: must be a .yaml or .json file directly in /etc/cdi, /var/run/cdi, /run/cdi")
      for path in ("/etc/passwd", "/etc/cdi/../passwd", "/etc/cdi/sub/nvidia.yaml", "/var/run/cdi/nvidia.toml",
                   "/var/run/cdi/.yaml", "/etc/cdi/", "/var/run/cdi/nvidia.yaml/", "/tmp/nvidia.yaml",
                   "/etc/cdi/nvidia\nx.yaml", "/var/lib/gpu-agent/ledger.json", "/etc/cdi//nvidia.yaml")],
    # --- addresses that are not HOST:PORT
    *[(f"listen {listen}", V1 + f"http:\n  listen: '{listen}'\n", ":3: http.listen: expected HOST:PORT")
      for listen in ("[::1:9445", "::1]:9445", "::1:9445", "[::1]", "[]:9445", "[nope]:1", "host name:1", "h:0009445",
                     "[::1]:9445]", "h:\u0669")],
    # --- a socket that could stand where a file of the system is
    *[(f"socket {path}", V1 + f"http:\n  socket: '{path}'\n", ":3: http.socket: the socket must be under /run")
      for path in ("/etc/passwd", "/var/lib/kubelet/device-plugins/kubelet.sock", "/run/../etc/shadow",
                   "/runaway/agent.sock")],
]


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "etc"
    directory.mkdir()
    return directory


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `directory`, with its mode, mtime and content."""
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        found[str(path)] = (info.st_mode, info.st_mtime_ns, content)
    return found


def refused(path: Path) -> str:
    """load_config's ConfigError message for `path`; any other outcome fails the test."""
    with pytest.raises(ConfigError) as info:
        load_config(path, required=True)
    message = str(info.value)
    assert len(message) < 8000, "an error message must not flood /status or the journal"
    for line in message.splitlines():
        assert line.startswith((f"{path}:", f"{path} ")), line
    return message


@pytest.mark.parametrize("content, fragment", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_malformed_config_is_refused_naming_the_file_and_line(config_dir: Path, content: str | bytes,
                                                                 fragment: str) -> None:
    path = config_dir / "config.yaml"
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    before = snapshot(config_dir)
    message = refused(path)
    assert fragment in message, message
    assert snapshot(config_dir) == before


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_loop(path: Path) -> None:
    path.symlink_to(path.name)


def make_directory(path: Path) -> None:
    path.mkdir()
    (path / "config.yaml").write_text(V1)


def make_device(path: Path) -> None:
    path.symlink_to("/dev/zero")


def make_unreadable(path: Path) -> None:
    path.write_text(V1)
    path.chmod(0)


# how the config path is made, and the reason the message must give
FILES = [
    pytest.param(make_fifo, "not a regular file (it is a FIFO)", id="FIFO"),
    pytest.param(make_device, "not a regular file (it is a character device)", id="/dev/zero"),
    pytest.param(make_directory, "not a regular file (it is a directory)", id="directory"),
    pytest.param(make_loop, "cannot read: Too many levels of symbolic links", id="symlink loop"),
    pytest.param(make_unreadable, "cannot read: Permission denied", id="unreadable",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file")),
]


@pytest.mark.host_paths  # /dev/zero given as the config file
@pytest.mark.parametrize("make, reason", FILES)
def test_a_config_path_that_is_not_a_readable_file_is_refused_without_blocking(
        config_dir: Path, make: Callable[[Path], None], reason: str) -> None:
    path = config_dir / "config.yaml"
    make(path)
    before = snapshot(config_dir)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            refused(path)
        except BaseException as exc:  # a failure, re-raised in the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)  # a blocked open() must not hang the suite
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), f"reading {path} blocked"
    if outcome:
        raise outcome[0]
    assert snapshot(config_dir) == before
    with pytest.raises(ConfigError, match=re.escape(reason)):
        load_config(path, required=True)


def test_a_utf8_bom_and_crlf_line_ends_are_plain_yaml(config_dir: Path) -> None:
    path = config_dir / "config.yaml"
    path.write_bytes(b"\xef\xbb\xbfversion: v1\r\nreconcile:\r\n  interval_seconds: 30\r\n")
    assert load_config(path, required=True).config.reconcile.interval_seconds == 30


def test_aliases_within_the_bound_still_work(config_dir: Path) -> None:
    path = config_dir / "config.yaml"
    path.write_text(V1 + "toolkit:\n  runtime_config:\n    a: &mode cdi\n    b: *mode\n"
                         "    c: &list [1, 2, 3]\n    d: *list\n")
    assert load_config(path, required=True).config.toolkit.runtime_config == {
        "a": "cdi", "b": "cdi", "c": [1, 2, 3], "d": [1, 2, 3]}


def test_a_reload_that_fails_inside_the_loader_keeps_the_running_config(
        root: Path, write_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload boundary: even an exception the loader should never raise ends as a reload error."""
    from gpu_agent.daemon import app
    from gpu_agent.host.paths import Root

    config = write_config()
    loaded = load_config(config, required=True)
    runtime = app.Runtime.build(Root(root), loaded, "t4")

    def broken(path: Path, required: bool, running: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    async def reload() -> app.Daemon:
        daemon = app.Daemon(runtime, config, config_required=True)
        stages = list(runtime.engine.stages)
        monkeypatch.setattr(app, "reload_config", broken)
        await daemon._reload()
        assert runtime.engine.stages == stages
        return daemon

    daemon = asyncio.run(reload())
    assert daemon.state.config is loaded
    assert daemon.state.config_error == (f"{config}: reload failed with an internal error (RecursionError); "
                                         "see the agent's log")


@pytest.mark.subprocess
def test_sighup_with_each_bad_config_keeps_the_daemon_and_its_config(agent) -> None:
    daemon = agent("t4")
    daemon.wait_ready()
    good = daemon.config.read_text()
    digest = json.loads(daemon.get("/status")[1])["config"]["digest"]

    def reload_with(make: Callable[[Path], None]) -> dict:
        remove(daemon.config)
        make(daemon.config)
        daemon.messages.clear()
        daemon.signal(signal.SIGHUP)
        daemon.wait_message(lambda m: "READY=1" in m.splitlines())
        assert daemon.get("/healthz") == (200, "ok\n")
        assert daemon.proc.poll() is None
        return json.loads(daemon.get("/status")[1])["config"]

    after = good.count("\n")  # the line of the first line appended to the good text is after + 1
    bad = [
        (lambda p: p.write_text(good + BOMB.replace(V1, "")),
         f"{daemon.config}:{after + 8}: alias *l4 makes the file expand to more than"),
        (lambda p: p.write_text(good + "health: " + "[" * 100_000 + "]" * 100_000 + "\n"),
         f"{daemon.config}:{after + 1}: "),
        (lambda p: p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256))), "not UTF-8 text"),
        (lambda p: p.write_text(good + "kubernetes:\n  kubeconfig: kubelet.conf\n"),
         "kubernetes.kubeconfig: must be an absolute path"),
        (make_directory, "not a regular file (it is a directory)"),
        (make_fifo, "not a regular file (it is a FIFO)"),
        (make_loop, "Too many levels of symbolic links"),
    ]
    for make, expected in bad:
        config = reload_with(make)
        assert (config["reload_error"] or "").startswith(f"{daemon.config}"), config
        assert expected in config["reload_error"], config
        assert config["digest"] == digest

    config = reload_with(lambda p: p.write_text(good + "discovery:\n  expected_gpus: 1\n"))
    assert config["reload_error"] is None and config["digest"] != digest
    assert daemon.stop(timeout=10) == 0
    assert "Traceback" not in daemon.output()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    else:
        path.unlink()


def test_runtime_config_tables_written_as_mappings_are_dotted_keys(config_dir: Path) -> None:
    """{nvidia-container-runtime: {log-level: debug}} sets that one key, as the dotted form does: the rest of
    the table the toolkit shipped stays."""
    path = config_dir / "config.yaml"
    path.write_text(V1 + "toolkit:\n  runtime_config:\n    nvidia-container-runtime:\n      log-level: debug\n"
                         "      modes:\n        cdi:\n          default-kind: nvidia.com/gpu\n"
                         "    disable-require: true\n")
    assert load_config(path, required=True).config.toolkit.runtime_config == {
        "nvidia-container-runtime.log-level": "debug",
        "nvidia-container-runtime.modes.cdi.default-kind": "nvidia.com/gpu", "disable-require": True}


@pytest.mark.parametrize("path", ["/var/run/cdi/nvidia.yaml", "/etc/cdi/nvidia.json", "/run/cdi/gpu-agent.yaml"])
def test_a_cdi_spec_in_a_spec_directory_is_accepted(config_dir: Path, path: str) -> None:
    config = config_dir / "config.yaml"
    config.write_text(V1 + f"toolkit:\n  cdi:\n    path: {path}\n")
    assert load_config(config, required=True).config.toolkit.cdi.path == path


@pytest.mark.parametrize("socket", ["/run/gpu-agent/agent.sock", "/var/run/gpu-agent.sock", "/run/elsewhere/agent.sock",
                                    ""])
def test_sockets_in_runtime_directories_are_accepted(config_dir: Path, socket: str) -> None:
    config = config_dir / "config.yaml"
    config.write_text(V1 + f"http:\n  socket: '{socket}'\n")
    assert load_config(config, required=True).config.http.socket == socket


@pytest.mark.parametrize("listen", ["[::1]:9445", "[fe80::1%eth0]:80", "0.0.0.0:1", "node-1.example:65535", ""])
def test_well_formed_listen_addresses_are_accepted(config_dir: Path, listen: str) -> None:
    config = config_dir / "config.yaml"
    config.write_text(V1 + f"http:\n  listen: '{listen}'\n")
    assert load_config(config, required=True).config.http.listen == listen


@pytest.mark.parametrize("argv, fragment", [
    (("--root", "", "check"), "argument --root: must name a directory"),
    (("--root", "/nonexistent", "status", "--root", "", "--json"), "argument --root: must name a directory"),
    *[(("--root", "/nonexistent", "status", "--wait", f"--timeout={value}"), "argument --timeout: expected a number")
      for value in ("nan", "inf", "-inf", "-1", "1e999", "x", "")],
])
def test_command_line_values_that_would_mean_something_else_are_refused(argv: tuple[str, ...], fragment: str,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """Class: an empty directory (the current one), a duration that never ends or makes no sense."""
    from gpu_agent.cli import main

    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 1
    assert fragment in capsys.readouterr().err
