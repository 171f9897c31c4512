"""The ledger never loses a write: every read-modify-write holds one lock, between the threads of a
process (the engine's stages, the MPS control daemons' thread) and between processes (the daemon and
a command), and a holder that keeps it too long is named in an error, never waited for forever."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpu_agent.host.ledger import LOCK_PATH, PATH, Ledger, LedgerError, OwnedLink
from gpu_agent.host.paths import Root

WRITES = 200


def in_threads(*works: Callable[[], None]) -> list[BaseException]:
    """Run each in a thread of its own, all at once; what they raised."""
    failures: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # the test reports it
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(work,)) for work in works]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_two_threads_each_writing_their_own_section_keep_every_write(tmp_path: Path) -> None:
    """As the MPS control daemons' thread records compute modes while a pass records links: each thread
    with its own Ledger of the same root, as they have in the daemon."""
    root = Root(tmp_path)
    start = threading.Barrier(2)

    def modes() -> None:
        ledger = Ledger(root)
        start.wait()
        for n in range(WRITES):
            ledger.save_compute_mode(f"GPU-{n}", "DEFAULT", "nvidia.com/gpu")

    def links() -> None:
        ledger = Ledger(root)
        start.wait()
        for n in range(WRITES):
            ledger.own_link(OwnedLink(f"/dev/char/195:{n}", "driver", f"../nvidia{n}"))

    assert in_threads(modes, links) == []
    ledger = Ledger(root)
    assert (len(ledger.compute_modes()), len(ledger.links())) == (WRITES, WRITES)


WRITER = """
import sys
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
root, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
ledger = Ledger(Root(root))
print("ready", flush=True)
sys.stdin.readline()
for n in range(count):
    ledger.add_pending_restart(f"{name}-{n}.service")
"""


@pytest.mark.subprocess
def test_two_processes_writing_at_once_keep_every_write(tmp_path: Path) -> None:
    """As `gpu-agent uninstall` or `mig apply` next to the daemon: two processes, started together."""
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name, str(WRITES)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
               for name in ("daemon", "cli")]
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        for writer in writers:  # both go at once: neither has its first write done before the other starts
            assert writer.stdin is not None
            writer.stdin.write("go\n")
            writer.stdin.flush()
        for writer in writers:
            assert writer.wait(timeout=120) == 0
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    owed = Ledger(Root(tmp_path)).pending_restarts()
    assert owed == {f"{name}-{n}.service" for name in ("daemon", "cli") for n in range(WRITES)}


HOLDER = """
import fcntl, os, sys
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the ledger's lock until its stdin is closed."""
    lock = tmp_path / LOCK_PATH.lstrip("/")
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], text=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == "held\n"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.subprocess
def test_a_process_holding_the_lock_too_long_is_named_and_nothing_is_written(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    ledger = Ledger(Root(tmp_path), lock_timeout_s=0.05)
    with pytest.raises(LedgerError) as raised:
        ledger.add_pending_restart("containerd.service")
    message = str(raised.value)
    assert message.startswith(f"{LOCK_PATH}: process {holder.pid} has held the ledger's lock for more than 0.05 s")
    assert "nothing was changed" in message
    assert not (tmp_path / PATH.lstrip("/")).exists()
    # readers never wait, nor does a change that finds nothing to do
    assert ledger.pending_restarts() == set()
    ledger.clear_pending_restart("containerd.service")
    assert holder.stdin is not None
    holder.stdin.close()  # the holder exits: its lock goes with it
    holder.wait(timeout=30)
    ledger.add_pending_restart("containerd.service")
    assert ledger.pending_restarts() == {"containerd.service"}


@pytest.mark.subprocess
def test_a_holder_killed_with_minus_9_leaves_no_lock(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    ledger = Ledger(Root(tmp_path), lock_timeout_s=0)
    ledger.add_pending_restart("containerd.service")
    assert ledger.pending_restarts() == {"containerd.service"}
    assert (tmp_path / LOCK_PATH.lstrip("/")).read_text() == f"{os.getpid()}\n"  # the last holder, for the error


def test_a_thread_holding_the_lock_too_long_is_named(tmp_path: Path) -> None:
    root = Root(tmp_path)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with Ledger(root).locked():
            held.set()
            done.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        held.wait()
        with pytest.raises(LedgerError, match=f"^{LOCK_PATH}: another thread of this process has held"):
            Ledger(root, lock_timeout_s=0.05).own_link(OwnedLink("/dev/char/195:0", "driver", "../nvidia0"))
    finally:
        done.set()
        thread.join()
    assert Ledger(root).links() == {}


def test_the_lock_is_reentrant_for_its_holder(tmp_path: Path) -> None:
    """A read and the writes decided from it, under one hold (as host.owned.write saves an original)."""
    ledger = Ledger(Root(tmp_path), lock_timeout_s=0)
    with ledger.locked():
        if "containerd.service" not in ledger.pending_restarts():
            ledger.add_pending_restart("containerd.service")
        with ledger.locked():
            ledger.save_compute_mode("GPU-0", "DEFAULT", "nvidia.com/gpu")
    assert ledger.pending_restarts() == {"containerd.service"}

    def another_thread() -> None:
        with Ledger(Root(tmp_path), lock_timeout_s=0).locked():
            pass

    assert in_threads(another_thread) == []  # released as often as taken: another thread has it at once


def test_a_link_at_the_lock_files_name_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    lock = tmp_path / LOCK_PATH.lstrip("/")
    lock.parent.mkdir(parents=True)
    lock.symlink_to("../../../etc/passwd")  # the root's own passwd: never opened through the link
    with pytest.raises(LedgerError, match=f"^{LOCK_PATH}: cannot lock the ledger \\(a symbolic link, not the lock "
                                          "file gpu-agent makes: remove it\\); nothing was changed$"):
        Ledger(Root(tmp_path)).add_pending_restart("containerd.service")
    assert (tmp_path / "etc/passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    assert not (tmp_path / PATH.lstrip("/")).exists()


def test_a_compute_mode_recorded_first_stays_and_is_what_to_put_back(tmp_path: Path) -> None:
    """The MPS daemon's start reads and records in one step: a mode recorded before (by an earlier start
    that set EXCLUSIVE_PROCESS) is never replaced by the EXCLUSIVE_PROCESS it finds now."""
    ledger = Ledger(Root(tmp_path))
    assert ledger.save_compute_mode("GPU-0", "DEFAULT", "nvidia.com/gpu") == "DEFAULT"
    assert ledger.save_compute_mode("GPU-0", "EXCLUSIVE_PROCESS", "nvidia.com/gpu.shared") == "DEFAULT"
    assert ledger.compute_modes() == {"GPU-0": ("DEFAULT", "nvidia.com/gpu.shared")}
    assert json.loads((tmp_path / PATH.lstrip("/")).read_text())["compute_modes"] == {
        "GPU-0": {"mode": "DEFAULT", "resource": "nvidia.com/gpu.shared"}}
