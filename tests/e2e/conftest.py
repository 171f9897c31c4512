"""End-to-end fixtures: the packages built from this tree, and a Debian 12 booted with systemd-nspawn."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

TOP = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPU_AGENT_E2E_CACHE", "/var/cache/gpu-agent-e2e"))
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "curl", "kmod")
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "lintian", "rpmlint", "rpm", "dpkg-deb")


def run(argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        # A failure, not a skip: these tests are the proof that the packages work.
        pytest.fail(f"the e2e tests need root and {', '.join(TOOLS)}; missing: {', '.join(missing) or 'root'} "
                    "(.ci/run installs them)")
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, str(TOP / "packaging/build.py"), "--out", str(out)], timeout=1800)
    # One package per target python3: Debian 12 (3.11), Debian 13 (3.13), RHEL 9 (3.9).
    return {"deb": next(out.glob("*+deb12_amd64.deb")), "deb13": next(out.glob("*+deb13_amd64.deb")),
            "rpm": next(out.glob("*.el9.x86_64.rpm"))}


def _mirror() -> str:
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


def debian_root() -> Path:
    """A minimal Debian 12 with systemd, debootstrapped once and kept outside the repository."""
    key = hashlib.sha256(" ".join(PACKAGES).encode()).hexdigest()[:12]
    cached = CACHE / f"bookworm-minbase-{key}"
    if not cached.exists():
        partial = CACHE / f"{cached.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm", str(partial),
             _mirror()], timeout=1800)
        partial.rename(cached)
    return cached


class Container:
    """A booted container; commands run inside through nsenter on its init's pid."""

    def __init__(self, directory: Path, log: Path) -> None:
        self.directory = directory
        self.log = log
        self.nspawn = subprocess.Popen(
            ["systemd-nspawn", "-D", str(directory), "--boot", "--register=no", "--keep-unit", "--private-network",
             "--console=passive", f"--machine=gpu-agent-e2e-{os.getpid()}"],
            stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        self.init_pid = self._wait_for_init()
        state = self.sh("systemctl is-system-running --wait", check=False, timeout=120).stdout.strip()
        if state not in ("running", "degraded"):
            raise AssertionError(f"container did not boot ({state}):\n{log.read_text()[-3000:]}")

    def _wait_for_init(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.nspawn.returncode}:\n{self.log.read_text()}")
            children = run(["pgrep", "-P", str(self.nspawn.pid)], check=False).stdout.split()
            if children and run(["nsenter", "-t", children[0], "-a", "true"], check=False).returncode == 0:
                return int(children[0])
            time.sleep(0.2)
        raise AssertionError("the container's init never appeared")

    def exec(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(["nsenter", "-t", str(self.init_pid), "-a", *argv], check=check, timeout=timeout)

    def sh(self, script: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.exec("/bin/sh", "-c", script, check=check, timeout=timeout)

    def stop(self) -> None:
        if self.nspawn.poll() is None:
            self.nspawn.terminate()  # nspawn asks the container's systemd to power off
            try:
                self.nspawn.wait(60)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait(10)


@pytest.fixture(scope="module")
def container(packages: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    work = tmp_path_factory.mktemp("nspawn")
    directory = work / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(debian_root()), str(directory)], timeout=600)
    shutil.copy(packages["deb"], directory / "root/gpu-agent.deb")
    booted = Container(directory, work / "console.log")
    try:
        yield booted
    finally:
        booted.stop()
        shutil.rmtree(directory, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every e2e test boots, installs and inspects real systems: real processes and host paths."""
    for item in items:
        item.add_marker(pytest.mark.subprocess)
        item.add_marker(pytest.mark.host_paths)
