"""The process table under --root (gpu_agent.host.processes): NVML's pids named from the simulated
kernel's /proc, never from the test machine's."""
from __future__ import annotations

import os
from pathlib import Path

import psutil
from harness import KERNEL, SimNode

from gpu_agent.host import processes
from gpu_agent.host.paths import Root


def kernel_root(node: SimNode) -> Root:
    """The root as the agent resolves it when simulating: /proc is the simulated kernel's."""
    return Root(node.root).with_kernel(node.root / KERNEL)


def test_pids_are_named_from_the_process_table_under_the_root(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    node = SimNode(tmp_path / "root", "t4")
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "trainer")
    node.sim("add-process", "--gpu", "0", "--pid", "4243", "--name", "a-very-long-process-name")
    found = processes.named(kernel_root(node), [4242, 4243, os.getpid()])
    # The kernel keeps 15 characters in stat; the program's full name comes from its argv[0].
    assert [p.describe() for p in found] == ["4242 (trainer)", "4243 (a-very-long-process-name)",
                                            f"{os.getpid()} (process name unknown)"]  # this test is no process there
    assert psutil.PROCFS_PATH == "/proc"  # put back for every other reader


def test_a_process_that_ended_is_said_to_be_unknown(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    node = SimNode(tmp_path / "root", "t4")
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "trainer")
    node.sim("clear")
    assert processes.named(kernel_root(node), [4242]) == [processes.NamedProcess(4242, None)]
