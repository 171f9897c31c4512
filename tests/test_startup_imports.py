"""The process contract of the quick commands: `--help`, `status` and `labels` (a daemon running) answer
without loading pydantic or asyncio, which cost them most of their start-up."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli

from gpu_agent.cli import main

HEAVY = ("pydantic", "pydantic_core", "asyncio")


def imported(*args: str, root: Path, config: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run `gpu-agent ARGS` under -X importtime: the result, and the top-level packages it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpu_agent", "--root", str(root),
                             "--config", str(config), *args],
                            capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0]
               for line in result.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    assert "gpu_agent" in modules, result.stderr[-2000:]
    return result, modules


@pytest.mark.subprocess
def test_help_imports_neither_pydantic_nor_asyncio(root: Path, write_config) -> None:
    result, modules = imported("--help", root=root, config=write_config())
    assert result.returncode == 0 and "status" in result.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.subprocess
def test_status_and_labels_ask_the_daemon_without_pydantic_or_asyncio(agent, root: Path) -> None:
    daemon = agent("a30")
    daemon.wait_ready()
    status, modules = imported("status", root=root, config=daemon.config)
    assert status.returncode == 0, status.stderr[-2000:]
    assert "ready: 1x A30" in status.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "yaml" not in modules  # the socket at its default path answered: no config to read

    labels, modules = imported("labels", root=root, config=daemon.config)
    assert labels.returncode == 0, labels.stderr[-2000:]
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    from_daemon = labels.stdout
    assert "nvidia.com/gpu.product=NVIDIA-A30\n" in from_daemon and "nvidia.com/gpu-agent.ready=true\n" in from_daemon

    daemon.stop()
    here = cli("--simulate", "a30", "labels", root=root, config=daemon.config)
    assert here.returncode == 0, here.stderr
    assert here.stdout == from_daemon  # the daemon's labels are the ones a pass in this process computes


@pytest.mark.subprocess
def test_status_finds_a_socket_the_config_moved(agent, root: Path) -> None:
    daemon = agent("a30", settings={"http": {"listen": "", "socket": "/run/elsewhere/agent.sock"}})
    daemon.wait_ready()
    result = cli("status", root=root, config=daemon.config)
    assert result.returncode == 0 and "ready: 1x A30" in result.stdout, result.stderr


def test_status_with_a_bad_http_section_names_the_key(root: Path, write_config, capsys) -> None:
    """The quick reader of the http section leaves a doubtful one to the full loader, for its message."""
    config = write_config(text="version: v1\nhttp:\n  listen: nowhere\n")
    assert main(["--root", str(root), "--config", str(config), "status"]) == 1
    err = capsys.readouterr().err
    assert "config.yaml:3: http.listen" in err and "HOST:PORT" in err


@pytest.mark.subprocess
def test_the_daemon_imports_no_aiohttp() -> None:
    """The endpoint is h11 on the daemon's own accept loop: aiohttp's server (130 ms, 8 MiB) is not needed."""
    code = ("import sys, gpu_agent.daemon.app, gpu_agent.daemon.http\n"
            "assert 'h11' in sys.modules, 'no HTTP server'\n"
            "leaked = sorted(name for name in sys.modules if name.split('.')[0] in ('aiohttp', 'yarl', 'multidict'))\n"
            "assert not leaked, leaked\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
