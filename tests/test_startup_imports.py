"""The process contract of the quick commands: `--help`, `status` and `labels` (a daemon running) answer
without loading pydantic or asyncio, which cost them most of their start-up."""
from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
    daemon = agent("a30", env={"PYTHONPROFILEIMPORTTIME": "1"})
    daemon.wait_ready()
    status, modules = imported("status", root=root, config=daemon.config)
    assert status.returncode == 0, status.stderr[-2000:]
    assert "ready: 1x A30" in status.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "yaml" not in modules  # the socket at its default path answered: no config to read
    # Nor what a one-shot GET and a table do not need (they were a third of its start: http.client with
    # email and ssl, logging, shutil for argparse's width, dataclasses with inspect).
    assert not modules & {"http", "email", "ssl", "logging", "shutil", "dataclasses", "inspect"}, sorted(
        modules & {"http", "email", "ssl", "logging", "shutil", "dataclasses", "inspect"})

    labels, modules = imported("labels", root=root, config=daemon.config)
    assert labels.returncode == 0, labels.stderr[-2000:]
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    from_daemon = labels.stdout
    assert "nvidia.com/gpu.product=NVIDIA-A30\n" in from_daemon and "nvidia.com/gpu-agent.ready=true\n" in from_daemon

    daemon.stop()
    # Nor OpenSSL (test_openssl_is_loaded_only_for_tls), nor psutil while no process runs on a GPU, nor
    # tomlkit while no runtime's config is read.
    assert not _imported_by(daemon.output()) & {"_ssl", "psutil", "tomlkit"}
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


@pytest.mark.subprocess
def test_the_kubelet_apis_need_no_protobuf_runtime() -> None:
    """The device plugin and pod labels speak gRPC through gpu_agent.proto3: protobuf's runtime (5 MiB
    resident) stays out of the daemon."""
    code = ("import sys, asyncio, gpu_agent.plugin.service, gpu_agent.metrics.pods as pods\n"
            "from pathlib import Path\n"
            "try:\n"
            "    asyncio.run(pods.list_pod_resources(Path('/nonexistent/kubelet.sock'), 1))\n"
            "except OSError:\n"
            "    pass\n"
            "assert 'grpclib.server' in sys.modules and 'gpu_agent.kube.podresources' in sys.modules\n"
            "leaked = sorted(name for name in sys.modules if name.split('.')[0] == 'google')\n"
            "assert not leaked, leaked\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.subprocess
def test_the_kube_client_needs_no_http_client() -> None:
    """The kube client frames its requests with h11 (gpu_agent/kube/exchange.py): http.client, and the email
    and datetime packages it imports (1.3 MiB resident), stay out of the daemon."""
    code = ("import sys, gpu_agent.stages.labels, gpu_agent.kube.client, gpu_agent.daemon.app\n"
            "import gpu_agent.plugin.server, gpu_agent.metrics.pods\n"
            "assert 'gpu_agent.kube.exchange' in sys.modules\n"
            "leaked = sorted(name for name in sys.modules if name == 'http.client' or name.split('.')[0] == 'email')\n"
            "assert not leaked, leaked\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


# Every stage's section, each with a setting of its own.
EVERY_SECTION = {
    "log_level": "info", "reconcile": {"interval_seconds": 45}, "nvml": {"call_timeout_seconds": 4},
    "metrics": {"sample_interval_seconds": 6, "pod_labels": False}, "discovery": {"expected_gpus": 8},
    "driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}, "modules": {"nvidia_fs": False}},
    "toolkit": {"runtimes": "auto", "cdi": {"enabled": True}}, "kubernetes": {"enabled": False},
    "health": {"ignored_xids": [13, 31], "unready_when": "any"},
    "mig": {"strategy": "single", "stop_units": ["nvidia-dcgm.service"]},
    "plugin": {"enabled": True, "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}},
               "gpu_replicas": {"0": 1}},
}
# prometheus_client (its package brings an HTTP server, WSGI, urllib and email: metrics/text.py writes the
# format) and protobuf (gpu_agent/proto3.py). pydantic the daemon imports: it validates its config itself.
DAEMON_NEVER = ("prometheus_client", "google")


def _imported_by(output: str) -> set[str]:
    """The modules, and their top-level packages, that a process run with PYTHONPROFILEIMPORTTIME=1
    imported, from its output."""
    names = {line.rsplit("|", 1)[1].strip()
             for line in output.splitlines() if line.startswith("import time:") and "|" in line}
    return names | {name.split(".")[0] for name in names}


@pytest.mark.subprocess
def test_the_daemon_validates_its_config_itself_at_start_and_on_reload(agent, root: Path) -> None:
    """The daemon loads its config in its own process (pydantic among its imports), with every section
    the same as the CLI's loader gives, and again on SIGHUP after an edit."""
    import json
    import signal

    from gpu_agent.config.loader import load_config

    daemon = agent("dgx-h100", settings=EVERY_SECTION, env={"PYTHONPROFILEIMPORTTIME": "1"})
    daemon.wait_ready()
    _, body = daemon.get("/status")
    assert json.loads(body)["config"]["digest"] == load_config(daemon.config, required=True).digest
    code, body = daemon.get("/metrics")
    assert code == 200 and "\ngpu_agent_reconciles_total " in body and "\nDCGM_FI_DEV_GPU_TEMP{" in body

    daemon.config.write_text(daemon.config.read_text().replace("interval_seconds: 45", "interval_seconds: 50"))
    edited = load_config(daemon.config, required=True).digest
    daemon.signal(signal.SIGHUP)
    daemon.wait_http("/status", lambda _, body: json.loads(body)["config"]["digest"] == edited)
    assert daemon.stop() == 0
    imported = _imported_by(daemon.output())
    assert {"gpu_agent.daemon.app", "pydantic"} <= imported, sorted(imported)[-50:]
    assert not imported & set(DAEMON_NEVER), sorted(imported & set(DAEMON_NEVER))


OPENSSL = r"\S*(?:libcrypto|libssl|_hashlib|_ssl)\S*"  # in /proc/PID/maps: what loads with OpenSSL


@pytest.mark.subprocess
def test_openssl_is_loaded_only_for_tls() -> None:
    """The daemon's modules imported as `gpu-agent run` does (hashlib and asyncio without OpenSSL) load no
    OpenSSL; the digests are the same and coroutines run; ssl, imported afterwards (the kube client's HTTPS),
    loads it and makes contexts as ever."""
    digests = (hashlib.sha256(b"gpu").hexdigest(), hashlib.blake2b(b"gpu", digest_size=12).hexdigest(),
               hmac.new(b"k", b"m", "sha256").hexdigest())  # with OpenSSL's, in this process
    code = f"""if True:
        import re, sys
        from gpu_agent.host.openssl import import_without_openssl
        import_without_openssl()
        import asyncio, hashlib, hmac, secrets
        import gpu_agent.config.loader, gpu_agent.daemon.app, gpu_agent.daemon.http
        mapped = re.findall({OPENSSL!r}, open("/proc/self/maps").read())
        assert not mapped, mapped
        ours = (hashlib.sha256(b"gpu").hexdigest(), hashlib.blake2b(b"gpu", digest_size=12).hexdigest(),
                hmac.new(b"k", b"m", "sha256").hexdigest())
        assert ours == {digests!r}, ours
        assert secrets.token_hex(4)
        assert asyncio.run(asyncio.sleep(0, "ran")) == "ran"
        assert None not in sys.modules.values()
        import ssl
        ssl.create_default_context()
        assert re.findall({OPENSSL!r}, open("/proc/self/maps").read())
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.subprocess
@pytest.mark.parametrize("flag, hidden", [("1\n", False), ("0\n", True), (None, True)])
def test_on_a_fips_host_hashlib_and_asyncio_keep_openssl(tmp_path: Path, flag: Optional[str], hidden: bool) -> None:
    """On a FIPS host hashlib must be OpenSSL's (its FIPS provider refuses what FIPS does not approve) and
    asyncio keeps TLS: the trick is skipped there, by /proc/sys/crypto/fips_enabled under --root."""
    if flag is not None:
        (tmp_path / "proc/sys/crypto").mkdir(parents=True)
        (tmp_path / "proc/sys/crypto/fips_enabled").write_text(flag)
    code = f"""if True:
        import sys
        from gpu_agent.host.openssl import import_without_openssl
        assert import_without_openssl({str(tmp_path)!r}) is {hidden!r}
        import asyncio.sslproto, hashlib
        assert ("_hashlib" in sys.modules) is {not hidden!r}, sorted(sys.modules)
        assert (asyncio.sslproto.ssl is None) is {hidden!r}
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
