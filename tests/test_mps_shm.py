"""The MPS daemons' shared memory (issue 25): a tmpfs at /run/nvidia/mps/shm, mounted by the agent and
given to each control daemon (mps.launch) and each client as /dev/shm. The mountinfo parser, the size,
the ledger's mounts section and the launcher's refusals in-process; the real mount, namespace and bind
in one slow test that needs root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host.ledger import Ledger, LedgerError, OwnedMount
from gpu_agent.host.mounts import Mount, mount_at, parse_mountinfo
from gpu_agent.host.paths import Root
from gpu_agent.mps import launch, shm
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.layout import SHM_DIR

MOUNTINFO = """\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
30 24 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,inode64
not a mountinfo line
812 27 0:93 / {root}/run/nvidia/mps/shm rw,nosuid,nodev,noexec,relatime shared:420 - tmpfs shm rw,size=65536k,mode=1777
813 812 0:94 / {root}/run/nvidia/mps/shm rw,relatime - ext4 /dev/sdb1 rw
900 27 0:95 / {root}/a\\040b\\011c rw - tmpfs my\\040shm rw
"""


def test_mountinfo_is_read_as_proc5_writes_it(tmp_path: Path) -> None:
    root = Root(tmp_path)
    with pytest.raises(AgentError, match="/proc/self/mountinfo: cannot tell whether /x is mounted: no such file"):
        mount_at(root, "/x")
    info = tmp_path / "proc/self/mountinfo"
    info.parent.mkdir(parents=True)
    info.write_text(MOUNTINFO.format(root=tmp_path))
    assert mount_at(root, SHM_DIR) == Mount(f"{tmp_path}{SHM_DIR}", "0:94", "ext4", "/dev/sdb1", "rw,relatime")
    assert mount_at(root, "/a b\tc") == Mount(f"{tmp_path}/a b\tc", "0:95", "tmpfs", "my shm", "rw")
    assert mount_at(root, "/dev/shm") is None  # the real /dev/shm is not under this root
    assert len(parse_mountinfo(MOUNTINFO)) == 5


def test_the_size_is_half_the_memory_as_nvidia_mounts_it(tmp_path: Path) -> None:
    root = Root(tmp_path)
    assert shm.size(root) == "65536k"  # no /proc/meminfo: NVIDIA's fallback
    meminfo = tmp_path / "proc/meminfo"
    meminfo.parent.mkdir(parents=True)
    meminfo.write_text("MemTotal:       16318413 kB\nMemFree:         1000000 kB\n")
    assert shm.options(root) == "nosuid,nodev,noexec,mode=1777,size=8159206k"
    meminfo.write_text("MemTotal: lots\n")
    assert shm.size(root) == "65536k"


def test_the_ledger_holds_only_the_mps_tmpfs(tmp_path: Path) -> None:
    ledger = Ledger(Root(tmp_path))
    with pytest.raises(LedgerError, match="/dev/shm: not a mount point gpu-agent makes"):
        ledger.own_mount(OwnedMount("/dev/shm", "tmpfs", "", made=False))
    ledger.own_mount(OwnedMount(SHM_DIR, "tmpfs", "mode=1777", made=True))
    ledger.own_mount(OwnedMount(SHM_DIR, "tmpfs", "mode=1777,size=1k", made=False))  # after a reboot: it was made
    assert ledger.mounts() == {SHM_DIR: OwnedMount(SHM_DIR, "tmpfs", "mode=1777,size=1k", made=True)}
    ledger.disown_mount(SHM_DIR)
    assert ledger.mounts() == {} and "mounts" not in json.loads(ledger.path.read_text())
    for bad in ({"/etc": {"fstype": "tmpfs", "options": "", "made": True}},
                {SHM_DIR: {"fstype": "ext4", "options": "", "made": True}},
                {SHM_DIR: {"fstype": "tmpfs", "options": "", "made": "yes"}}, []):
        ledger.path.write_text(json.dumps({"version": 1, "mounts": bad}))
        with pytest.raises(LedgerError, match=r"ledger.json: mounts: expected an object of mount points "
                                              r"\(/run/nvidia/mps/shm\)"):
            ledger.mounts()


def test_the_launcher_refuses_what_is_no_mounted_tmpfs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert launch.main(["relative", "/bin/true"]) == 2 and "usage:" in capsys.readouterr().err
    assert launch.main([str(tmp_path), "/usr/bin/nvidia-cuda-mps-control", "-d"]) == 1  # nothing mounted or changed
    assert capsys.readouterr().err == (f"cannot give /usr/bin/nvidia-cuda-mps-control {tmp_path} as its /dev/shm: "
                                       f"{tmp_path} is not a mounted tmpfs (nothing is mounted there)\n")


# Run in a mount namespace of its own, so that nothing mounted here reaches the host: the agent's tmpfs
# under a temporary root (the kernel's files the running ones), a control daemon started through the
# launcher (a stand-in that reports its /dev/shm and writes into it), then the tmpfs released.
SCRIPT = """\
import errno, json, os, sys
from pathlib import Path
from gpu_agent.host import mounts
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps import shm
from gpu_agent.mps.control import DaemonSpec, HostMpsControl
from gpu_agent.mps.layout import SHM_DIR

try:
    mounts.private_mount_namespace()
except OSError as exc:
    print(exc.strerror)
    sys.exit(77)
root = Root(sys.argv[1], kernel=Path("/"))
control, ledger = HostMpsControl(root, 10), Ledger(root)
shm.ensure(root, ledger, control)
shm.ensure(root, ledger, control)  # mounted already: nothing done
outside = mounts.mount_at(root, SHM_DIR)
mode = os.stat(root(SHM_DIR)).st_mode & 0o7777
control.start(DaemonSpec("nvidia.com/gpu", ("GPU-0",), (0,), (1024,), 2))
shared = sorted(os.listdir(root(SHM_DIR)))
problem = shm.release(root, ledger, control)
print(json.dumps({"outside": [outside.device, outside.fstype, outside.options, mode], "shared": shared,
                  "problem": problem, "after": [mounts.mount_at(root, SHM_DIR) is None, root(SHM_DIR).exists(),
                                                ledger.mounts() == {}]}))
"""
STAND_IN = """\
#!/bin/sh
{{ echo "$@"; stat -f -c %T /dev/shm; grep ' /dev/shm ' /proc/self/mountinfo; }} > {out}
echo shared > /dev/shm/{mark}
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.host_paths
def test_the_launcher_gives_the_daemon_the_tmpfs_as_its_dev_shm(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mount(2) and unshare(2) need root")
    if tmp_path.is_relative_to("/dev/shm"):  # `make test`'s folders: the bind mount on /dev/shm would hide the root
        outside = Path(tempfile.mkdtemp(prefix="mps-launcher-"))
        try:
            _launcher_test(outside)
        finally:
            shutil.rmtree(outside, ignore_errors=True)
    else:
        _launcher_test(tmp_path)


def _launcher_test(tmp_path: Path) -> None:
    mark = f"gpu-agent-test-{os.getpid()}"
    binary = tmp_path / "usr/bin/nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text(STAND_IN.format(out=tmp_path / "out", mark=mark))
    binary.chmod(0o755)
    (tmp_path / "run/nvidia/mps").mkdir(parents=True)  # the manager makes it, for the resources' directories
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode == 77:
        pytest.skip(f"no mount namespace here: {done.stdout.strip()}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    device, fstype, options, mode = found["outside"]
    assert fstype == "tmpfs" and {"nosuid", "nodev", "noexec"} <= set(options.split(",")) and mode == 0o1777
    args, kind, *lines = (tmp_path / "out").read_text().splitlines()
    assert args == "-d" and kind == "tmpfs"
    line = lines[-1]  # the topmost of the mounts on /dev/shm: the one the daemon's lookups find
    assert line.split()[2] == device and {"nosuid", "nodev", "noexec"} <= set(line.split()[5].split(","))
    assert found["shared"] == [mark]  # what the daemon wrote in its /dev/shm is in the agent's tmpfs ...
    assert not Path("/dev/shm", mark).exists()  # ... and not in the host's
    assert found["problem"] is None and found["after"] == [True, False, True]


@pytest.mark.subprocess
def test_the_control_binary_is_found_where_drivers_install_it(tmp_path: Path) -> None:
    """/usr/bin for packages and the .run installer; /usr/local/nvidia/bin where the real H200 node had it
    (tests/data/mps/README.md). A file that is not executable is passed over; none found is named."""
    from gpu_agent.mps.control import BINARY_DIRS, DaemonSpec, HostMpsControl, find_binary

    root = Root(tmp_path)
    spec = DaemonSpec("nvidia.com/gpu", ("GPU-0",), (0,), (81559,), 4)
    with pytest.raises(AgentError, match=r"nvidia-cuda-mps-control is not installed \(looked in /usr/bin, "):
        HostMpsControl(root, 5.0).send(spec, "get_server_list")
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-cuda-mps-control").write_text("not executable")
    assert find_binary(root) is None
    vendor = tmp_path / "usr/local/nvidia/bin/nvidia-cuda-mps-control"
    vendor.parent.mkdir(parents=True)
    vendor.write_text("#!/bin/sh\necho \"$CUDA_MPS_PIPE_DIRECTORY\"\n")
    vendor.chmod(0o755)
    assert "/usr/local/nvidia/bin" in BINARY_DIRS
    assert find_binary(root) == "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
    pipe = f"{tmp_path}/run/nvidia/mps/nvidia.com/gpu/pipe\n"
    assert HostMpsControl(root, 5.0).send(spec, "get_server_list") == pipe


@pytest.mark.subprocess
def test_under_systemd_each_daemon_is_an_instance_of_the_packaged_template(tmp_path: Path) -> None:
    """The instance is the resource as systemd-escape(1) writes it (checked against it where it is), so that
    the unit's %I is the resource again; systemctl starts it by that name and nothing else."""
    from gpu_agent.mps.control import SystemdUnits
    from gpu_agent.mps.layout import unit_name

    names = {"nvidia.com/gpu": "nvidia.com-gpu", "a-b/.c": "a\\x2db-.c", ".x": "\\x2ex",
             "gpu é": "gpu\\x20\\xc3\\xa9", "nvidia.com/gpu-shared": "nvidia.com-gpu\\x2dshared", "a:b_c": "a:b_c"}
    for resource, escaped in names.items():
        assert unit_name(resource) == f"gpu-agent-mps@{escaped}.service"
        if shutil.which("systemd-escape"):
            said = subprocess.run(["systemd-escape", "--", resource], capture_output=True, text=True, timeout=30)
            assert said.stdout.strip() == escaped
            back = subprocess.run(["systemd-escape", "-u", "--", escaped], capture_output=True, text=True, timeout=30)
            assert back.stdout.strip() == resource  # %I in the unit
    assert SystemdUnits("/usr/bin/systemctl").argv("start", unit_name("nvidia.com/gpu")) == [
        "/usr/bin/systemctl", "start", "--no-ask-password", "--quiet", "gpu-agent-mps@nvidia.com-gpu.service"]


def test_systemd_is_used_only_for_a_service_of_the_running_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """INVOCATION_ID and /run/systemd/system under a --root are a sandbox's: the daemons stay the agent's
    children there. Simulated GPUs get the simulated control unless GPU_AGENT_MPS_CONTROL=host over /."""
    from types import SimpleNamespace

    from gpu_agent.daemon.app import Runtime
    from gpu_agent.mps.control import HostMpsControl, under_systemd
    from gpu_agent.sim.mps import SimMpsControl

    (tmp_path / "run/systemd/system").mkdir(parents=True)
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/systemctl").write_text("#!/bin/sh\n")
    (tmp_path / "usr/bin/systemctl").chmod(0o755)
    assert under_systemd(Root(tmp_path), {"INVOCATION_ID": "0f"}) is None
    assert under_systemd(Root("/"), {}) is None  # not a service: decided without looking at the host
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.setenv("GPU_AGENT_MPS_CONTROL", "host")
    sandboxed = SimpleNamespace(machine=object(), real_root_simulated=False, root=Root(tmp_path))
    assert isinstance(Runtime.mps_control(sandboxed), SimMpsControl)  # type: ignore[arg-type]
    over_root = SimpleNamespace(machine=object(), real_root_simulated=True, root=Root("/", kernel=tmp_path))
    control = Runtime.mps_control(over_root)  # type: ignore[arg-type]
    assert isinstance(control, HostMpsControl) and control.root.kernel is None and control.systemd is None
    monkeypatch.setenv("GPU_AGENT_MPS_CONTROL", "simulated")
    assert isinstance(Runtime.mps_control(over_root), SimMpsControl)  # type: ignore[arg-type]


@pytest.mark.subprocess
def test_what_systemctl_says_is_the_error(tmp_path: Path) -> None:
    """A daemon's instance that cannot start, and a tmpfs that cannot be mounted, name systemctl's words and
    the unit's journal; a missing binary is named before systemd is asked (its ExecSearchPath= is
    BINARY_DIRS). SIGTERM's place is taken by `systemctl stop` of the instance: its servers go too."""
    from gpu_agent.mps.control import HostMpsControl, SystemdUnits

    fake = tmp_path / "systemctl"
    calls = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n"
                    "echo \"Job for $4 failed because the control process exited with error code.\" >&2; exit 1\n")
    fake.chmod(0o755)
    control = HostMpsControl(Root(tmp_path), 5.0, SystemdUnits(str(fake), 5.0))
    spec = DaemonSpec("gpu", ("GPU-a",), (0,), (1024,), 2)
    with pytest.raises(AgentError, match=r"^cannot start the MPS control daemon for gpu: nvidia-cuda-mps-control is "
                                         r"not installed"):
        control.start(spec)
    assert not calls.exists()
    binary = tmp_path / "usr/local/nvidia/bin/nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    with pytest.raises(AgentError) as started:
        control.start(spec)
    assert str(started.value) == (
        "cannot start the MPS control daemon for gpu: systemctl start gpu-agent-mps@gpu.service failed (exit 1): Job "
        "for gpu-agent-mps@gpu.service failed because the control process exited with error code.; see journalctl -u "
        "gpu-agent-mps@gpu.service")
    with pytest.raises(AgentError, match=r"^cannot mount a tmpfs at /run/nvidia/mps/shm for the MPS daemons' shared "
                                         r"memory: systemctl start run-nvidia-mps-shm.mount failed \(exit 1\)"):
        control.mount_shm("mode=1777")
    with pytest.raises(AgentError, match=r"^cannot unmount /run/nvidia/mps/shm: systemctl stop run-nvidia-mps-shm"):
        control.unmount_shm()
    with pytest.raises(AgentError, match=r"^cannot stop the MPS control daemon for gpu: systemctl stop "):
        control.terminate(spec)
    assert calls.read_text().splitlines() == [
        "start --no-ask-password --quiet gpu-agent-mps@gpu.service",
        "start --no-ask-password --quiet run-nvidia-mps-shm.mount",
        "stop --no-ask-password --quiet run-nvidia-mps-shm.mount",
        "stop --no-ask-password --quiet gpu-agent-mps@gpu.service"]


def test_systemd_not_our_timeout_decides_a_slow_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemctl is waited for longer than the units' own TimeoutStartSec= (tests/test_systemd.py holds those
    at START_LIMIT_S), so that a start we gave up on cannot go on in systemd unseen."""
    from gpu_agent.mps import control as control_module
    from gpu_agent.mps.control import START_LIMIT_S, HostMpsControl, SystemdUnits

    binary = tmp_path / "usr/bin/nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    waited: list[tuple[list[str], float]] = []

    def run_bytes(argv: list[str], timeout: float, **kwargs: Any) -> tuple[int, bytes, bytes]:
        waited.append((argv, timeout))
        return 0, b"", b""

    monkeypatch.setattr(control_module.proc, "run_bytes", run_bytes)
    HostMpsControl(Root(tmp_path), 5.0, SystemdUnits("/usr/bin/systemctl")).start(
        DaemonSpec("gpu", ("GPU-a",), (0,), (1024,), 2))
    (argv, timeout), = waited
    assert argv[-1] == "gpu-agent-mps@gpu.service" and timeout > START_LIMIT_S
