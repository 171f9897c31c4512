"""MPS control daemons across agent restarts, NVML outages and config changes (issue 33), on a simulated
DGX H100: an agent that starts without an inventory leaves the daemons alone; an adopted daemon's settings
are read back and it is started again when they differ; a config change restarts a daemon in place, its
pipe directory (which running pods have bind-mounted) kept; a directory that cannot be made is one clear
error, logged once, and the resource's replicas are not advertised healthy meanwhile."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpu_agent.config.loader import LoadedConfig, parse_config
from gpu_agent.host.ledger import Ledger
from gpu_agent.mps.daemons import MpsManager, Timing
from gpu_agent.mps.layout import SHM_DIR, pipe_dir
from gpu_agent.plugin.devices import GPU_RESOURCE, advertised
from gpu_agent.sim.mps import SimMpsControl
from gpu_agent.state import AgentState
from tests.test_mps import FAST, SimDgx

EXCLUSIVE, DEFAULT = 3, 0  # NVML's compute modes as the simulator keeps them
MEMORY = 81559  # MiB, each simulated H100's
AT_ONCE = Timing(poll_s=0.05, probe_s=0.0, backoff_s=(0.0, 0.0))  # every sync may try again: no waiting in tests


def config(replicas: int, devices: str = "") -> str:
    """sharing.mps for nvidia.com/gpu; `devices` (a YAML list) with per_resource_sharing, which honours it,
    shared as nvidia.com/gpu-shared (the GPUs not listed stay nvidia.com/gpu, unshared)."""
    extended = "  per_resource_sharing: true\n" if devices else ""
    chosen = f"        devices: {devices}\n        rename: gpu-shared\n" if devices else ""
    return (f"version: v1\nplugin:\n  enabled: true\n{extended}  sharing:\n    mps:\n      resources:\n"
            f"      - name: nvidia.com/gpu\n        replicas: {replicas}\n{chosen}")


def agent(dgx: SimDgx, text: str, inventory: bool = True, timing: Timing = FAST) -> tuple[AgentState, MpsManager]:
    """A new agent process: its state (with the node's inventory, or none: NVML failing as it starts) and
    its MPS manager."""
    state = AgentState(LoadedConfig(parse_config(text, "c"), "c", "d"), inventory=dgx.inventory if inventory else None)
    return state, MpsManager(dgx.root, state, SimMpsControl(dgx.machine, 0.2), dgx.nvml.inventory, lambda: None, timing)


def sync(manager: MpsManager, times: int = 1) -> None:
    for _ in range(times):
        asyncio.run(manager.sync())


def daemon(dgx: SimDgx, resource: str = GPU_RESOURCE) -> dict[str, Any]:
    return dgx.machine.read()["mps"][resource]


def shown(state: AgentState, resource: str = GPU_RESOURCE) -> dict[str, Any]:
    assert state.mps is not None
    return next(entry for entry in state.mps["daemons"] if entry["resource"] == resource)


def mark_a_pods_mount(dgx: SimDgx, resource: str = GPU_RESOURCE) -> tuple[Path, int]:
    """A file in the pipe directory, standing for what a running pod sees through its bind mount of it, and
    the directory's inode: both gone if the directory is removed and made again."""
    pipe = dgx.root(pipe_dir(resource))
    (pipe / "pod-sees-this").write_text("mounted\n")
    return pipe, pipe.stat().st_ino


@pytest.fixture
def dgx(tmp_path: Path) -> Iterator[SimDgx]:
    node = SimDgx.make(tmp_path)
    yield node
    node.nvml.close()


# --- a restart without an inventory ------------------------------------------------------------------------

# One case of each family in make test, the others in make test-slow (each starts and restarts an agent).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=SLOW), pytest.param(48, marks=SLOW)])
def test_an_agent_started_while_nvml_fails_leaves_the_daemon_running(dgx: SimDgx, replicas: int) -> None:
    sync(agent(dgx, config(replicas))[1])
    pid, modes = daemon(dgx)["pid"], dgx.compute_modes()
    pipe, inode = mark_a_pods_mount(dgx)
    directories = Ledger(dgx.root).mps_directories()

    state, manager = agent(dgx, config(replicas), inventory=False)  # NVML fails as the new agent starts
    sync(manager, 3)
    assert daemon(dgx)["alive"] and daemon(dgx)["pid"] == pid, "the daemon was stopped without an inventory"
    assert SHM_DIR in dgx.machine.read()["mounts"] and Ledger(dgx.root).mounts()
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode
    assert Ledger(dgx.root).mps_directories() == directories and dgx.compute_modes() == modes == [EXCLUSIVE] * 8
    entry = shown(state)
    assert entry["state"] == "unknown" and entry["pid"] == pid and not entry["up"]
    assert entry["replicas"] == replicas  # what runs, from what it was started with
    assert GPU_RESOURCE in state.mps_down  # nothing advertised without an inventory; named down meanwhile

    state.inventory = dgx.inventory  # NVML answers again: the daemon is adopted, its settings read back, kept
    sync(manager)
    entry = shown(state)
    assert entry["state"] == "running" and entry["up"] and entry["pid"] == pid == daemon(dgx)["pid"]
    assert entry["restarts"] == 0 and not state.mps_down
    assert entry["active_thread_percentage"] == 100 // replicas == daemon(dgx)["thread_percentage"]


def test_without_an_inventory_only_the_daemons_the_config_no_longer_asks_for_stop(dgx: SimDgx) -> None:
    """Two daemons run: nvidia.com/gpu, which the config asks for, and nvidia.com/old, left by an earlier config.
    Without an inventory the first is kept, the second stopped, its directories removed, the tmpfs kept."""
    sync(agent(dgx, config(4))[1])
    left = agent(dgx, config(4).replace("nvidia.com/gpu", "nvidia.com/old"))[1]
    left.ledger.own_mps_directory("/run/nvidia/mps/nvidia.com/old", "nvidia.com/old")
    dgx.root("/run/nvidia/mps/nvidia.com/old").mkdir()
    from gpu_agent.mps.control import DaemonSpec
    left.control.start(DaemonSpec("nvidia.com/old", (dgx.inventory.gpus[0].uuid,), (0,), (MEMORY,), 2))
    pid = daemon(dgx)["pid"]

    state, manager = agent(dgx, config(4), inventory=False)
    sync(manager, 2)
    assert daemon(dgx)["alive"] and daemon(dgx)["pid"] == pid
    assert not daemon(dgx, "nvidia.com/old")["alive"]
    assert not dgx.root("/run/nvidia/mps/nvidia.com/old").exists() and dgx.root(pipe_dir(GPU_RESOURCE)).is_dir()
    assert set(Ledger(dgx.root).mps_directories().values()) == {GPU_RESOURCE}
    assert SHM_DIR in dgx.machine.read()["mounts"]
    assert [entry["resource"] for entry in state.mps["daemons"]] == [GPU_RESOURCE] if state.mps else False


def test_without_an_inventory_a_config_without_mps_stops_the_daemon(dgx: SimDgx) -> None:
    sync(agent(dgx, config(4))[1])
    state, manager = agent(dgx, "version: v1\nplugin:\n  enabled: true\n", inventory=False)
    sync(manager)
    assert not daemon(dgx)["alive"] and not dgx.root("/run/nvidia/mps").exists()
    assert dgx.machine.read()["mounts"] == {} and dgx.compute_modes() == [DEFAULT] * 8 and state.mps is None


# --- an adopted daemon's settings --------------------------------------------------------------------------

def _threads_set_to_50(dgx: SimDgx) -> None:
    SimMpsControl(dgx.machine, 0.2).send(_spec(), "set_default_active_thread_percentage 50")


def _memory_of_device_5_set_to_1000m(dgx: SimDgx) -> None:
    SimMpsControl(dgx.machine, 0.2).send(_spec(), "set_default_device_pinned_mem_limit 5 1000M")


def _spec() -> Any:
    from gpu_agent.mps.control import DaemonSpec
    return DaemonSpec.left(GPU_RESOURCE)


@pytest.mark.parametrize("before, after, changed, restarted", [
    (4, 2, None, True),  # the config's replicas changed while the agent was down: threads and memory differ
    (4, 4, _threads_set_to_50, True),  # someone changed the daemon's thread percentage: threads only
    (4, 4, _memory_of_device_5_set_to_1000m, True),  # and one GPU's pinned memory limit: memory only
    pytest.param(2, 2, _memory_of_device_5_set_to_1000m, True, marks=SLOW),
    (4, 4, None, False),  # nothing differs: adopted as it is, its clients keep their server
    pytest.param(48, 48, None, False, marks=SLOW),
])
def test_an_adopted_daemon_runs_with_the_settings_shown(dgx: SimDgx, before: int, after: int, changed: Any,
                                                       restarted: bool) -> None:
    sync(agent(dgx, config(before))[1])
    pid = daemon(dgx)["pid"]
    if changed:
        changed(dgx)
    pipe, inode = mark_a_pods_mount(dgx)

    state, manager = agent(dgx, config(after))  # the agent restarts
    sync(manager, 2)
    running = daemon(dgx)
    assert running["alive"] and (running["pid"] != pid) is restarted
    assert running["thread_percentage"] == 100 // after
    assert running["pinned_mem_limits"] == {str(n): f"{MEMORY // after}M" for n in range(8)}
    entry = shown(state)  # /status: what runs
    assert entry["active_thread_percentage"] == running["thread_percentage"] and entry["replicas"] == after
    assert entry["pinned_memory_limits"] == {str(n): f"{MEMORY // after}M" for n in range(8)}
    assert entry["up"] and entry["pid"] == running["pid"] and not state.mps_down
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode  # restarted in place
    assert dgx.compute_modes() == [EXCLUSIVE] * 8


def test_an_adopted_daemon_without_the_tmpfs_is_started_again_in_place(dgx: SimDgx) -> None:
    sync(agent(dgx, config(4))[1])
    with dgx.machine.edit() as sim:  # as a gpu-agent from before the tmpfs left it
        pid = sim["mps"][GPU_RESOURCE].pop("shm") and sim["mps"][GPU_RESOURCE]["pid"]
    pipe, inode = mark_a_pods_mount(dgx)
    state, manager = agent(dgx, config(4))
    sync(manager, 2)
    assert daemon(dgx)["alive"] and daemon(dgx)["pid"] != pid and daemon(dgx)["shm"]["source"] == SHM_DIR
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode and shown(state)["up"]


# --- a config change while the agent runs ------------------------------------------------------------------

@pytest.mark.parametrize("before, after", [(4, 2), pytest.param(4, 8, marks=SLOW), pytest.param(2, 48, marks=SLOW),
                                           (48, 3)])
def test_a_replicas_change_restarts_the_daemon_in_place(dgx: SimDgx, before: int, after: int) -> None:
    state, manager = agent(dgx, config(before))
    sync(manager)
    pid = daemon(dgx)["pid"]
    pipe, inode = mark_a_pods_mount(dgx)
    directories = Ledger(dgx.root).mps_directories()

    state.config = LoadedConfig(parse_config(config(after), "c"), "c", "e")
    sync(manager, 2)
    running = daemon(dgx)
    assert running["alive"] and running["pid"] != pid and running["thread_percentage"] == 100 // after
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode, "the pods' pipe directory was replaced"
    assert Ledger(dgx.root).mps_directories() == directories
    assert dgx.compute_modes() == [EXCLUSIVE] * 8 and SHM_DIR in dgx.machine.read()["mounts"]
    entry = shown(state)
    assert entry["up"] and entry["replicas"] == after and entry["restarts"] == 1 and entry["pid"] == running["pid"]
    assert entry["compute_modes_before"] == {str(n): "DEFAULT" for n in range(8)}


def test_a_gpu_set_change_restarts_in_place_and_gives_the_gpus_left_their_mode_back(dgx: SimDgx) -> None:
    shared = "nvidia.com/gpu-shared"
    state, manager = agent(dgx, config(4, "[0, 1, 2, 3]"))
    sync(manager)
    assert dgx.compute_modes() == [EXCLUSIVE] * 4 + [DEFAULT] * 4
    pipe, inode = mark_a_pods_mount(dgx, shared)
    pid = daemon(dgx, shared)["pid"]
    state.config = LoadedConfig(parse_config(config(4, "[0, 1]"), "c"), "c", "e")
    sync(manager, 2)
    gpus = dgx.inventory.gpus
    assert daemon(dgx, shared)["pid"] != pid
    assert daemon(dgx, shared)["visible_devices"] == f"{gpus[0].uuid},{gpus[1].uuid}"
    assert dgx.compute_modes() == [EXCLUSIVE] * 2 + [DEFAULT] * 6
    assert set(Ledger(dgx.root).compute_modes()) == {gpus[0].uuid, gpus[1].uuid}
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode
    assert shown(state, shared)["gpus"] == [0, 1] and shown(state, shared)["up"]


# --- a directory that cannot be made -----------------------------------------------------------------------

def _run_nvidia_is_a_file(dgx: SimDgx, monkeypatch: pytest.MonkeyPatch) -> str:
    dgx.root("/run").mkdir(exist_ok=True)
    dgx.root("/run/nvidia").write_text("a file where the MPS folders go\n")
    return "/run/nvidia: not a directory"


def _log_directory_on_a_full_disk(dgx: SimDgx, monkeypatch: pytest.MonkeyPatch) -> str:
    real = os.mkdir
    log_dir = str(dgx.root("/run/nvidia/mps/nvidia.com/gpu/log"))

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == log_dir:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), log_dir)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return ("cannot make /run/nvidia/mps/nvidia.com/gpu/log (the MPS control daemon's logs): "
            f"{os.strerror(errno.ENOSPC)}")


@pytest.mark.parametrize("break_it", [_run_nvidia_is_a_file, _log_directory_on_a_full_disk])
def test_a_directory_that_cannot_be_made_is_one_clear_error_and_no_healthy_replica(
        dgx: SimDgx, break_it: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    expected = break_it(dgx, monkeypatch)
    state, manager = agent(dgx, config(4), timing=AT_ONCE)
    with caplog.at_level(logging.INFO, logger="gpu_agent.mps"):
        sync(manager, 5)  # each pass tries again (no backoff here)
    errors = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(errors) == 1 and not any(record.exc_info for record in caplog.records), caplog.text
    assert expected in errors[0].getMessage() and "bug" not in caplog.text
    assert expected in (shown(state)["error"] or "") and shown(state)["state"] == "down"
    assert "mps" not in dgx.machine.read() or not daemon(dgx)["alive"]
    resource = advertised(dgx.inventory, {}, "none", state.config.config.plugin, mps_down=state.mps_down,
                          mps_running=state.mps_running).resources[GPU_RESOURCE]
    assert len(resource.devices) == 32 and not any(device.healthy for device in resource.devices)
    assert expected in resource.devices[0].reason


def test_mps_replicas_are_not_advertised_healthy_before_their_daemon_runs(dgx: SimDgx) -> None:
    """Between the plugin's start and the MPS watch's first pass nothing says the daemon is down: the
    replicas are healthy only once it runs."""
    state, manager = agent(dgx, config(4))
    plugin = state.config.config.plugin
    before = advertised(dgx.inventory, {}, "none", plugin, mps_down=state.mps_down, mps_running=state.mps_running)
    assert not any(device.healthy for device in before.resources[GPU_RESOURCE].devices)
    assert before.resources[GPU_RESOURCE].devices[0].reason == "its MPS control daemon is not running yet"
    sync(manager)
    after = advertised(dgx.inventory, {}, "none", plugin, mps_down=state.mps_down, mps_running=state.mps_running)
    assert all(device.healthy for device in after.resources[GPU_RESOURCE].devices)


def test_the_watch_starts_for_an_earlier_processes_daemons_when_the_config_asks_for_none(dgx: SimDgx) -> None:
    """An agent restarted with sharing.mps taken out of its config: the ledger holds the daemon, so the watch
    starts at the first publish and stops it; on a node without any, it stays off."""
    from types import SimpleNamespace

    from gpu_agent.daemon.app import Daemon as App

    sync(agent(dgx, config(4))[1])
    plain = "version: v1\nplugin:\n  enabled: true\n"

    def app(state: AgentState) -> Any:
        runtime = SimpleNamespace(root=dgx.root, mps_control=lambda: SimMpsControl(dgx.machine, 0.2),
                                  nvml=SimpleNamespace(inventory=dgx.nvml.inventory))
        return SimpleNamespace(mps=None, _mps_looked=False, runtime=runtime, state=state, publish=lambda: None,
                               _tasks=[], config=state.config.config)

    async def scenario() -> None:
        state = agent(dgx, plain)[0]
        started = app(state)
        App._ensure_mps(started)
        assert started.mps is not None and len(started._tasks) == 1
        started._tasks[0].cancel()  # its pass is run here instead, so that nothing waits on the clock
        await started.mps.sync()
        assert not daemon(dgx)["alive"] and not dgx.root("/run/nvidia/mps").exists()
        assert dgx.compute_modes() == [DEFAULT] * 8 and dgx.machine.read()["mounts"] == {}
        idle = app(agent(dgx, plain)[0])
        App._ensure_mps(idle)
        App._ensure_mps(idle)
        assert idle.mps is None and idle._tasks == []

    asyncio.run(scenario())


EVENTS = ("agent restarts", "agent restarts while NVML fails", "NVML answers again", "replicas change",
          "sharing.mps removed", "sharing.mps back", "the daemon dies", "someone sets its threads")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_runs_of_restarts_outages_and_changes_keep_the_invariants(dgx: SimDgx, seed: int) -> None:
    """Seeded runs of the events above, each followed by two passes: without an inventory the daemon is
    exactly as it was; with one, it runs with the settings asked for, its pipe directory the same one for as
    long as MPS stays on, and only it is healthy; with MPS off, nothing of it is left."""
    import random

    chance = random.Random(seed)
    replicas, shared, inventory = 4, True, True
    state, manager = agent(dgx, config(replicas), timing=AT_ONCE)
    sync(manager)
    inode = dgx.root(pipe_dir(GPU_RESOURCE)).stat().st_ino
    for _ in range(25):
        event = chance.choice(EVENTS)
        before = dict(daemon(dgx)) if "mps" in dgx.machine.read() else None
        text = config(replicas) if shared else "version: v1\nplugin:\n  enabled: true\n"
        if event.startswith("agent restarts"):
            inventory = event == "agent restarts"
            state, manager = agent(dgx, text, inventory=inventory, timing=AT_ONCE)
        elif event == "NVML answers again":
            inventory, state.inventory = True, dgx.inventory
        elif event in ("replicas change", "sharing.mps removed", "sharing.mps back"):
            replicas = chance.choice([2, 3, 4, 8, 48]) if event == "replicas change" else replicas
            shared = event != "sharing.mps removed" if event != "replicas change" else shared
            text = config(replicas) if shared else "version: v1\nplugin:\n  enabled: true\n"
            state.config = LoadedConfig(parse_config(text, "c"), "c", "e")
        elif event == "the daemon dies":
            from gpu_agent.sim.mps import kill
            kill(dgx.machine)
            before = dict(daemon(dgx)) if before else None
        elif before and before["alive"]:
            _threads_set_to_50(dgx)
            before = dict(daemon(dgx))
        sync(manager, 2)
        where = f"seed {seed}, after {event!r}"
        if shared and not inventory:
            now = daemon(dgx) if before else None
            assert now == before, where  # untouched: not started, stopped or set
            assert not state.mps_running, where
            continue
        if not shared:
            assert "mps" not in dgx.machine.read() or not daemon(dgx)["alive"], where
            assert not dgx.root("/run/nvidia/mps").exists() and dgx.compute_modes() == [DEFAULT] * 8, where
            inode = -1  # made again when MPS comes back
            continue
        running = daemon(dgx)
        assert running["alive"] and running["thread_percentage"] == 100 // replicas, where
        assert running["pinned_mem_limits"] == {str(n): f"{MEMORY // replicas}M" for n in range(8)}, where
        assert state.mps_running == {GPU_RESOURCE} and shown(state)["replicas"] == replicas, where
        pipe = dgx.root(pipe_dir(GPU_RESOURCE)).stat().st_ino
        assert inode in (-1, pipe), f"{where}: the pipe directory was made again"
        inode = pipe


@pytest.mark.parametrize("record", [None, pytest.param("CUDA_VISIBLE_DEVICES=GPU-x\n", marks=SLOW),
                                    "GPU_AGENT_MPS_REPLICAS=four\n", pytest.param("", marks=SLOW)])
def test_an_adopted_daemon_without_a_whole_record_is_restarted_in_place(dgx: SimDgx, record: Any) -> None:
    """Its GPUs cannot be told (a daemon of a gpu-agent from before the record, or a record cut short): it is
    started again, in place, and the record written anew."""
    from gpu_agent.mps import instance
    from gpu_agent.mps.layout import record_path

    sync(agent(dgx, config(4))[1])
    written = dgx.root(record_path(GPU_RESOURCE))
    assert instance.parse(GPU_RESOURCE, written.read_text()) == instance.read(dgx.root, GPU_RESOURCE) is not None
    if record is None:
        written.unlink()
    else:
        written.write_text(record)
    pid = daemon(dgx)["pid"]
    pipe, inode = mark_a_pods_mount(dgx)
    state, manager = agent(dgx, config(4))
    sync(manager)
    assert daemon(dgx)["alive"] and daemon(dgx)["pid"] != pid and shown(state)["up"]
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode
    spec = instance.read(dgx.root, GPU_RESOURCE)
    assert spec is not None and spec.replicas == 4 and spec.gpus == tuple(gpu.uuid for gpu in dgx.inventory.gpus)


# --- every GPU unreadable (found by the property test over sequences) ---------------------------------------

@pytest.mark.parametrize("unreadable", [range(8), [0, 1, 2, 3]])
def test_a_daemon_whose_gpus_nvml_cannot_read_is_left_running_with_its_directories(
        dgx: SimDgx, unreadable: range) -> None:
    """NVML fails for the daemon's GPUs (every GPU's handle, say) while it answers for how many there are: the
    inventory lists them unreadable and the config's resource has no device NVML reads. That is not knowing
    which GPUs it is for, as without an inventory: the daemon runs on, its pipe directory and the tmpfs stay.
    Before: taken for a config that no longer asks, the daemon was quit and its directories removed. With
    devices [0-3] shared, GPUs 0-3 unreadable."""
    text = config(4, "[0, 1, 2, 3]")
    sync(agent(dgx, text)[1])
    resource = "nvidia.com/gpu-shared"
    pid = daemon(dgx, resource)["pid"]
    pipe, inode = mark_a_pods_mount(dgx, resource)
    gpus = tuple(dataclasses.replace(gpu, unreadable="nvmlDeviceGetHandleByIndex: Unknown Error")
                 if gpu.index in unreadable else gpu for gpu in dgx.inventory.gpus)
    state, manager = agent(dgx, text)
    state.inventory = dataclasses.replace(dgx.inventory, gpus=gpus)
    sync(manager, 3)
    assert daemon(dgx, resource)["alive"] and daemon(dgx, resource)["pid"] == pid
    assert (pipe / "pod-sees-this").exists() and pipe.stat().st_ino == inode
    assert SHM_DIR in dgx.machine.read()["mounts"] and dgx.compute_modes()[:4] == [EXCLUSIVE] * 4
    assert shown(state, resource)["state"] == "unknown"
    state.inventory = dgx.inventory  # read again: adopted, its settings read back, kept
    sync(manager)
    assert shown(state, resource)["state"] == "running" and daemon(dgx, resource)["pid"] == pid
