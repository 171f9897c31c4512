"""The simulated kernel's /proc and /sys trees follow the machine state: a write of the state rewrites
only the files whose content changed, and still repairs a file someone else changed or removed."""
from __future__ import annotations

import os
import time
from pathlib import Path

from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import render
from gpu_agent.sim.machine import MachineState


def _machine(tmp_path: Path) -> MachineState:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    return machine


def _inodes(tree: Path) -> dict[str, int]:
    return {str(path.relative_to(tree)): path.stat().st_ino for path in tree.rglob("*") if path.is_file()}


def test_a_state_change_rewrites_only_the_files_it_changes(tmp_path: Path) -> None:
    machine = _machine(tmp_path)
    before = _inodes(machine.kernel_dir)
    with machine.edit() as state:
        state["gpus"][1]["processes"].append({"pid": 4242, "name": "trainer", "used_memory_mib": 1})
    after = _inodes(machine.kernel_dir)
    assert set(after) - set(before) == {"proc/4242/comm", "proc/4242/cmdline", "proc/4242/stat", "proc/4242/cgroup"}
    assert {name: inode for name, inode in after.items() if name in before} == before  # none rewritten
    with machine.edit() as state:
        state["gpus"][1]["processes"] = []
    assert not (machine.kernel_dir / "proc/4242").exists() and _inodes(machine.kernel_dir) == before


def test_a_file_changed_or_removed_behind_the_simulators_back_is_repaired(tmp_path: Path) -> None:
    machine = _machine(tmp_path)
    modules = machine.kernel_dir / "proc/modules"
    release = machine.kernel_dir / "proc/sys/kernel/osrelease"
    original = modules.read_text(), release.read_text()
    with open(modules, "r+") as edited:  # in place, the same size: only the mtime and ctime tell
        edited.write("x" * len(original[0]))
    release.unlink()
    stray = machine.kernel_dir / "sys/module/stray/refcnt"
    stray.parent.mkdir(parents=True)
    stray.write_text("1\n")
    with machine.edit():
        pass
    assert (modules.read_text(), release.read_text()) == original
    assert not stray.parent.exists()


def test_two_machines_and_a_second_writer_of_one_tree_stay_exact(tmp_path: Path) -> None:
    first, second = _machine(tmp_path / "a"), _machine(tmp_path / "b")
    with second.edit() as state:
        state["kernel"]["loaded"] = []
    assert (first.kernel_dir / "proc/modules").read_text() != (second.kernel_dir / "proc/modules").read_text()
    # Another process renders the first machine's tree from a state this process never wrote.
    state = first.read()
    changed = {**state, "kernel": {**state["kernel"], "release": "6.9.0-test"}}
    os.replace(first.kernel_dir, tmp_path / "elsewhere")
    render(tmp_path / "elsewhere", changed)
    os.replace(tmp_path / "elsewhere", first.kernel_dir)
    assert (first.kernel_dir / "proc/sys/kernel/osrelease").read_text() == "6.9.0-test\n"
    with first.edit():
        pass
    assert (first.kernel_dir / "proc/sys/kernel/osrelease").read_text() == f"{state['kernel']['release']}\n"


def _links(tree: Path) -> dict[str, str]:
    return {str(path.relative_to(tree)): os.readlink(path) for path in tree.rglob("*") if path.is_symlink()}


def test_a_settled_tree_skips_its_links_yet_a_link_changed_behind_its_back_is_repaired(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A render whose tree has not changed since the last one leaves its links alone (the reading it changed
    is NVML's); a link removed or pointed elsewhere changes its directory, and the next render repairs it."""
    import gpu_agent.sim.kernel as kernel

    machine = _machine(tmp_path)
    written = _links(machine.kernel_dir)
    time.sleep(0.05)  # past a timestamp tick: the tree's directories get stamps the next render can trust
    with machine.edit():
        pass
    calls: list[str] = []
    real_link = kernel._link
    monkeypatch.setattr(kernel, "_link", lambda tree, directory, relative, *rest: (
        calls.append(relative), real_link(tree, directory, relative, *rest))[1])
    with machine.edit() as state:
        state["gpus"][0]["temperature_c"] = 71
    assert calls == []
    group = next(name for name in written if name.endswith("/iommu_group"))
    member = next(name for name in written if name.startswith("sys/kernel/iommu_groups/"))
    os.unlink(machine.kernel_dir / group)
    os.unlink(machine.kernel_dir / member)
    os.symlink("../../../../../proc", machine.kernel_dir / member)
    with machine.edit():
        pass
    assert _links(machine.kernel_dir) == written and calls


def test_a_machine_made_afresh_has_the_links_and_files_of_the_first_one_made(tmp_path: Path) -> None:
    """The second new tree of a shape writes the links the first one worked out: the same links, the same
    files, wherever the machine is."""
    first, second = _machine(tmp_path / "a"), _machine(tmp_path / "deeper" / "b")

    def contents(tree: Path) -> dict[str, bytes]:
        return {str(path.relative_to(tree)): path.read_bytes() for path in tree.rglob("*")
                if path.is_file() and not path.is_symlink()}

    assert _links(second.kernel_dir) == _links(first.kernel_dir) != {}
    boot_id = "proc/sys/kernel/random/boot_id"  # each machine boots its own
    assert {**contents(second.kernel_dir), boot_id: b""} == {**contents(first.kernel_dir), boot_id: b""}
    for tree in (first.kernel_dir, second.kernel_dir):
        assert all(os.path.realpath(path).startswith(str(tree)) for path in tree.rglob("*") if path.is_symlink())
