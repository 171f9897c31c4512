"""Malformed container runtime configs, one row each, run through the toolkit stage in-process (by
the engine, as the daemon runs it). Every row must hold: the stage fails with a message naming the
file (and the key or line where there is one), every file under the root is byte-identical
afterwards, nothing is restarted, and the canary password planted in the configs appears in no
message, log record or state JSON (runtime configs hold registry credentials)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest

from gpu_agent.config.loader import load_config, validated
from gpu_agent.config.toolkit import ToolkitConfig
from gpu_agent.daemon.engine import Engine
from gpu_agent.host.paths import Root
from gpu_agent.stages.toolkit import Toolkit
from gpu_agent.state import FAILED, OK, AgentState
from gpu_agent.toolkit import configfile
from gpu_agent.toolkit.services import UnitState

CANARY = "canary-Pa55w0rd-7f3c91"
BINARY = "/usr/bin/nvidia-container-runtime"
CONTAINERD = "etc/containerd/config.toml"
CONF_D = "etc/containerd/conf.d"
DAEMON_JSON = "etc/docker/daemon.json"
CRIO = "etc/crio/crio.conf"
CRIO_D = "etc/crio/crio.conf.d"
NVIDIA_TOML = "etc/nvidia-container-runtime/config.toml"
CRI = 'plugins."io.containerd.grpc.v1.cri"'
AUTH = f"""
[{CRI}.registry.configs."registry.example.com".auth]
  username = "agent"
  password = "{CANARY}"
"""
V2 = "version = 2\n"
DOCKER_OK = json.dumps({"runtimes": {"nvidia": {"path": BINARY, "args": []}}}) + "\n"
CRIO_OK = f'[crio.runtime]\ndefault_runtime = "crun"\n[crio.runtime.runtimes.crun]\nruntime_path = "/usr/bin/crun"\n' \
          f'# registry password: {CANARY}\n'
MODE_CDI = {"runtime_config": {"nvidia-container-runtime.mode": "cdi"}}
Content = Union[str, bytes, Callable[[Path], None]]  # text, bytes, or something made at the path


def directory(path: Path) -> None:
    path.mkdir(parents=True)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def unix_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))


def link(target: str) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


@dataclass
class Row:
    id: str
    files: dict[str, Content]
    says: tuple[str, ...]  # every one of these is in the stage's message
    runtimes: tuple[str, ...] = ("containerd",)
    settings: dict[str, Any] = field(default_factory=dict)
    unreadable: Optional[str] = None  # this host path cannot be opened (EACCES): root reads any mode


def containerd(body: str, *, head: str = V2, extra: Optional[dict[str, Content]] = None) -> dict[str, Content]:
    return {CONTAINERD: head + body + AUTH, **(extra or {})}


ROWS = [
    # --- containerd: the root config, wrong types at every level of the path read or written ------
    Row("imports-string", containerd('imports = "x"\n'),
        (f"/{CONTAINERD}:2: imports: expected an array of strings, found a string",)),
    Row("imports-number", containerd("imports = 5\n"), (f"/{CONTAINERD}:2: imports:", "found a number")),
    Row("imports-numbers", containerd("imports = [1, 2]\n"), (f"/{CONTAINERD}:2: imports:", "array holding")),
    Row("imports-table", {CONTAINERD: V2 + "[imports]\n  x = 1\n" + AUTH}, (f"/{CONTAINERD}:2: imports:", "a table")),
    Row("imports-empty-path", containerd('imports = [""]\n'), (f"/{CONTAINERD}:2: imports: an empty path",)),
    Row("imports-bad-glob", containerd('imports = ["/etc/containerd/[x*.toml"]\n'),
        (f"/{CONTAINERD}:2: imports:", "not a valid glob pattern")),
    Row("plugins-number", {CONTAINERD: V2 + "plugins = 5\n"}, (f"/{CONTAINERD}:2: plugins: expected a table",)),
    Row("plugins-string", {CONTAINERD: V2 + f'plugins = "{CANARY}"\n'}, (f"/{CONTAINERD}:2: plugins:", "a string")),
    Row("cri-string", {CONTAINERD: V2 + '[plugins]\n"io.containerd.grpc.v1.cri" = "x"\n'},
        (f'/{CONTAINERD}:3: {CRI}: expected a table',)),
    Row("cri-containerd-string", containerd(f'[{CRI}]\ncontainerd = "x"\n'),
        (f"/{CONTAINERD}:3: {CRI}.containerd: expected a table",)),
    Row("runtimes-string", containerd(f'[{CRI}.containerd]\nruntimes = "x"\n'),
        (f"/{CONTAINERD}:3: {CRI}.containerd.runtimes: expected a table",)),
    Row("runtimes-array-of-tables", containerd(f'[[{CRI}.containerd.runtimes]]\nx = 1\n'),
        (f"/{CONTAINERD}:2: {CRI}.containerd.runtimes: expected a table, found an array",)),
    Row("runc-string", containerd(f'[{CRI}.containerd.runtimes]\nrunc = "x"\n'),
        (f"/{CONTAINERD}:3: {CRI}.containerd.runtimes.runc: expected a table",)),
    Row("runc-options-string", containerd(f'[{CRI}.containerd.runtimes.runc]\noptions = "x"\n'),
        (f"/{CONTAINERD}:3: {CRI}.containerd.runtimes.runc.options: expected a table",)),
    Row("runc-options-inline", containerd(f"[{CRI}.containerd]\nruntimes = {{ runc = {{ options = 5 }} }}\n"),
        (f"/{CONTAINERD}:3: {CRI}.containerd.runtimes.runc.options: expected a table",)),
    Row("runtime-type-array", containerd(f'[{CRI}.containerd.runtimes.runc]\nruntime_type = ["x"]\n'),
        (f"{CRI}.containerd.runtimes.runc.runtime_type: expected a string, found an array",)),
    Row("default-runtime-name-number", containerd(f"[{CRI}.containerd]\ndefault_runtime_name = 5\n"),
        (f"/{CONTAINERD}:3: {CRI}.containerd.default_runtime_name: expected a string",)),
    Row("enable-cdi-string", containerd(f'[{CRI}]\nenable_cdi = "yes"\n'),
        (f"/{CONTAINERD}:3: {CRI}.enable_cdi: expected true or false",)),
    Row("dotted-runtimes-string", containerd(f'{CRI}.containerd.runtimes = "x"\n'),
        (f"/{CONTAINERD}:2: {CRI}.containerd.runtimes: expected a table",)),
    Row("version-string", containerd("", head='version = "2"\n'), (f"/{CONTAINERD}:1: version: expected an integer",)),
    Row("version-boolean", containerd("", head="version = true\n"), (f"/{CONTAINERD}:1: version:", "found true")),
    Row("version-float", containerd("", head="version = 2.0\n"), (f"/{CONTAINERD}:1: version:", "a number")),
    Row("version-unknown", containerd("", head="version = 7\n"), (f"/{CONTAINERD}:1: version: not a containerd",)),
    Row("v3-runtimes-string", {CONTAINERD: 'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n'
                                           'runtimes = "x"\n' + AUTH},
        (f'/{CONTAINERD}:3: plugins."io.containerd.cri.v1.runtime".containerd.runtimes: expected a table',)),
    Row("v1-cri-number", {CONTAINERD: f"[plugins]\ncri = 5\n# {CANARY}\n"}, (f"/{CONTAINERD}:2: plugins.cri:",)),
    # --- containerd: the file itself ------------------------------------------------------------
    Row("non-utf8", {CONTAINERD: (V2 + AUTH).encode() + b"# caf\xe9\n"}, (f"/{CONTAINERD}:6:", "not UTF-8")),
    Row("directory", {CONTAINERD: directory}, (f"/{CONTAINERD}: is a directory",)),
    Row("fifo", {CONTAINERD: fifo}, (f"/{CONTAINERD}: is a FIFO",)),
    Row("socket", {CONTAINERD: unix_socket}, (f"/{CONTAINERD}: is a socket",)),
    Row("unreadable", containerd(""), (f"/{CONTAINERD}: cannot be read: Permission denied",),
        unreadable=f"/{CONTAINERD}"),
    Row("too-large", {CONTAINERD: V2 + AUTH + "#" * configfile.MAX_BYTES + "\n"}, (f"/{CONTAINERD}: is ", "bytes")),
    Row("dangling-link", {CONTAINERD: link("/opt/site/containerd.toml")},
        (f"/{CONTAINERD} (a link to /opt/site/containerd.toml): the link leads to nothing",)),
    Row("link-loop", {CONTAINERD: link("config.toml")}, (f"/{CONTAINERD}: too many levels of symbolic links",)),
    Row("syntax-unterminated-secret", {CONTAINERD: V2 + f'[{CRI}.registry.configs."r".auth]\npassword = "{CANARY}\n'},
        (f"/{CONTAINERD}:3:", "not valid TOML")),
    Row("syntax-bare-secret", {CONTAINERD: V2 + f'[{CRI}.registry.configs."r".auth]\npassword = {CANARY}\n'},
        (f"/{CONTAINERD}:3:", "not valid TOML")),
    Row("syntax-secret-as-key", {CONTAINERD: V2 + f"{CANARY}\n"}, (f"/{CONTAINERD}:2:", "not valid TOML")),
    Row("duplicate-key", {CONTAINERD: V2 + AUTH + f'  password = "{CANARY}"\n'},
        (f"/{CONTAINERD}:6: not valid TOML: a key or table defined twice",)),
    Row("nested-too-deep", {CONTAINERD: V2 + "x = " + "[" * 5000 + "]" * 5000 + "\n" + AUTH},
        (f"/{CONTAINERD}", "nested more than 100 levels deep")),
    # --- containerd: imported files ---------------------------------------------------------------
    Row("import-missing", containerd('imports = ["/etc/containerd/site.toml"]\n'),
        (f"/{CONTAINERD}: imports /etc/containerd/site.toml, which does not exist",)),
    Row("import-relative-missing", containerd('imports = ["site.toml"]\n'),
        (f"/{CONTAINERD}: imports /etc/containerd/site.toml, which does not exist",)),
    Row("import-directory", containerd('imports = ["/etc/containerd/site"]\n',
                                       extra={"etc/containerd/site": directory}),
        ("/etc/containerd/site (imported by /etc/containerd/config.toml): is a directory",)),
    Row("import-wrong-type", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                        extra={f"{CONF_D}/10-site.toml": f"version = 2\n[{CRI}]\ncontainerd = 5\n"}),
        (f"/{CONF_D}/10-site.toml:3: {CRI}.containerd: expected a table",)),
    Row("import-dot-file-wrong-type", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                                 extra={f"{CONF_D}/.hidden.toml": "plugins = 5\n"}),
        (f"/{CONF_D}/.hidden.toml:1: plugins: expected a table",)),
    Row("nested-relative-import-wrong-type",
        containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                   extra={f"{CONF_D}/10-site.toml": 'imports = ["site/extra.conf"]\n',
                          f"{CONF_D}/site/extra.conf": "imports = 5\n"}),
        (f"/{CONF_D}/site/extra.conf:1: imports: expected an array of strings",)),
    Row("import-non-utf8", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                      extra={f"{CONF_D}/10-site.toml": b"# \xff\n"}),
        (f"/{CONF_D}/10-site.toml:1:3: not UTF-8",)),
    Row("import-fifo", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                  extra={f"{CONF_D}/10-site.toml": fifo}),
        (f"/{CONF_D}/10-site.toml (imported by /{CONTAINERD}): is a FIFO",)),
    Row("import-syntax", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                    extra={f"{CONF_D}/10-site.toml": f'password = "{CANARY}'}),
        (f"/{CONF_D}/10-site.toml:1:", "not valid TOML")),
    Row("import-glob-matches-a-directory", containerd('imports = ["/etc/containerd/*"]\n', extra={CONF_D: directory}),
        (f"/etc/containerd/conf.d (imported by /{CONTAINERD}): is a directory",)),
    Row("import-glob-matches-our-directory-to-be", containerd('imports = ["/etc/containerd/*"]\n'),
        (f"/{CONTAINERD}: imports /etc/containerd/conf.d, the directory the agent's",)),
    Row("our-drop-in-is-a-directory", containerd('imports = ["/etc/containerd/conf.d/*.toml"]\n',
                                                 extra={f"{CONF_D}/99-nvidia.toml": directory}),
        (f"/{CONF_D}/99-nvidia.toml: is a directory",)),
    # --- Docker: daemon.json ----------------------------------------------------------------------
    Row("docker-non-utf8", {DAEMON_JSON: b'{"x": "\xff"}'}, (f"/{DAEMON_JSON}:1:8: not UTF-8",), ("docker",)),
    Row("docker-nested-100000", {DAEMON_JSON: "[" * 100_000 + "]" * 100_000},
        (f"/{DAEMON_JSON}:1:101: nested more than 100 levels deep",), ("docker",)),
    Row("docker-list", {DAEMON_JSON: f'["{CANARY}"]'}, (f"/{DAEMON_JSON}: expected an object at the top level",),
        ("docker",)),
    Row("docker-number", {DAEMON_JSON: "5"}, (f"/{DAEMON_JSON}: expected an object", "found a number"), ("docker",)),
    Row("docker-null", {DAEMON_JSON: "null"}, (f"/{DAEMON_JSON}: expected an object", "found null"), ("docker",)),
    Row("docker-nan", {DAEMON_JSON: f'{{"proxy": "http://u:{CANARY}@p",\n "x": NaN}}'},
        (f"/{DAEMON_JSON}:2:7: NaN or Infinity is not JSON",), ("docker",)),
    Row("docker-infinity", {DAEMON_JSON: '{"x": -Infinity}'}, (f"/{DAEMON_JSON}:1:7: NaN or Infinity",), ("docker",)),
    Row("docker-huge-number", {DAEMON_JSON: '{"x": 1e999}'}, (f"/{DAEMON_JSON}: a number too large",), ("docker",)),
    Row("docker-duplicate-key", {DAEMON_JSON: f'{{"runtimes": {{}}, "runtimes": {{"x": "{CANARY}"}}}}'},
        (f'/{DAEMON_JSON}: the key "runtimes" appears twice',), ("docker",)),
    Row("docker-runtimes-string", {DAEMON_JSON: f'{{"runtimes": "{CANARY}"}}'},
        (f"/{DAEMON_JSON}: runtimes: expected an object, found a string",), ("docker",)),
    Row("docker-nvidia-array", {DAEMON_JSON: '{"runtimes": {"nvidia": []}}'},
        (f"/{DAEMON_JSON}: runtimes.nvidia: expected an object",), ("docker",)),
    Row("docker-nvidia-path-number", {DAEMON_JSON: '{"runtimes": {"nvidia": {"path": 5}}}'},
        (f"/{DAEMON_JSON}: runtimes.nvidia.path: expected a string",), ("docker",)),
    Row("docker-nvidia-args-string", {DAEMON_JSON: f'{{"runtimes": {{"nvidia": {{"args": "{CANARY}"}}}}}}'},
        (f"/{DAEMON_JSON}: runtimes.nvidia.args: expected an array of strings",), ("docker",)),
    Row("docker-default-runtime-number", {DAEMON_JSON: '{"default-runtime": 5}'},
        (f"/{DAEMON_JSON}: default-runtime: expected a string",), ("docker",)),
    Row("docker-features-list", {DAEMON_JSON: '{"features": ["cdi"]}'},
        (f"/{DAEMON_JSON}: features: expected an object",), ("docker",)),
    Row("docker-features-cdi-string", {DAEMON_JSON: '{"features": {"cdi": "yes"}}'},
        (f"/{DAEMON_JSON}: features.cdi: expected true or false",), ("docker",)),
    Row("docker-syntax-bare-secret", {DAEMON_JSON: f'{{"proxy":\n {CANARY}}}'},
        (f"/{DAEMON_JSON}:2:2: not valid JSON",), ("docker",)),
    Row("docker-truncated", {DAEMON_JSON: f'{{"proxy": "http://u:{CANARY}@p"'},
        (f"/{DAEMON_JSON}:1:", "not valid JSON"), ("docker",)),
    Row("docker-bom", {DAEMON_JSON: "\ufeff{}"}, (f"/{DAEMON_JSON}:1:1: not valid JSON",), ("docker",)),
    Row("docker-directory", {DAEMON_JSON: directory}, (f"/{DAEMON_JSON}: is a directory",), ("docker",)),
    Row("docker-dangling-link", {DAEMON_JSON: link("../../nowhere.json")},
        (f"/{DAEMON_JSON} (a link to /nowhere.json): the link leads to nothing",), ("docker",)),
    # --- CRI-O: crio.conf and every file under crio.conf.d ---------------------------------------
    Row("crio-runtimes-string", {CRIO: f'[crio.runtime]\nruntimes = "{CANARY}"\n'},
        (f"/{CRIO}:2: crio.runtime.runtimes: expected a table, found a string",), ("crio",)),
    Row("crio-crio-number", {CRIO: "crio = 5\n"}, (f"/{CRIO}:1: crio: expected a table",), ("crio",)),
    Row("crio-runtime-string", {CRIO: '[crio]\nruntime = "x"\n'}, (f"/{CRIO}:2: crio.runtime: expected a table",),
        ("crio",)),
    Row("crio-default-runtime-array", {CRIO: '[crio.runtime]\ndefault_runtime = ["crun"]\n'},
        (f"/{CRIO}:2: crio.runtime.default_runtime: expected a string",), ("crio",)),
    Row("crio-runtime-entry-string", {CRIO: '[crio.runtime.runtimes]\ncrun = "x"\n'},
        (f"/{CRIO}:2: crio.runtime.runtimes.crun: expected a table",), ("crio",)),
    Row("crio-drop-in-wrong-type", {CRIO: CRIO_OK, f"{CRIO_D}/10-site.conf": "[crio.runtime]\nruntimes = 5\n"},
        (f"/{CRIO_D}/10-site.conf:2: crio.runtime.runtimes: expected a table",), ("crio",)),
    Row("crio-drop-in-any-name", {CRIO: CRIO_OK, f"{CRIO_D}/README": f"password: {CANARY}\n"},
        (f"/{CRIO_D}/README:1:", "not valid TOML"), ("crio",)),
    Row("crio-drop-in-subdirectory", {CRIO: CRIO_OK, f"{CRIO_D}/site/10.conf": "[crio]\nruntime = 5\n"},
        (f"/{CRIO_D}/site/10.conf:2: crio.runtime: expected a table",), ("crio",)),
    Row("crio-drop-in-fifo", {CRIO: CRIO_OK, f"{CRIO_D}/10-site.conf": fifo}, (f"/{CRIO_D}/10-site.conf: is a FIFO",),
        ("crio",)),
    Row("crio-non-utf8", {CRIO: CRIO_OK.encode() + b"\xc3\x28\n"}, (f"/{CRIO}:6:1: not UTF-8",), ("crio",)),
    Row("crio-drop-in-directory-loop", {CRIO: CRIO_OK, CRIO_D: link("crio.conf.d")},
        (f"/{CRIO_D}: too many levels of symbolic links",), ("crio",)),
    Row("crio-drop-in-forged-log-line", {CRIO: CRIO_OK, f"{CRIO_D}/a\nERROR forged": f"x = {CANARY}\n"},
        (f"/{CRIO_D}/a\\nERROR forged:1:", "not valid TOML"), ("crio",)),
    Row("crio-our-drop-in-is-a-directory", {CRIO: CRIO_OK, f"{CRIO_D}/99-nvidia.conf": directory},
        (f"/{CRIO_D}/99-nvidia.conf: is a directory",), ("crio",)),
    # --- nvidia-container-runtime's config.toml ---------------------------------------------------
    Row("nvidia-toml-parent-string", {DAEMON_JSON: DOCKER_OK, NVIDIA_TOML: f'nvidia-container-runtime = "{CANARY}"\n'},
        (f"/{NVIDIA_TOML}:1: nvidia-container-runtime: expected a table, found a string",), ("docker",),
        MODE_CDI),
    Row("nvidia-toml-parent-array-of-tables", {DAEMON_JSON: DOCKER_OK, NVIDIA_TOML: "[[nvidia-container-runtime]]\n"},
        (f"/{NVIDIA_TOML}:1: nvidia-container-runtime: expected a table, found an array",), ("docker",),
        MODE_CDI),
    Row("nvidia-toml-syntax", {DAEMON_JSON: DOCKER_OK, NVIDIA_TOML: f'[nvidia-container-runtime\nx = "{CANARY}"\n'},
        (f"/{NVIDIA_TOML}:1:", "not valid TOML"), ("docker",), MODE_CDI),
    Row("nvidia-toml-non-utf8", {DAEMON_JSON: DOCKER_OK, NVIDIA_TOML: b"# \xff\n"}, (f"/{NVIDIA_TOML}:1:3: not UTF-8",),
        ("docker",), MODE_CDI),
    Row("nvidia-toml-directory", {DAEMON_JSON: DOCKER_OK, NVIDIA_TOML: directory},
        (f"/{NVIDIA_TOML}: is a directory",), ("docker",), MODE_CDI),
]


class RecordingServices:
    """Every runtime is running; restarts are recorded (and must not happen here)."""

    def __init__(self) -> None:
        self.restarts: list[str] = []

    def state(self, unit: str) -> Optional[UnitState]:
        return UnitState(unit, "loaded", "active", "running", "")

    def restart(self, unit: str) -> None:
        self.restarts.append(unit)

    def wait_ready(self, unit: str, socket_path: str, timeout: float,
                   progress: Callable[[str], None] = lambda waiting: None) -> Optional[str]:
        return None


class NoPackages:
    def install(self, package: str) -> None:
        raise AssertionError(f"nothing may be installed here ({package})")


def make_node(root: Path) -> None:
    """The NVIDIA Container Toolkit 1.17.8, installed under `root`."""
    for binary in (BINARY, "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-ctk", "/usr/bin/nvidia-cdi-hook"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n")


def place(root: Path, files: dict[str, Content]) -> None:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            content(path)


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under the root: kind, mode, and bytes or link target."""
    seen: dict[str, Any] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                seen[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                seen[str(path)] = ("file", info.st_mode, path.read_bytes())
            else:
                seen[str(path)] = ("other", info.st_mode)
    return seen


@dataclass
class Outcome:
    state: str
    message: str
    services: RecordingServices
    agent: AgentState


def run_stage(root: Path, tmp_path: Path, runtimes: tuple[str, ...], settings: dict[str, Any]) -> Outcome:
    """One reconcile of the toolkit stage alone, by the engine (internal errors included)."""
    agent = AgentState(load_config(tmp_path / "no-config.yaml", required=False))
    services = RecordingServices()
    config = validated(ToolkitConfig, {"runtimes": list(runtimes), "cdi": {"enabled": False}, **settings})
    stage = Toolkit(Root(root), services, NoPackages(), config)
    stage.requires = ()  # type: ignore[assignment]  # run alone: discovery is not part of this test
    engine = Engine([stage], agent, agent.config.config.reconcile)
    run = asyncio.run(engine.reconcile(force=True))[0]
    return Outcome(run.state, run.message, services, agent)


def assert_no_canary(outcome: Outcome, caplog: pytest.LogCaptureFixture) -> None:
    assert CANARY not in outcome.message
    assert CANARY not in caplog.text
    assert all(CANARY not in record.getMessage() for record in caplog.records)
    assert CANARY not in json.dumps(outcome.agent.to_json())
    assert all(CANARY not in check.reason for check in outcome.agent.checks())


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_malformed_runtime_config_is_refused_and_nothing_changes(
        row: Row, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, row.files)
    if row.unreadable is not None:
        denied = str(root / row.unreadable.lstrip("/"))
        real_open = os.open

        def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if str(path) == denied:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(configfile.os, "open", refusing_open)
    before = snapshot(root)
    caplog.set_level(logging.DEBUG)

    outcome = run_stage(root, tmp_path, row.runtimes, row.settings)

    assert outcome.state == FAILED, outcome.message
    assert "internal error" not in outcome.message
    for words in row.says:
        assert words in outcome.message, outcome.message
    assert "nothing was changed" in outcome.message or "was not changed" in outcome.message
    assert snapshot(root) == before
    assert outcome.services.restarts == []
    assert_no_canary(outcome, caplog)


def test_the_table_covers_every_reader() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)) >= 40
    touched = {path for row in ROWS for path in row.files}
    for prefix in (CONTAINERD, CONF_D, DAEMON_JSON, CRIO, CRIO_D, NVIDIA_TOML):
        assert any(path.startswith(prefix) for path in touched), prefix


@pytest.mark.subprocess  # the real containerd validates
@pytest.mark.skipif(shutil.which("containerd") is None, reason="needs the real containerd to validate with")
@pytest.mark.parametrize("body", [f'oom_score = "{CANARY}"\n', f'[{CRI}]\nsandbox_image = ["{CANARY}"]\n',
                                  f'[{CRI}.registry.configs."r".auth]\npassword = ["{CANARY}"]\n'],
                         ids=["top-level", "cri", "auth"])
def test_containerd_rejecting_a_value_never_echoes_it(
        body: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """containerd's own message quotes the value it cannot convert: only its words of ours pass."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {CONTAINERD: V2 + body})
    before = snapshot(root)
    caplog.set_level(logging.DEBUG)
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == FAILED
    assert "containerd rejects the result: a value of the wrong type at line" in outcome.message, outcome.message
    assert snapshot(root) == before and outcome.services.restarts == []
    assert_no_canary(outcome, caplog)


def test_a_healthy_node_still_converges(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The control row: the same canary-bearing files, well formed, are configured."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {DAEMON_JSON: json.dumps({"proxies": {"http-proxy": f"http://u:{CANARY}@proxy"}}), CRIO: CRIO_OK})
    caplog.set_level(logging.DEBUG)
    outcome = run_stage(root, tmp_path, ("docker", "crio"), {})
    assert outcome.state == OK, outcome.message
    assert outcome.services.restarts == ["docker.service", "crio.service"]
    assert json.loads((root / DAEMON_JSON).read_text())["runtimes"]["nvidia"] == {"path": BINARY, "args": []}
    assert_no_canary(outcome, caplog)


# --- symbolic links are written through, never replaced, never followed out of the root ------------

@pytest.mark.subprocess  # the real containerd validates, where installed
def test_a_linked_containerd_config_is_written_through_to_its_target(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    text = V2 + AUTH
    place(root, {"opt/site/containerd.toml": text, CONTAINERD: link("/opt/site/containerd.toml")})
    (root / "opt/site/containerd.toml").chmod(0o600)
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == OK, outcome.message
    assert os.readlink(root / CONTAINERD) == "/opt/site/containerd.toml"  # still the link
    target = (root / "opt/site/containerd.toml").read_text()
    assert target == 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]  # added by gpu-agent\n' + AUTH
    assert (root / CONF_D / "99-nvidia.toml").stat().st_mode & 0o777 == 0o600  # the target's mode
    assert [p.read_text() for p in (root / "var/lib/gpu-agent/backups").iterdir()] == [text]
    assert outcome.services.restarts == ["containerd.service"]
    assert run_stage(root, tmp_path, ("containerd",), {}).services.restarts == []  # converged through the link


def test_relative_links_and_linked_directories_are_followed_too(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"srv/docker/daemon.json": '{"log-driver": "journald"}', "etc/docker": link("../srv/docker")})
    outcome = run_stage(root, tmp_path, ("docker",), {})
    assert outcome.state == OK, outcome.message
    assert (root / "etc/docker").is_symlink()
    written = json.loads((root / "srv/docker/daemon.json").read_text())
    assert written["log-driver"] == "journald" and written["runtimes"]["nvidia"]["path"] == BINARY


def test_a_missing_file_under_a_linked_directory_is_created_there(tmp_path: Path) -> None:
    """Only a link that leads to nothing is refused; a file not made yet under a directory reached
    through a link (/etc/docker -> /srv/docker, no daemon.json yet) is a file to create."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"srv/docker/.keep": "", "etc/docker": link("/srv/docker")})
    outcome = run_stage(root, tmp_path, ("docker",), {})
    assert outcome.state == OK, outcome.message
    assert json.loads((root / "srv/docker/daemon.json").read_text())["runtimes"]["nvidia"]["path"] == BINARY
    assert (root / "etc/docker").is_symlink()


def test_a_linked_directory_that_leads_to_nothing_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"etc/docker": link("/srv/gone")})
    before = snapshot(tmp_path)
    outcome = run_stage(root, tmp_path, ("docker",), {})
    assert outcome.state == FAILED
    assert f"/{DAEMON_JSON} (a link to /srv/gone/daemon.json): the link leads to nothing" in outcome.message
    assert snapshot(tmp_path) == before


@pytest.mark.subprocess  # the real containerd validates, where installed
def test_a_runtime_whose_config_directory_is_a_link_is_found(tmp_path: Path) -> None:
    """/etc/containerd -> /opt/containerd is the node's /opt: followed under the root, never on this machine."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"opt/containerd/config.toml": V2, "etc/containerd": link("/opt/containerd")})
    outcome = run_stage(root, tmp_path, (), {"runtimes": "auto"})
    assert outcome.state == OK, outcome.message
    assert outcome.services.restarts == ["containerd.service"]
    assert (root / "opt/containerd/conf.d/99-nvidia.toml").is_file()


def test_a_temp_file_a_crash_left_in_a_linked_directory_is_found_there_not_on_this_machine(tmp_path: Path) -> None:
    """The stray temp files are looked for where /etc/docker leads under the root. Given root/etc/docker, a
    link to /usr/lib, the OS followed it to this machine's /usr/lib (which every machine has; Python 3.13's
    glob lists such a directory whether it exists or not): a temp file of that name there would have been
    removed from this machine, and the guard sees the listing."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"usr/lib/daemon.json": "{}\n", "etc/docker": link("/usr/lib"),
                 "usr/lib/.daemon.json.k2j4x9qz.tmp": "half written"})
    outcome = run_stage(root, tmp_path, ("docker",), {})
    assert outcome.state == OK, outcome.message
    assert not (root / "usr/lib/.daemon.json.k2j4x9qz.tmp").exists()


def test_debians_docker_is_found_by_its_dockerd_in_sbin(tmp_path: Path) -> None:
    """docker.io installs /usr/sbin/dockerd and no daemon.json (the e2e matrix found it left out)."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {"usr/sbin/dockerd": ""})
    outcome = run_stage(root, tmp_path, (), {"runtimes": "auto"})
    assert outcome.state == OK, outcome.message
    assert outcome.services.restarts == ["docker.service"]
    assert "nvidia" in json.loads((root / "etc/docker/daemon.json").read_text())["runtimes"]


def test_a_link_never_leads_out_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    outside = tmp_path / "outside.json"
    outside.write_text("{}\n")
    place(root, {DAEMON_JSON: link(str(outside))})  # absolute: read as a path under the root
    before = snapshot(tmp_path)
    outcome = run_stage(root, tmp_path, ("docker",), {})
    assert outcome.state == FAILED
    assert f"/{DAEMON_JSON} (a link to {outside}): the link leads to nothing" in outcome.message
    assert snapshot(tmp_path) == before and outside.read_text() == "{}\n"
    assert configfile.resolve(Root(root), "/etc/docker/../../../../daemon.json") == "/daemon.json"


# --- containerd imports are resolved as containerd resolves them -----------------------------------

@pytest.mark.subprocess  # the real containerd validates, where installed
def test_a_relative_import_is_read_from_the_config_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {CONTAINERD: V2 + 'imports = ["site/registry.toml"]\n',
                 "etc/containerd/site/registry.toml": f'version = 2\n[{CRI}]\nsandbox_image = "site/pause:1"\n'})
    outcome = run_stage(root, tmp_path, ("containerd",), {})  # validated by the real containerd where installed
    assert outcome.state == OK, outcome.message
    drop_in = (root / CONF_D / "99-nvidia.toml").read_text()
    assert 'sandbox_image = "site/pause:1"' in drop_in
    assert 'imports = ["site/registry.toml", "/etc/containerd/conf.d/*.toml"]' in (root / CONTAINERD).read_text()


@pytest.mark.subprocess  # the real containerd validates, where installed
def test_dot_files_matched_by_an_import_glob_count(tmp_path: Path) -> None:
    """Go's glob matches dot files (containerd 1.6 loads conf.d/.x.toml): the drop-in inherits it."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {CONTAINERD: V2 + 'imports = ["/etc/containerd/conf.d/*.toml"]\n',
                 f"{CONF_D}/.site.toml": f'version = 2\n[{CRI}]\nsandbox_image = "dot/pause:1"\n'})
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == OK, outcome.message
    assert 'sandbox_image = "dot/pause:1"' in (root / CONF_D / "99-nvidia.toml").read_text()


def test_a_relative_glob_is_read_from_the_config_directory_by_containerd_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.toolkit import containerd

    monkeypatch.setattr(containerd.shutil, "which", lambda name: "/usr/bin/containerd")
    monkeypatch.setattr(containerd, "_release", lambda binary, timeout: (2, 0))
    monkeypatch.setattr(containerd, "validate", lambda *args, **kwargs: None)  # no containerd 2 here
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {CONTAINERD: V2 + 'imports = ["conf.d/*.toml"]\n',
                 f"{CONF_D}/10-site.toml": f'version = 2\n[{CRI}]\nsandbox_image = "glob/pause:1"\n'})
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == OK, outcome.message
    assert (root / CONTAINERD).read_text() == V2 + 'imports = ["conf.d/*.toml"]\n'  # the glob is already ours
    assert 'sandbox_image = "glob/pause:1"' in (root / CONF_D / "99-nvidia.toml").read_text()


@pytest.mark.parametrize("files, where, absolute", [
    ({CONTAINERD: V2 + 'imports = ["conf.d/*.toml"]\n'}, f"/{CONTAINERD}:2", "/etc/containerd/conf.d/*.toml"),
    ({CONTAINERD: V2 + 'imports = ["/etc/containerd/conf.d/*.toml"]\n',
      f"{CONF_D}/10-site.toml": 'imports = ["more/*.toml"]\n'}, f"/{CONF_D}/10-site.toml:1",
     "/etc/containerd/conf.d/more/*.toml"),
], ids=["root", "nested"])
def test_a_relative_glob_is_refused_with_containerd_1(
        files: dict[str, Content], where: str, absolute: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """containerd 1.x globs a relative pattern against its working directory: say so, change nothing."""
    from gpu_agent.toolkit import containerd

    monkeypatch.setattr(containerd.shutil, "which", lambda name: "/usr/bin/containerd")
    monkeypatch.setattr(containerd, "_release", lambda binary, timeout: (1, 7))
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, files)
    before = snapshot(root)
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == FAILED
    assert f"{where}: imports: the relative pattern" in outcome.message, outcome.message
    assert "is read against containerd's working directory by the installed containerd 1.x" in outcome.message
    assert f"write it as an absolute path, e.g. {absolute}" in outcome.message
    assert snapshot(root) == before


@pytest.mark.subprocess  # the real containerd validates
@pytest.mark.skipif(shutil.which("containerd") is None, reason="needs the real containerd")
def test_validation_sees_the_files_containerd_sees(tmp_path: Path) -> None:
    """A nested relative import that replaces the CRI table after our drop-in is caught by the real
    containerd reading a copy of exactly the imported files, and named."""
    root = tmp_path / "root"
    root.mkdir()
    make_node(root)
    place(root, {CONTAINERD: V2 + 'imports = ["/etc/containerd/conf.d/*.toml"]\n',
                 f"{CONF_D}/10-site.toml": 'version = 2\nimports = ["late/cri.toml"]\n',
                 f"{CONF_D}/late/cri.toml": f'version = 2\n[{CRI}]\nsandbox_image = "late/pause:1"\n'})
    before = snapshot(root)
    outcome = run_stage(root, tmp_path, ("containerd",), {})
    assert outcome.state == FAILED
    assert "containerd's effective config has no nvidia runtime" in outcome.message
    assert f"/{CONF_D}/late/cri.toml loads after /{CONF_D}/99-nvidia.toml and replaces its CRI table" in outcome.message
    assert snapshot(root) == before


# --- Go's glob, as containerd runs it ---------------------------------------------------------------

@pytest.mark.parametrize("pattern, matches", [
    ("/d/*.toml", ["/d/.hidden.toml", "/d/a.toml", "/d/b.toml", "/d/sub.toml"]),  # dot files too, sorted
    ("/d/?.toml", ["/d/a.toml", "/d/b.toml"]),
    ("/d/[a-b].toml", ["/d/a.toml", "/d/b.toml"]),
    ("/d/[^a].toml", ["/d/b.toml"]),
    ("/d/\\*.toml", []),
    ("/*/a.toml", ["/d/a.toml", "/e/a.toml"]),
    ("/d/sub.toml/*", ["/d/sub.toml/x"]),  # directories match like files
    ("/d/*a*a*a*a*a*a*a*a*a*a*a*a*b", []),  # many stars over a long name: no exponential matching
    ("/d/a*a*a", ["/d/" + "a" * 200]),
])
def test_import_globs_match_as_go_does(tmp_path: Path, pattern: str, matches: list[str]) -> None:
    place(tmp_path, {"d/a.toml": "", "d/b.toml": "", "d/.hidden.toml": "", "d/c.conf": "", "d/sub.toml/x": "",
                     "e/a.toml": "", "d/" + "a" * 200: ""})
    assert configfile.glob(Root(tmp_path), pattern) == matches


@pytest.mark.parametrize("pattern", ["/d/[", "/d/[]a]", "/d/a\\", "/d/[z-a]", "/[/*.toml"])
def test_a_glob_go_rejects_is_refused(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(configfile.BadPattern):
        configfile.glob(Root(tmp_path), pattern)
