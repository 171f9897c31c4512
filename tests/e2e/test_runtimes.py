"""The compatibility matrix: the agent's package on Debian 12 and 13 with the container runtimes each
release packages, booted with systemd-nspawn; containers started through each runtime get the simulated GPU.

Debian 12: containerd 1.6.20, Docker 20.10, podman 4.3. Debian 13: containerd 1.7.24, Docker 26.1,
podman 5.4. The agent runs from its package as `gpu-agent --root /node --simulate dgx-h100 apply --once`,
/node being the booted system's own / bound again: with simulated GPUs on / itself the agent leaves the
real runtimes alone by design (docs/toolkit.md), and through /node it writes the real files, while its
restarts are the simulator's; the test restarts each runtime on the result.

Stand-ins, none of them NVIDIA's: the driver's userspace is the simulator's placeholder libraries,
nvidia-smi script and GSP firmware (gpu_agent/sim/userspace.py); the toolkit's binaries are scripts
(nvidia-container-runtime passes everything to runc; nvidia-cdi-hook logs its arguments); the device
nodes are the simulated kernel's, copied to /dev as the driver would make them. The image is busybox-static
imported from a tarball: no registry is reached.

The booted system runs under this machine's limits, which are no node's: its cgroup v2 tree has no
controllers (this machine binds them to cgroup v1), so podman sets no pids limit and containerd's CRI
makes no cgroups; and it cannot lower OOM scores (no CAP_SYS_RESOURCE), so the CRI keeps its pods' at
its own. Both are written before the agent runs, as an admin's settings it must keep.
"""
from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Container, run, runtimes_root
from cri import run_pod

PACKAGE = {"bookworm": "deb", "trixie": "deb13"}
VERSIONS = {  # what each release's packages are, checked against the runtimes' own answers
    "bookworm": {"containerd": "1.6.20", "docker": "20.10.24", "podman": "4.3.1"},
    "trixie": {"containerd": "1.7.24", "docker": "26.1.5", "podman": "5.4.2"},
}
DRIVER = "550.90.07"  # dgx-h100's
LIBCUDA = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{DRIVER}"
IMAGE = "local/busybox:1"
HOOK_LOG = "/run/nvidia-cdi-hook.log"
# What a container prints about the GPU it got: the character devices, the driver's library and binary.
PROBE = ["/bin/sh", "-c", "for n in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia1; do "
         "[ -c $n ] && echo char $n; done; cat " + LIBCUDA + " 2>&1; nvidia-smi 2>&1; true"]
STAND_INS = {
    "/usr/bin/nvidia-container-runtime": '#!/bin/sh\nexec runc "$@"\n',
    "/usr/bin/nvidia-container-runtime-hook": "#!/bin/sh\nexit 0\n",
    "/usr/bin/nvidia-cdi-hook": f'#!/bin/sh\necho "$*" >> {HOOK_LOG}\n',
    "/usr/bin/nvidia-ctk": "#!/bin/sh\necho 'NVIDIA Container Toolkit CLI version 1.17.8 (stand-in)'\n",
}
CRI_LIMITS = "    restrict_oom_score_adj = true\n    disable_cgroup = true\n"


@dataclass
class Node:
    suite: str
    container: Container

    @property
    def cdi_in_docker(self) -> bool:
        return self.suite != "bookworm"  # Docker applies CDI from 25 on

    @property
    def cdi_in_containerd(self) -> bool:
        return self.suite != "bookworm"  # containerd from 1.7 on


def _busybox_image(directory: Path) -> bytes:
    """A root file system of busybox-static and a few of its applets, as a tarball."""
    busybox = (directory / "usr/bin/busybox") if (directory / "usr/bin/busybox").exists() else directory / "bin/busybox"
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(busybox, "bin/busybox")
        for applet in ("sh", "ls", "cat", "sleep"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    return out.getvalue()


def _prepare(directory: Path) -> None:
    for path, text in STAND_INS.items():
        (directory / path.lstrip("/")).write_text(text)
        (directory / path.lstrip("/")).chmod(0o755)
    (directory / "root/image.tar").write_bytes(_busybox_image(directory))
    (directory / "etc/containers/containers.conf").write_text("[containers]\npids_limit = 0\n")
    config = directory / "etc/containerd/config.toml"
    table = '  [plugins."io.containerd.grpc.v1.cri"]\n'
    assert table in config.read_text(), config.read_text()
    config.write_text(config.read_text().replace(table, table + CRI_LIMITS))


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def node(request: pytest.FixtureRequest, packages: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    suite = request.param
    work = tmp_path_factory.mktemp(f"runtimes-{suite}")
    directory = work / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(runtimes_root(suite)), str(directory)], timeout=900)
    shutil.copy(packages[PACKAGE[suite]], directory / "root/gpu-agent.deb")
    _prepare(directory)
    booted = Container(directory, work / "console.log", nested=True)
    try:
        yield Node(suite, booted)
    finally:
        booted.stop()
        shutil.rmtree(directory, ignore_errors=True)


def agent(node: Node, *argv: str, check: bool = True) -> str:
    done = node.container.exec("gpu-agent", "--root", "/node", "--simulate", "dgx-h100", *argv, check=check,
                               timeout=300)
    return done.stdout + done.stderr


def device_path(node: Node) -> dict[str, Any]:
    """The `device_path` key of `gpu-agent check --json`: which way the agent hands a pod its GPU here,
    and why."""
    report: dict[str, Any] = json.loads(node.container.exec(
        "gpu-agent", "--root", "/node", "--simulate", "dgx-h100", "check", "--json", timeout=300).stdout)
    stages = {stage["stage"]: stage for stage in report["stages"]}
    assert stages["toolkit"]["state"] == "ok", stages["toolkit"]
    found: dict[str, Any] = report["device_path"]
    return found


def test_the_agent_configures_every_runtime_present(node: Node) -> None:
    c = node.container
    c.exec("dpkg", "-i", "/root/gpu-agent.deb")
    c.sh("mkdir -p /node && mount --rbind / /node && mount --make-rslave /node")
    out = agent(node, "apply", "--once")
    print(out)
    assert re.search(r"^\[\+\] toolkit: ok: nvidia runtime configured for containerd(, | and )docker", out, re.M)
    # No CDI switch where the runtime's version ignores it, and the toolkit says so
    containerd = re.search(r"containerd: containerd 1\.6\.20\S* does not apply CDI \(from 1\.7\): no enable_cdi", out)
    docker = re.search(r"docker: Docker 20\.10\.24\S* does not apply CDI \(from 25\.0\): no features\.cdi", out)
    assert (bool(containerd), bool(docker)) == (not node.cdi_in_containerd, not node.cdi_in_docker), out
    # podman reads the spec on both (/var/run links to /run: the message names where the spec is)
    assert re.search(r"^\[\+\] cdi: ok: CDI spec (/var)?/run/cdi/nvidia\.yaml is up to date", out, re.M), out
    for path in ("/etc/containerd/conf.d/99-nvidia.toml", "/etc/docker/daemon.json", "/var/run/cdi/nvidia.yaml"):
        assert c.exec("test", "-s", path, check=False).returncode == 0, path
    # The kernel driver's nodes: the simulated kernel's, made in the node's /dev.
    c.sh("cp -a /var/lib/gpu-agent/sim/kernel/dev/nvidia* /dev/")
    # The admin's CRI settings stay (the agent's drop-in carries the CRI table as the root file has it).
    assert re.search(r"restrict_oom_score_adj = true", c.exec("containerd", "config", "dump").stdout)
    again = agent(node, "apply", "--once")
    assert "did:" not in again, again


def test_each_runtime_starts_on_the_result(node: Node) -> None:
    c = node.container
    c.exec("systemctl", "restart", "containerd", "docker", timeout=180)
    for unit in ("containerd", "docker"):  # podman has no daemon: `podman info` below runs it
        assert c.exec("systemctl", "is-active", unit, check=False).stdout.strip() == "active", unit
    versions = VERSIONS[node.suite]
    assert f"Version:  {versions['containerd']}" in c.exec("ctr", "version").stdout
    docker = json.loads(c.exec("docker", "info", "--format", "{{json .}}").stdout)
    assert docker["ServerVersion"].startswith(versions["docker"]) and "nvidia" in docker["Runtimes"], docker
    podman = json.loads(c.exec("podman", "info", "--format", "json").stdout)
    assert podman["version"]["Version"] == versions["podman"]
    dump = c.exec("containerd", "config", "dump").stdout
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump
    assert ("enable_cdi = true" in dump) == node.cdi_in_containerd  # 1.6 knows no such key: dump drops it
    pause = re.search(r'sandbox_image = "([^"]+)"', dump)  # the CRI's pod sandbox image: imported, never pulled
    assert pause, dump
    c.sh(f"docker import /root/image.tar {IMAGE} && docker import --change 'ENTRYPOINT [\"/bin/sleep\", \"1000000\"]' "
         f"/root/image.tar {pause[1]} && docker save {IMAGE} {pause[1]} | ctr -n k8s.io images import - && "
         f"podman import /root/image.tar {IMAGE}", timeout=300)


def _sees_gpu_0(output: str) -> None:
    for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert f"char {node}" in output, output
    assert "char /dev/nvidia1" not in output, output  # GPU 0 only
    assert f"placeholder libcuda {DRIVER}" in output, output
    assert f"nvidia-smi {DRIVER} (simulated placeholder)" in output, output


def test_podman_runs_a_container_with_the_gpu_by_its_cdi_name(node: Node) -> None:
    c = node.container
    c.exec("rm", "-f", HOOK_LOG)
    done = c.exec("podman", "run", "--rm", "--network", "none", "--device", "nvidia.com/gpu=0", IMAGE, *PROBE,
                  timeout=180)
    _sees_gpu_0(done.stdout)
    assert "update-ldcache" in c.exec("cat", HOOK_LOG).stdout  # the spec's createContainer hooks ran


def test_docker_runs_a_container_with_the_gpu_where_it_applies_cdi(node: Node) -> None:
    c = node.container
    argv = ["docker", "run", "--rm", "--network", "none", "--device", "nvidia.com/gpu=0", IMAGE, *PROBE]
    if node.cdi_in_docker:
        _sees_gpu_0(c.exec(*argv, timeout=180).stdout)
    else:
        # Docker 20.10 takes --device for a path; the agent's nvidia runtime is what it offers instead.
        refused = c.exec(*argv, check=False, timeout=180)
        assert refused.returncode != 0 and "nvidia.com/gpu=0" in refused.stderr, refused
        ran = c.exec("docker", "run", "--rm", "--network", "none", "--runtime", "nvidia", IMAGE, "ls", timeout=180)
        assert ran.returncode == 0


def test_containerd_gives_a_pod_its_gpu_through_the_cri_where_it_applies_cdi(node: Node) -> None:
    c = node.container
    socket = f"/proc/{c.init_pid}/root/run/containerd/containerd.sock"
    runtime, status = run_pod(socket, f"docker.io/{IMAGE}", PROBE, "/var/log/pods/e2e", ["nvidia.com/gpu=0"])
    assert runtime.startswith(f"containerd {VERSIONS[node.suite]['containerd']}"), runtime
    assert (status.state, status.exit_code) == (2, 0), status
    log = c.exec("cat", "/var/log/pods/e2e/gpu.log").stdout
    output = "\n".join(line.split(" ", 3)[-1] for line in log.splitlines())  # CRI log lines: time stream tag text
    if node.cdi_in_containerd:
        _sees_gpu_0(output)
    else:
        # containerd 1.6 drops CDI devices without a word: the pod runs and has no GPU (issue 24).
        assert "char /dev/nvidia0" not in output, output


# What the agent chooses on each release: strategy cdi-cri or cdi-annotations is "cdi", envvar
# (NVIDIA_VISIBLE_DEVICES through the nvidia runtime) "nvidia-runtime"; and how its reason starts.
CHOICE = {"bookworm": ("nvidia-runtime", r"containerd 1\.6\.20\S* does not apply CDI \(from 1\.7\)"),
          "trixie": ("cdi", r"containerd 1\.7\.24\S* applies CDI")}


def test_the_agent_chooses_the_device_path_the_runtimes_apply(node: Node) -> None:
    found = device_path(node)
    path = "nvidia-runtime" if found["strategy"] == "envvar" else "cdi"
    assert (path, found["chosen_by"]) == (CHOICE[node.suite][0], "auto"), found
    assert re.match(CHOICE[node.suite][1], found["reason"]), found
    assert found["kubelet_runtime"] == "containerd" and found["cdi_consumers"] == ["podman"], found
    assert found["cdi_spec_needed"] is True  # podman 4.3 and 5.4 apply the spec themselves
