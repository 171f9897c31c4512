"""Talking to nvidia-cuda-mps-control: start a control daemon for one shared resource, send it one
command on its control pipe, and tell whether it still runs.

As NVIDIA documents it (docs.nvidia.com/deploy/mps, "Tools and Interface Reference"): `nvidia-cuda-mps-control
-d` starts the daemon in the background for the GPUs in CUDA_VISIBLE_DEVICES (UUIDs, enumerated in that
order), with its pipes in CUDA_MPS_PIPE_DIRECTORY and its logs in CUDA_MPS_LOG_DIRECTORY; it writes its pid
to nvidia-cuda-mps-control.pid in the pipe directory; `echo CMD | nvidia-cuda-mps-control` (same
environment) sends CMD and prints the answer.

Without systemd the daemon is started through mps.launch, in a mount namespace whose /dev/shm is the
tmpfs at /run/nvidia/mps/shm (mps.shm), which the agent mounts itself; commands are sent from the agent's
own namespace: they use only the pipe directory.

Under systemd (SystemdUnits) neither the daemon nor the tmpfs is the agent's own: each daemon is an
instance of the packaged template gpu-agent-mps@.service (mps.instance), started and stopped by name
with systemctl, and the tmpfs is the packaged run-nvidia-mps-shm.mount. PID 1 starts them in the host's
mount namespace, where the kubelet's runtime finds the tmpfs for the clients, and not in the one the
agent's sandboxed unit has (ProtectSystem=, ReadWritePaths=, PrivateTmp= give it its own, systemd.exec(5));
the template gives the daemon the tmpfs as /dev/shm itself (BindPaths=), which the agent's
RestrictNamespaces=yes would forbid it to do; and each daemon lives in its own control group, which
`systemctl restart gpu-agent` (KillMode=control-group, systemd.kill(5)) does not kill.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import mounts, proc
from gpu_agent.host.paths import Root, first_executable, resolve
from gpu_agent.host.sandbox import in_systemd_unit
from gpu_agent.mps import identity
from gpu_agent.mps.layout import CLIENT_SHM, LOG_ENV, PIPE_ENV, SHM_DIR, SHM_UNIT, log_dir, pipe_dir, unit_name
from gpu_agent.numbers import decimal

BINARY = "nvidia-cuda-mps-control"
# Where drivers install it: distribution packages and NVIDIA's .run installer in /usr/bin, a driver kept under
# its own prefix (the real H200 node this was checked on: /usr/local/nvidia/bin) beside its libraries.
BINARY_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin")
CONTROL_TIMEOUT_S = 5.0  # one call of nvidia-cuda-mps-control, start or command
START_LIMIT_S = 10.0  # TimeoutStartSec= and TimeoutStopSec= of the packaged units (tests/test_systemd.py holds them)
SYSTEMD_MARGIN_S = 5.0  # systemctl is waited for this much longer than the unit's own limit
MAX_ANSWER = 64 << 10  # what one command's answer may be; a server list of 48 pids is under 400 bytes


@dataclass(frozen=True)
class DaemonSpec:
    """One control daemon: a shared resource, its GPUs and their replica count, whose share of threads and
    memory its limits are; or the limits themselves, as a DRA claim's mpsConfig gives them."""

    resource: str
    gpus: tuple[str, ...]  # UUIDs, in CUDA_VISIBLE_DEVICES order (by index)
    indices: tuple[int, ...]  # their NVML indices, for /status
    memory_mib: tuple[int, ...]  # each GPU's memory
    replicas: int
    threads: Optional[int] = None  # the default active thread percentage asked for; None: 100 / replicas
    pinned_mib: Optional[tuple[int, ...]] = None  # each GPU's pinned memory limit asked for (0: none); None:
    # memory / replicas

    @classmethod
    def left(cls, resource: str) -> DaemonSpec:
        """A daemon known only by its resource (from the ledger's directories): enough to reach and stop it."""
        return cls(resource, (), (), (), 1)

    def runs_as(self, other: Optional[DaemonSpec]) -> bool:
        """Whether a daemon started as `other` is one started as this: its GPUs, their memory, the replicas
        and the limits asked for (the NVML indices, shown in /status only, may differ)."""
        return other is not None and (self.gpus, self.memory_mib, self.replicas, self.threads, self.pinned_mib) == (
            other.gpus, other.memory_mib, other.replicas, other.threads, other.pinned_mib)

    @property
    def thread_percentage(self) -> int:
        """As asked for; else 100 / replicas, as NVIDIA's mps-control-daemon computes it (integer division)."""
        return self.threads if self.threads is not None else 100 // self.replicas

    def pinned_limits(self) -> list[tuple[int, str]]:
        """(device ordinal among CUDA_VISIBLE_DEVICES, limit): each GPU's limit as asked for, else its memory
        / replicas, in MiB, written `<n>M` as NVIDIA's perDevicePinnedDeviceMemoryLimits does. The ordinal,
        not the NVML index: the daemon sees only its GPUs, renumbered from 0."""
        if self.pinned_mib is not None:
            return [(n, f"{limit}M") for n, limit in enumerate(self.pinned_mib) if limit]
        return [(n, f"{memory // self.replicas}M") for n, memory in enumerate(self.memory_mib) if memory]

    def env(self, root: Root) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_VISIBLE_DEVICES": ",".join(self.gpus),
                PIPE_ENV: str(root(pipe_dir(self.resource))), LOG_ENV: str(root(log_dir(self.resource)))}


class MpsControl(Protocol):
    def start(self, spec: DaemonSpec) -> None:
        """Start the control daemon in the background; an AgentError says why it did not."""

    def send(self, spec: DaemonSpec, command: str) -> str:
        """One command on its control pipe and the answer; an AgentError when it cannot be sent or the
        daemon does not answer in time."""

    def pid(self, spec: DaemonSpec) -> Optional[int]:
        """Its pid while it runs, else None."""

    def terminate(self, spec: DaemonSpec) -> None:
        """End a daemon that ignored `quit`: SIGTERM, or, under systemd, `systemctl stop` of its unit."""

    def shm_fstype(self) -> Optional[str]:
        """The type of the file system mounted at SHM_DIR, None when none is; an AgentError when it
        cannot be told."""

    def mount_shm(self, options: str) -> None:
        """A tmpfs at SHM_DIR (an existing directory) with `options`; an AgentError says why not."""

    def unmount_shm(self) -> None:
        """SHM_DIR's mount detached; an AgentError says why not."""

    def uses_shm(self, spec: DaemonSpec) -> bool:
        """Whether the running daemon's /dev/shm is the tmpfs at SHM_DIR (True when that cannot be told)."""


class ComputeModes(Protocol):
    """A GPU's compute mode by UUID, named as nvidia-smi names it (nvml.inventory.NvmlInventory)."""

    def compute_mode(self, uuid: str) -> str:
        """An AgentError names the GPU and why it cannot be read."""

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """An AgentError names the GPU and why it cannot be set."""


class HostMpsControl:
    """The real one: argv lists, a timeout on each call, answers bounded. `systemd`: the daemons and the
    tmpfs started and stopped as its units (under_systemd decides when)."""

    def __init__(self, root: Root, timeout: float, systemd: Optional[SystemdUnits] = None) -> None:
        self.root = root
        self.timeout = timeout
        self.systemd = systemd

    def start(self, spec: DaemonSpec) -> None:
        if self.systemd is None:
            self._binary(spec, "cannot start the MPS control daemon")
            self._expect_start(spec)
            self._run(spec, ["-d"], "", launcher(str(self.root(SHM_DIR))))
            self.pid(spec)  # recorded as the agent's now, if it wrote its pid file already
            return
        what = "cannot start the MPS control daemon"
        self._binary(spec, what)  # the unit's ExecSearchPath= is BINARY_DIRS: one missing is named before systemd
        self.systemd.call("start", unit_name(spec.resource), f"{what} for {spec.resource}")

    def send(self, spec: DaemonSpec, command: str) -> str:
        return self._run(spec, [], command + "\n")

    def shm_fstype(self) -> Optional[str]:
        found = mounts.mount_at(self.root, SHM_DIR)
        return None if found is None else found.fstype

    def mount_shm(self, options: str) -> None:
        what = f"cannot mount a tmpfs at {SHM_DIR} for the MPS daemons' shared memory"
        if self.systemd is not None:  # the unit's Options= are these, its size=50% the same half of MemTotal
            self.systemd.call("start", SHM_UNIT, what)
            return
        try:
            mounts.mount_tmpfs(str(self.root(SHM_DIR)), options)
        except OSError as exc:
            needs = _NEEDS_ADMIN if exc.errno == errno.EPERM else ""
            raise AgentError(f"{what}: {exc.strerror or exc}{needs}") from None

    def unmount_shm(self) -> None:
        if self.systemd is not None:  # LazyUnmount=yes, as umount2(MNT_DETACH) below
            self.systemd.call("stop", SHM_UNIT, f"cannot unmount {SHM_DIR}")
            return
        try:
            mounts.unmount(str(self.root(SHM_DIR)))
        except OSError as exc:
            raise AgentError(f"cannot unmount {SHM_DIR}: {exc.strerror or exc}") from None

    def uses_shm(self, spec: DaemonSpec) -> bool:
        pid = self.pid(spec)
        if pid is None:
            return True
        try:
            ours = mounts.mount_at(self.root, SHM_DIR)
            text = mounts.read_mountinfo(self.root, f"/proc/{pid}/mountinfo", f"the /dev/shm of pid {pid}")
        except AgentError:
            return True
        theirs = [mount for mount in mounts.parse_mountinfo(text) if mount.point == CLIENT_SHM]
        return ours is None or not theirs or theirs[-1].device == ours.device

    def pid(self, spec: DaemonSpec) -> Optional[int]:
        """The pid file's process while it is the control daemon the agent started (mps.identity): the binary,
        run as the agent's user, in the resource's unit under systemd, else the one recorded at its start."""
        found = identity.pid_file(self.root, spec.resource)
        binary = self._resolved_binary()
        if found is None or binary is None:
            return None
        process = identity.process(self.root, found)
        if process is None or not identity.runs(process, binary):
            return None
        if identity.in_unit(self.root, found, unit_name(spec.resource)):  # only systemd puts it there
            return found  # also for `gpu-agent uninstall` from a shell, outside the agent's unit
        if self.systemd is not None:
            return None
        return found if identity.started_by_agent(self.root, spec.resource, process) else None

    def terminate(self, spec: DaemonSpec) -> None:
        if self.systemd is not None:  # its whole control group, the MPS servers too
            self.systemd.call("stop", unit_name(spec.resource),
                              f"cannot stop the MPS control daemon for {spec.resource}")
            return
        pid = self.pid(spec)
        if pid is None:
            return  # none runs that the agent started: whatever the pid file names is not signalled
        try:
            held = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # it exited meanwhile
        except (AttributeError, OSError):
            held = None  # no pidfd (Linux before 5.3): the look just made stands
        try:
            if held is None:
                os.kill(pid, signal.SIGTERM)
            elif self.pid(spec) == pid:  # looked at again, the process held: a pid reused meanwhile is not it
                signal.pidfd_send_signal(held, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it exited meanwhile
        finally:
            if held is not None:
                os.close(held)

    def _expect_start(self, spec: DaemonSpec) -> None:
        """The record that a start comes (mps.identity), with the process the pid file names now (not it)."""
        found = identity.pid_file(self.root, spec.resource)
        try:
            identity.expect_start(self.root, spec.resource, identity.process(self.root, found) if found else None)
        except OSError as exc:
            raise AgentError(f"cannot start the MPS control daemon for {spec.resource}: cannot write "
                             f"{identity.started_path(spec.resource)}: {exc.strerror or exc}") from None

    def _resolved_binary(self) -> Optional[str]:
        """The control binary's path as the kernel names what a process runs (its links followed)."""
        found = find_binary(self.root)
        real = resolve(self.root, found) if found else None
        return str(self.root(real)) if real else None

    def _binary(self, spec: DaemonSpec, what: str) -> str:
        binary = find_binary(self.root)
        if binary is None:
            raise AgentError(f"{what} for {spec.resource}: {BINARY} is not installed (looked in "
                             f"{', '.join(BINARY_DIRS)}): it comes with the NVIDIA driver's utilities")
        return str(self.root(binary))

    def _run(self, spec: DaemonSpec, args: list[str], given: str, before: tuple[str, ...] = ()) -> str:
        what = " ".join([BINARY, *args]) + (f" <<< {given.strip()!r}" if given else "")
        binary = self._binary(spec, what)
        return self._call(spec, what, [*before, binary, *args], given, spec.env(self.root))

    def _call(self, spec: DaemonSpec, what: str, argv: list[str], given: str, env: dict[str, str],
              timeout: Optional[float] = None) -> str:
        timeout = timeout or self.timeout
        try:
            returncode, out, err = proc.run_bytes(argv, timeout, env=env or None, given=given.encode())
        except AgentError as exc:
            raise AgentError(f"{what} for {spec.resource}: {exc}") from None
        answer = out[:MAX_ANSWER].decode(errors="replace")
        if returncode != 0:
            said = (err[:500].decode(errors="replace") or answer[:500]).strip()
            raise AgentError(f"{what} for {spec.resource} failed (exit {returncode}){': ' + said if said else ''}")
        return answer


def pinned_mib(value: str) -> int:
    """A pinned memory limit as the control daemon takes it (`<n>M` or `<n>G`) in MiB; -1 for another."""
    unit, number = value[-1:].upper(), decimal(value[:-1]) if value[:-1].strip() == value[:-1] else None
    if unit not in ("M", "G") or number is None:
        return -1
    return number * (1024 if unit == "G" else 1)


def shown_limit(value: str) -> str:
    """How get_default_device_pinned_mem_limit shows a limit set as `value`: whole GiB from 1024 MiB on,
    rounded down (1536M is shown 1G, 20000M 19G), else MiB, as a real daemon did (H200, driver 580: the
    limit itself stays exact: its server logged 1000M as 0x3e800000 bytes)."""
    mib = pinned_mib(value)
    return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"


def find_binary(root: Root) -> Optional[str]:
    """The host path of nvidia-cuda-mps-control: the first executable file in BINARY_DIRS."""
    return first_executable(root, BINARY_DIRS, BINARY)


_NEEDS_ADMIN = " (mount(2) needs CAP_SYS_ADMIN in the host's mount namespace)"


def launcher(shm: str) -> tuple[str, ...]:
    """The argv before the binary's that runs it through mps.launch with `shm` as its /dev/shm."""
    return (*_python(), shm)


def _python() -> tuple[str, ...]:
    """mps.launch's main: this Python, isolated, with the agent's own package first on its path (the
    package keeps it outside site-packages)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys; sys.path[:0] = [{package!r}]; "
            "from gpu_agent.mps.launch import main; sys.exit(main(sys.argv[1:]))")
    return sys.executable or "python3", "-I", "-B", "-c", code


SYSTEMCTL_DIRS = ("/usr/bin", "/bin")


class SystemdUnits:
    """systemctl start and stop of the packaged units: a daemon's instance of gpu-agent-mps@.service, the
    tmpfs's run-nvidia-mps-shm.mount. systemctl waits for the job, which the unit's TimeoutStartSec= or
    TimeoutStopSec= (START_LIMIT_S) ends: waited for a little longer, systemd decides a slow start, not our
    timeout, so no start goes on unseen after ours."""

    def __init__(self, binary: str, timeout: float = START_LIMIT_S + SYSTEMD_MARGIN_S) -> None:
        self.binary = binary
        self.timeout = timeout

    def argv(self, verb: str, unit: str) -> list[str]:
        return [self.binary, verb, "--no-ask-password", "--quiet", unit]

    def call(self, verb: str, unit: str, what: str) -> None:
        """`systemctl VERB UNIT`, waited for; an AgentError names `what` failed and systemctl's words."""
        argv = self.argv(verb, unit)
        try:
            returncode, out, err = proc.run_bytes(argv, self.timeout)
        except AgentError as exc:
            raise AgentError(f"{what}: {exc}") from None
        if returncode != 0:
            said = (err[-500:] or out[-500:]).decode(errors="replace").strip()
            raise AgentError(f"{what}: systemctl {verb} {unit} failed (exit {returncode})"
                             f"{': ' + said if said else ''}; see journalctl -u {unit}")


def under_systemd(root: Root, environ: Mapping[str, str]) -> Optional[SystemdUnits]:
    """systemctl, when the agent runs as a systemd service (INVOCATION_ID, which systemd sets for each
    unit's processes, systemd.exec(5)) on a node booted with systemd (/run/systemd/system, sd_booted(3))
    and manages the running system; else None: the daemons are its children, as without systemd."""
    if not root.is_running_system or not in_systemd_unit(root, environ):
        return None
    found = first_executable(root, SYSTEMCTL_DIRS, "systemctl")
    return SystemdUnits(str(root(found))) if found else None
