"""End-to-end fixtures: the packages built from this tree, and Debian 12 and 13 booted with systemd-nspawn."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

TOP = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPU_AGENT_E2E_CACHE", "/var/cache/gpu-agent-e2e"))
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "curl", "kmod")
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "lintian", "rpmlint", "rpm", "dpkg-deb")
# The container runtimes each release packages (Debian 13 splits Docker's client out of docker.io), and
# busybox-static for the tests' container image.
RUNTIMES = {
    "bookworm": ("containerd", "docker.io", "podman", "busybox-static"),
    "trixie": ("containerd", "docker.io", "docker-cli", "podman", "busybox-static"),
}


def run(argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        reason = (f"the e2e tests need root and {', '.join(TOOLS)}; missing: {', '.join(missing) or 'root'} "
                  "(.ci/run installs them)")
        if os.environ.get("CI"):
            pytest.fail(reason)  # in CI a failure, not a skip: these tests are the proof that the packages work
        pytest.skip(reason)
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


def _cached(name: str, make: Callable[[Path], None]) -> Path:
    """CACHE/name, made by `make` into a scratch directory the first time (a crash leaves no half tree)."""
    cached = CACHE / name
    if not cached.exists():
        partial = CACHE / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        make(partial)
        partial.rename(cached)
    return cached


def _key(words: tuple[str, ...]) -> str:
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:12]


def debian_root(suite: str = "bookworm") -> Path:
    """A minimal Debian (12: bookworm, 13: trixie) with systemd, debootstrapped once and kept outside the
    repository."""
    return _cached(f"{suite}-minbase-{_key(PACKAGES)}", lambda partial: run(
        ["nice", "debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(partial),
         _mirror()], timeout=1800))


def runtimes_root(suite: str) -> Path:
    """debian_root(suite) with the release's own containerd, Docker and podman installed, made once."""
    def install(partial: Path) -> None:
        run(["cp", "-a", "--reflink=auto", str(debian_root(suite)), str(partial)], timeout=600)
        script = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
                  f"{' '.join(RUNTIMES[suite])} && apt-get clean && rm -rf /var/lib/apt/lists/*")
        # Not booted: the packages' services stay stopped until the tests boot a copy.
        run(["nice", "systemd-nspawn", "-q", "--register=no", "--keep-unit", "-D", str(partial), "--pipe",
             "sh", "-c", script], timeout=1800)
    return _cached(f"{suite}-runtimes-{_key(PACKAGES + RUNTIMES[suite])}", install)


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Container:
    """A booted container; commands run inside through nsenter on its init's pid."""

    def __init__(self, directory: Path, log: Path, nested: bool = False) -> None:
        """`nested`: for container runtimes inside: the unified cgroup hierarchy (Debian 13's systemd
        boots on nothing else, and runc wants it delegated), with the keyring calls runc makes, the
        bpf() its cgroup v2 device filter needs, and every capability this machine can give."""
        self.directory = directory
        self.log = log
        argv = ["systemd-nspawn", "-D", str(directory), "--boot", "--register=no", "--keep-unit", "--private-network",
                "--console=passive", f"--machine=gpu-agent-e2e-{os.getpid()}-{directory.parent.name}"]
        env = dict(os.environ)
        if nested:
            argv += ["--system-call-filter=add_key keyctl bpf", "--capability=all"]
            env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
        self.nspawn = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                       env=env)
        try:
            self.init_pid = self._wait_for_init()
            deadline = time.monotonic() + 120
            while True:  # systemd answers nothing, or "offline", until its bus is up
                state = self.sh("systemctl is-system-running --wait", check=False, timeout=120).stdout.strip()
                if state not in ("", "offline") or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if state not in ("running", "degraded"):
                raise AssertionError(f"container did not boot ({state}):\n{log.read_text()[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def _wait_for_init(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.nspawn.returncode}:\n{self.log.read_text()}")
            children = run(["pgrep", "-P", str(self.nspawn.pid)], check=False).stdout.split()
            # Its child, once it is the container's systemd (nspawn's own helper comes first).
            if children and _comm(children[0]) == "systemd" and run(
                    ["nsenter", "-t", children[0], "-a", "true"], check=False).returncode == 0:
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
