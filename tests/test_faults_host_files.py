"""Hostile files where the agent reads the node's own: dpkg's status file, microk8s's snap.yaml, the NFD
features file, the agent's modprobe.d files. A FIFO, a directory, a device, a file past the reader's
cap (sparse: nothing is written), bytes in another encoding, a Version of 5,000 digits: every pass
completes, each stage reads what it can or fails with a message naming the file, never an internal
error. A FIFO blocked the pass for good before; a Latin-1 byte or a directory at dpkg's status made the
device-path and toolkit stages fail as "internal error: UnicodeDecodeError"."""
from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from harness import Pass, SimNode, run_cli

from gpu_agent.host.paths import Root
from gpu_agent.stages.labels import MAX_NFD_BYTES, NFD_FILE
from gpu_agent.toolkit.versions import DPKG_STATUS, MAX_SNAP_YAML_BYTES, MAX_STATUS_BYTES, SNAP_YAML, Versions

BLOCKED_S = 120  # far past any pass here: a pass still running then is blocked, not slow
STATUS = ("Package: docker.io\nStatus: install ok installed\nVersion: 5:26.1.5+dfsg1-9\n\n"
          "Package: kubelet\nStatus: install ok installed\nVersion: 1.31.4-1.1\n\n"
          "Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n")


def sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)
    return make


ODD_KINDS: dict[str, Callable[[Path], Any]] = {
    "fifo": lambda path: os.mkfifo(path),
    "directory": lambda path: path.mkdir(),
    "device": lambda path: os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3)),  # /dev/null's numbers
}
SAID = {"fifo": "it is a FIFO, not a file", "directory": "it is a directory, not a file",
        "device": "it is a character device, not a file"}


def completes(work: Callable[[], Any], fifo: Optional[Path] = None) -> Any:
    """`work()` in a thread; a pass still running after BLOCKED_S fails the test (the FIFO is then opened
    for writing, so the blocked reader returns and the thread ends)."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(_outcome(work)), daemon=True)
    thread.start()
    thread.join(BLOCKED_S)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the pass blocked on {fifo}")
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _outcome(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except BaseException as exc:  # handed to the test's thread
        return exc


def no_internal_error(done: Pass) -> None:
    bugs = [(run.stage, run.message) for run in done.runs if "internal error" in run.message or "bug" in run.message]
    assert not bugs


def docker_node(root: Path) -> Path:
    """Docker, the kubelet and the toolkit installed as Debian's packages under `root` (Docker: containerd's
    config would be checked by running the containerd installed here); returns dpkg's status file."""
    for binary in ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook",
                   "/usr/bin/nvidia-cdi-hook", "/usr/sbin/dockerd"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    (root / "etc/docker").mkdir(parents=True)
    (root / "etc/docker/daemon.json").write_text("{}\n")
    status = root / DPKG_STATUS.lstrip("/")
    status.parent.mkdir(parents=True)
    status.write_text(STATUS)
    return status


@pytest.fixture
def sim(root: Path) -> SimNode:
    """A simulated DGX H100 that is a docker_node()."""
    docker_node(root)
    return SimNode(root, "dgx-h100")


def versions_read(done: Pass) -> dict[str, str]:
    return done.stage("device-path").facts["versions"]


# --- dpkg's status file ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(ODD_KINDS))
def test_dpkg_status_that_is_not_a_file_leaves_versions_unknown_and_says_why(sim: SimNode, kind: str) -> None:
    status = sim.root / DPKG_STATUS.lstrip("/")
    status.unlink()
    ODD_KINDS[kind](status)
    done = completes(lambda: sim.apply({"toolkit": {"enabled": True}}), status if kind == "fifo" else None)
    no_internal_error(done)
    assert done.stage("device-path").state == "ok"
    assert versions_read(done)["docker"] == f"unknown (cannot read {DPKG_STATUS}: {SAID[kind]})"
    assert done.stage("toolkit").state in ("ok", "pending")


def test_check_on_a_node_whose_dpkg_status_is_a_fifo_completes_and_says_why(sim: SimNode) -> None:
    """`gpu-agent check` blocked on the FIFO as the daemon's passes did."""
    status = sim.root / DPKG_STATUS.lstrip("/")
    status.unlink()
    os.mkfifo(status)
    config = sim.root.parent / "config.yaml"
    config.write_text("version: v1\ntoolkit: {enabled: true}\n")
    done = completes(lambda: run_cli("--simulate", "dgx-h100", "check", "--json", root=sim.root, config=config),
                     status)
    assert "Traceback" not in done.stderr and "internal error" not in done.stdout
    assert json.loads(done.stdout)["device_path"]["strategy"] == "envvar"  # Docker behind the kubelet: no CDI


def test_dpkg_status_past_its_cap_is_refused_unread(sim: SimNode) -> None:
    status = sim.root / DPKG_STATUS.lstrip("/")
    sparse(MAX_STATUS_BYTES + 1)(status)  # zeros, as a 2 GB one would be: refused by its size
    done = completes(lambda: sim.apply({"toolkit": {"enabled": True}}))
    no_internal_error(done)
    assert versions_read(done)["docker"] == f"unknown (cannot read {DPKG_STATUS}: more than {MAX_STATUS_BYTES} bytes)"


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252", "utf-16-le", "shift_jis"])
def test_dpkg_status_with_other_encodings_is_read_for_what_the_agent_needs(sim: SimNode, encoding: str) -> None:
    """Third-party packages' descriptions are not always UTF-8; the fields read are ASCII."""
    foreign = "Package: vendor-tool\nStatus: install ok installed\nVersion: 2.0\nDescription: Outil réseau — ツール\n"
    data = STATUS.encode() + b"\n" + foreign.encode(encoding, errors="replace") + b"\nDescription: \xff\xfe\x80\n"
    (sim.root / DPKG_STATUS.lstrip("/")).write_bytes(data)
    done = completes(lambda: sim.apply({"toolkit": {"enabled": True}}))
    no_internal_error(done)
    assert versions_read(done)["docker"] == "26.1.5+dfsg1 (package docker.io)"
    assert done.stage("toolkit").state in ("ok", "pending")


@pytest.mark.parametrize("version", ["9" * 5000, "1." + "7" * 5000, "1.17." + "8" * 5000, "\u0661.\u0667.\u0662",
                                     "1.7.24\x00", "x" * 10_000, ""])
def test_a_version_that_is_no_version_is_named_as_such(sim: SimNode, version: str) -> None:
    """Python's int() raised ValueError past 4,300 digits: the device-path stage (containerd's version)
    and the toolkit stage (the toolkit's, checked against 1.17.8) failed as internal errors."""
    status = STATUS.replace("5:26.1.5+dfsg1-9", version).replace("1.17.8-1", version)
    (sim.root / DPKG_STATUS.lstrip("/")).write_bytes(status.encode("utf-8", errors="surrogateescape"))
    done = completes(lambda: sim.apply({"toolkit": {"enabled": True}}))
    no_internal_error(done)
    said = versions_read(done)["docker"]
    assert said.startswith("unknown (") or len(said) < 100, said
    assert done.stage("toolkit").state in ("ok", "pending")


def test_dpkg_status_is_parsed_once_per_version_of_it(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.toolkit import versions as module

    status = root / DPKG_STATUS.lstrip("/")
    status.parent.mkdir(parents=True)
    status.write_text(STATUS)
    parsed = []
    real = module.installed_packages
    monkeypatch.setattr(module, "installed_packages", lambda data, wanted: parsed.append(1) or real(data, wanted))
    versions = Versions(Root(root))
    for name in ("docker", "kubelet", "nvidia-ctk", "containerd", "docker"):
        versions.read(name)
    assert versions.read("nvidia-ctk") == ("1.17.8", "package nvidia-container-toolkit") and len(parsed) == 1
    status.write_text(STATUS.replace("1.17.8-1", "1.18.0-1"))
    assert versions.read("nvidia-ctk") == ("1.18.0", "package nvidia-container-toolkit") and len(parsed) == 2


# --- microk8s's snap.yaml --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [*sorted(ODD_KINDS), "huge", "latin-1"])
def test_snap_yaml_of_any_kind_gives_a_version_or_the_reason(root: Path, kind: str) -> None:
    host_path = SNAP_YAML["microk8s-kubelet"]
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True)
    if kind == "huge":
        sparse(MAX_SNAP_YAML_BYTES + 1)(path)
    elif kind == "latin-1":
        path.write_bytes("name: microk8s\nsummary: Kubernetes für alle\nversion: v1.32.3\n".encode("latin-1"))
    else:
        ODD_KINDS[kind](path)
    versions = Versions(Root(root))
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(versions.read("microk8s-kubelet")), daemon=True)
    thread.start()
    thread.join(BLOCKED_S)
    if thread.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"reading {host_path} blocked")
    expected = {"huge": (None, f"cannot read {host_path}: more than {MAX_SNAP_YAML_BYTES} bytes"),
                "latin-1": ("1.32.3", host_path)}
    assert found == [expected.get(kind, (None, f"cannot read {host_path}: {SAID.get(kind)}"))]


# --- the agent's own files: the NFD features file, modprobe.d -------------------------------------------

@pytest.mark.parametrize("kind", [*sorted(ODD_KINDS), "huge"])
def test_the_nfd_features_file_of_any_kind_fails_the_labels_stage_naming_it(root: Path, kind: str) -> None:
    sim = SimNode(root, "t4")
    path = root / NFD_FILE.lstrip("/")
    path.parent.mkdir(parents=True)
    (sparse(MAX_NFD_BYTES + 1) if kind == "huge" else ODD_KINDS[kind])(path)
    settings = {"kubernetes": {"enabled": False, "nfd_feature_file": True}}
    done = completes(lambda: sim.apply(settings), path if kind == "fifo" else None)
    no_internal_error(done)
    failed = [(run.stage, run.message) for run in done.runs if run.state == "failed"]
    said = f"cannot read {NFD_FILE}: " + (SAID[kind] if kind in SAID else f"more than {MAX_NFD_BYTES}")
    assert failed and all(said in message for _, message in failed), failed


@pytest.mark.parametrize("kind", sorted(ODD_KINDS))
def test_a_modprobe_file_of_any_kind_fails_the_driver_stage_naming_it(root: Path, kind: str) -> None:
    sim = SimNode(root, "t4")
    sim.check()  # the simulated machine boots: its kernel's files are made
    conf = "/etc/modprobe.d/gpu-agent-nvidia.conf"
    path = sim.kernel(conf)
    path.parent.mkdir(parents=True, exist_ok=True)
    ODD_KINDS[kind](path)
    settings = {"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}}
    done = completes(lambda: sim.check(settings), path if kind == "fifo" else None)
    no_internal_error(done)
    assert done.stage("driver").state == "failed"
    assert f"cannot read {conf}: {SAID[kind]}" in done.stage("driver").message
