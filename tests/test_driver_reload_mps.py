"""Issue 33, point 3: the driver reload and the MPS control daemons together, on the simulator. An MPS server
keeps the GPUs open after its last client, so with MPS on a reload waited for "process N (nvidia-cuda-mps)"
and failed forever; a module reload resets the GPUs to DEFAULT compute mode while /status still said
EXCLUSIVE_PROCESS. Now the reload quits the agent's daemons before the unload (recorded first), never counts
them or their servers as GPU users, and starts them again once validated, their GPUs in EXCLUSIVE_PROCESS; the
MPS watch starts none it holds; the watch's probe sets a compute mode reset under a running daemon back."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.daemons import MpsManager, Timing, start_daemon
from gpu_agent.mps.layout import pipe_dir
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Inventory
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe, loaded_version
from gpu_agent.sim.mps import SimMpsControl
from gpu_agent.state import AgentState
from harness import Pass, SimNode, run_cli
from kube_emulator import KubeEmulator
from test_driver_reload import (  # noqa: F401 (kube_api: the fixture `api`)
    NEW,
    NODE,
    PERSISTENCED,
    STATE,
    Killed,
    a_minute_later,
    kube_api,
    settings,
    unit_state,
)

OLD = "550.90.07"
GPU = "nvidia.com/gpu"
EXCLUSIVE, DEFAULT = 3, 0  # NVML's compute modes as the simulator keeps them
AT_ONCE = Timing(poll_s=0.05, probe_s=0.0, backoff_s=(0.0, 0.0))  # each sync probes, and may start again


SHARED, OLD_RESOURCE = "nvidia.com/gpu-shared", "nvidia.com/old"


def mps(replicas: int = 4, split: bool = False) -> dict[str, Any]:
    """plugin.sharing.mps: nvidia.com/gpu on every GPU, or (split) GPUs 0-3 shared as nvidia.com/gpu-shared, the
    others advertised unshared."""
    if not split:
        return {"enabled": True, "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": replicas}]}}}
    half = {"name": "gpu", "replicas": replicas, "devices": [0, 1, 2, 3], "rename": "gpu-shared"}
    return {"enabled": True, "per_resource_sharing": True, "sharing": {"mps": {"resources": [half]}}}


class Node:
    """A simulated node with the API, sharing.mps and the MPS watch of the running agent (synced by hand)."""

    def __init__(self, tmp_path: Path, api: KubeEmulator, profile: str = "t4", replicas: int = 4,
                 split: bool = False, reload: str = "when-idle") -> None:
        self.sim = SimNode(tmp_path / "root", profile)
        self.api = api
        self.config = {**settings(api, self.sim, reload), "mig": {}, "plugin": mps(replicas, split)}
        first = self.sim.apply(self.config)
        assert first.stage("driver").state == "ok", first.stage("driver").message
        self.nvml = Nvml(FakeNvml(self.sim.machine))
        self.watch = self.agent(first.state)
        self.sync()
        if split:  # GPUs 4-7's daemon, from an earlier config, which the watch has not stopped yet
            gpus = [gpu.uuid for gpu in self.inventory().gpus][4:]
            spec = DaemonSpec(OLD_RESOURCE, tuple(gpus), (4, 5, 6, 7), (81559,) * 4, 2)
            start_daemon(self.watch.root, self.watch.ledger, self.watch.control, self.nvml.inventory, spec)
        self.resources = sorted(self.daemons())
        assert self.resources and all(d["alive"] for d in self.daemons().values()), self.daemons()
        assert self.compute_modes() == [EXCLUSIVE] * len(self.compute_modes())

    def agent(self, state: AgentState) -> MpsManager:
        """The MPS watch of an agent process whose state is `state` (its config, its inventory)."""
        root = Root(self.sim.root).with_kernel(self.sim.machine.kernel_dir)
        return MpsManager(root, state, SimMpsControl(self.sim.machine, 0.2), self.nvml.inventory, lambda: None,
                          AT_ONCE)

    def inventory(self) -> Inventory:
        assert self.watch.state.inventory is not None
        return self.watch.state.inventory

    def sync(self, times: int = 1) -> None:
        for _ in range(times):
            asyncio.run(self.watch.sync())

    def apply(self) -> Pass:
        a_minute_later(self.sim)
        return self.sim.apply(self.config)

    def daemons(self) -> dict[str, dict[str, Any]]:
        return dict(self.sim.machine.read().get("mps", {}))

    def pids(self) -> dict[str, Optional[int]]:
        return {name: d["pid"] if d["alive"] else None for name, d in self.daemons().items()}

    def compute_modes(self) -> list[int]:
        return [gpu.get("compute_mode", DEFAULT) for gpu in self.sim.machine.read()["gpus"]]

    def record(self) -> dict[str, Any]:
        entry = Ledger(Root(self.sim.root)).driver_reload()
        assert entry is not None
        return entry

    def client_came_and_went(self, resource: str = GPU) -> int:
        """A pod's process used the daemon and ended: its server stays, the GPUs open. The server's pid."""
        uuids = [gpu["uuid"] for gpu in self.sim.machine.read()["gpus"]]
        gpu = uuids.index(self.daemons()[resource]["visible_devices"].split(",")[0])
        self.sim.sim("add-process", "--gpu", str(gpu), "--pid", "4242", "--name", "train.py", "--mps", resource)
        self.sim.sim("clear")
        servers = self.daemons()[resource]["servers"]
        assert len(servers) == 1
        return int(servers[0])

    def root_has(self, host_path: str) -> bool:
        return (self.sim.root / host_path.lstrip("/")).exists()

    def shown(self) -> dict[str, dict[str, Any]]:
        assert self.watch.state.mps is not None
        return {entry["resource"]: entry for entry in self.watch.state.mps["daemons"]}

    def close(self) -> None:
        self.nvml.close()


@pytest.fixture
def made(tmp_path: Path, api: KubeEmulator) -> Any:
    nodes: list[Node] = []

    def make(**kwargs: Any) -> Node:
        nodes.append(Node(tmp_path, api, **kwargs))
        return nodes[-1]

    yield make
    for node in nodes:
        node.close()


def assert_done(run: Pass, node: Node, before: dict[str, Optional[int]]) -> None:
    """Reloaded and validated, uncordoned, upgrade-done; every daemon the agent quit runs again (a new one), its
    GPUs in EXCLUSIVE_PROCESS; the record holds none."""
    assert run.stage("driver").state == "ok", run.stage("driver").message
    assert run.stage("driver-upgrade").state == "ok", run.stage("driver-upgrade").message
    assert loaded_version(node.sim.machine.read(), "nvidia") == NEW
    assert not node.api.get_node(NODE)["spec"].get("unschedulable") and node.api.labels()[STATE] == "upgrade-done"
    assert node.record()["step"] == "upgrade-done" and node.record()["stopped_mps"] == []
    assert unit_state(node.sim, PERSISTENCED) == "active"
    after = node.pids()
    assert all(after[name] not in (None, before[name]) for name in before), after
    uuids = [gpu["uuid"] for gpu in node.sim.machine.read()["gpus"]]
    served = {uuids.index(uuid) for name in before for uuid in node.daemons()[name]["visible_devices"].split(",")}
    assert {n for n, mode in enumerate(node.compute_modes()) if mode == EXCLUSIVE} >= served
    node.sync()
    assert set(node.shown()) == set(before) - {OLD_RESOURCE}  # the config's: another one is the watch's to stop
    assert all(entry["up"] and entry["compute_mode"] == "EXCLUSIVE_PROCESS" for entry in node.shown().values())
    assert all(entry["pid"] == after[name] for name, entry in node.shown().items())


# --- the reproductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("profile, replicas", [("t4", 4), pytest.param("a30", 2, marks=pytest.mark.slow),
                                               pytest.param("t4", 48, marks=pytest.mark.slow)])
def test_a_reload_with_mps_on_quits_the_daemons_and_starts_them_again(made: Callable[..., Node], profile: str,
                                                                      replicas: int) -> None:
    """Before: the reload waited for the MPS server (a process with the GPU open after its client ended) and,
    once it gave up, failed so at every retry on a cordoned node."""
    node = made(profile=profile, replicas=replicas)
    server = node.client_came_and_went()
    node.sim.sim("install-driver", NEW)
    before = node.pids()
    run = node.apply()
    assert f"{server} (nvidia-cuda-mps)" not in run.stage("driver").message
    assert_done(run, node, before)
    assert node.daemons()[GPU]["thread_percentage"] == 100 // replicas  # its limits set again


def test_a_module_reload_by_hand_resets_compute_mode_and_the_probe_sets_it_again(made: Callable[..., Node]) -> None:
    """Before: /status said EXCLUSIVE_PROCESS (what the agent once set) while the GPUs were in DEFAULT. The probe
    reads the modes back and sets them again in place: the daemon, its server and its clients keep running."""
    node = made(profile="a30")
    pid = node.pids()[GPU]
    node.sim.sim("reload-driver")  # the daemon holds no GPU without a client: the modules reload under it
    assert node.compute_modes() == [DEFAULT] and node.pids()[GPU] == pid
    node.sim.sim("fail", "nvmlDeviceSetComputeMode", "--error", "NoPermission")
    node.sync()  # /status says what is: DEFAULT, the replicas not healthy meanwhile
    entry = node.shown()[GPU]
    assert entry["compute_mode"] == "DEFAULT" and entry["state"] == "down" and not entry["up"]
    assert "nvmlDeviceSetComputeMode: Insufficient Permissions" in (entry["error"] or ""), entry["error"]
    assert GPU in node.watch.state.mps_down and node.pids()[GPU] == pid  # down, but never restarted for it
    node.sim.sim("clear")
    node.sync()
    assert node.compute_modes() == [EXCLUSIVE] and node.pids()[GPU] == pid
    entry = node.shown()[GPU]
    assert entry["up"] and entry["compute_mode"] == "EXCLUSIVE_PROCESS" and entry["restarts"] == 0
    assert GPU not in node.watch.state.mps_down


def test_the_probe_reads_the_compute_modes_back_periodically(made: Callable[..., Node]) -> None:
    """Set to DEFAULT by hand under a running daemon (nvidia-smi -c 0): the probe, every probe_s, sees it."""
    node = made(profile="a30")
    node.watch.timing = Timing(poll_s=0.05, probe_s=3600.0, backoff_s=(0.0, 0.0))
    node.sync()
    with node.sim.machine.edit() as state:
        state["gpus"][0]["compute_mode"] = DEFAULT
    node.sync()
    assert node.compute_modes() == [DEFAULT]  # not probed yet: its last probe was just now
    node.watch.daemons[GPU].probed_at = 0.0  # the probe due
    node.sync()
    assert node.compute_modes() == [EXCLUSIVE] and node.shown()[GPU]["up"]


# --- the MPS watch while the reload runs -----------------------------------------------------------------------

def test_the_watch_starts_no_daemon_the_reload_quit_until_the_reload_starts_it(
        made: Callable[..., Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch runs beside the reload (another thread): at every rmmod it looks, with an inventory and its
    backoff passed, and starts nothing the record holds; the daemon is down, named as the reload's."""
    node = made(profile="a30")
    node.client_came_and_went()
    node.sim.sim("install-driver", NEW)
    before = node.pids()
    seen: list[tuple[Optional[int], Optional[str]]] = []
    unload = SimModprobe.unload

    def watched(self: SimModprobe, module: str) -> None:
        node.sync(2)
        seen.append((node.pids()[GPU], node.shown()[GPU]["error"]))
        unload(self, module)

    monkeypatch.setattr(SimModprobe, "unload", watched)
    run = node.apply()
    assert seen and all(pid is None for pid, _ in seen), seen
    assert all(error and "quit by the driver reload" in error for _, error in seen), seen
    monkeypatch.undo()
    assert_done(run, node, before)


@pytest.mark.parametrize("replicas", [2, pytest.param(7, marks=pytest.mark.slow)])
def test_every_daemon_of_the_agents_is_quit_and_started_again(made: Callable[..., Node], replicas: int) -> None:
    """Two of the agent's daemons hold GPUs: the config's (GPUs 0-3) and one an earlier config left (4-7), which
    the watch has not stopped yet. Both servers would keep nvidia loaded: both are quit, and both started again
    as they ran (the reload puts back what it took away); the watch then stops the one no longer asked for."""
    node = made(profile="dgx-h100", replicas=replicas, split=True)
    assert node.resources == [SHARED, OLD_RESOURCE]
    uuids = [gpu["uuid"] for gpu in node.sim.machine.read()["gpus"]]
    for resource in node.resources:
        node.client_came_and_went(resource)
    node.sim.sim("install-driver", NEW)
    before = node.pids()
    assert_done(node.apply(), node, before)
    daemons = node.daemons()
    assert daemons[SHARED]["visible_devices"] == ",".join(uuids[:4])
    assert daemons[SHARED]["thread_percentage"] == 100 // replicas
    assert daemons[OLD_RESOURCE]["visible_devices"] == ",".join(uuids[4:])
    assert not node.daemons()[OLD_RESOURCE]["alive"] and set(node.shown()) == {SHARED}
    assert node.compute_modes() == [EXCLUSIVE] * 4 + [DEFAULT] * 4  # GPUs 4-7's put back as they were


def test_a_client_still_running_is_waited_for(made: Callable[..., Node]) -> None:
    """Its pod's process is a GPU user (the daemon and the server are not): the reload waits for it."""
    node = made(profile="a30")
    node.sim.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py", "--mps", GPU)
    node.sim.sim("install-driver", NEW)
    waiting = node.apply()
    message = waiting.stage("driver").message
    assert "wait-for-jobs-required: waiting for process 4242 (train.py) to end" in message, message
    assert "nvidia-cuda-mps" not in message and node.pids()[GPU] is not None
    before = node.pids()
    node.sim.sim("clear")
    assert_done(node.apply(), node, before)


# --- a kill -9 at each step -----------------------------------------------------------------------------------

def _unloaded(entry: dict[str, Any]) -> bool:
    return bool(entry["unloaded"])


CRASHES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "the quit recorded": lambda e: bool(e["stopped_mps"]) and not e["unloaded"] and e["step"] == "pod-restart-required",
    "the daemons quit": _unloaded,  # recorded before the first rmmod, the daemons gone
    "nvidia loaded again": lambda e: e["reloaded"],
    "validation": lambda e: e["step"] == "validation-required",
    "one daemon started again": lambda e: e["step"] == "validation-required" and len(e["stopped_mps"]) == 1,
    "uncordon": lambda e: e["step"] == "uncordon-required",
}


def killed_when(node: Node, crash: Callable[[dict[str, Any]], bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass dies (kill -9) right after the first record `crash` holds for."""
    save = Ledger.save_driver_reload

    def crash_after(ledger: Ledger, entry: Any) -> None:
        save(ledger, entry)
        if entry is not None and crash(entry):
            raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "save_driver_reload", crash_after)
        with pytest.raises(Killed):
            node.apply()


FAST_CRASHES = ("the daemons quit", "one daemon started again")  # `make test`'s; the others in test-slow


@pytest.mark.parametrize("point", [point if point in FAST_CRASHES else pytest.param(point, marks=pytest.mark.slow)
                                   for point in CRASHES])
def test_killed_at_each_step_the_restarted_agent_starts_the_daemons_once_validated(
        made: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Two daemons: the config's, and one an earlier config left. Whatever the record holds, the restarted agent's
    watch (with the last inventory) starts none of those the reload quit, and stops for good only the one the
    config no longer asks for; the restarted reload quits what still runs, finishes and starts the config's."""
    node = made(profile="dgx-h100", split=True)
    for resource in node.resources:
        node.client_came_and_went(resource)
    node.sim.sim("install-driver", NEW)
    before = {SHARED: node.pids()[SHARED]}
    killed_when(node, CRASHES[point], monkeypatch)
    held = node.record()["stopped_mps"]
    down = {name for name, pid in node.pids().items() if pid is None}
    assert down <= set(held), (held, down)  # nothing the record does not hold was quit
    node.watch = node.agent(AgentState(node.watch.state.config, inventory=node.watch.state.inventory))
    node.sync(3)
    assert (node.pids()[SHARED] is None) is (SHARED in down)  # not started by the watch while held
    if SHARED in held:
        assert node.shown()[SHARED]["state"] != "running"
    assert node.pids()[OLD_RESOURCE] is None and not node.root_has(f"/run/nvidia/mps/{OLD_RESOURCE}")
    assert_done(node.apply(), node, before)
    assert node.pids()[OLD_RESOURCE] is None


# --- failures and ends ----------------------------------------------------------------------------------------

def test_a_failed_unload_keeps_the_daemons_quit_while_the_driver_cannot_serve(made: Callable[..., Node]) -> None:
    """The old nvidia refuses to unload beside the new driver's NVML: nothing could run on the GPUs, the daemons
    stay quit (held) while it retries, and start once the retry is validated."""
    node = made(profile="a30")
    node.client_came_and_went()
    node.sim.sim("install-driver", NEW)
    node.sim.sim("fail", "rmmod", "--module", "nvidia", "--times", "1")
    before = node.pids()
    failed = node.apply()
    assert "could not unload nvidia" in failed.stage("driver").message, failed.stage("driver").message
    assert node.record()["step"] == "upgrade-failed" and node.record()["stopped_mps"] == [GPU]
    node.sync(2)
    assert node.pids()[GPU] is None and "quit by the driver reload" in (node.shown()[GPU]["error"] or "")
    assert_done(node.apply(), node, before)


def test_a_failed_forced_reload_starts_the_daemons_again_while_it_retries(made: Callable[..., Node],
                                                                           tmp_path: Path) -> None:
    """`--force` on a driver that needs nothing: nvidia refuses to unload. The driver serves as before, so the
    daemons run again, their GPUs EXCLUSIVE_PROCESS, while the retry waits for its backoff."""
    node = made(profile="a30")
    node.client_came_and_went()
    pid = node.pids()[GPU]
    node.sim.sim("fail", "rmmod", "--module", "nvidia")
    written = tmp_path / "command.yaml"
    written.write_text(json.dumps({"version": "v1", **node.config}))
    a_minute_later(node.sim)
    forced = run_cli("--simulate", node.sim.simulate, "driver", "reload", "--force", "--timeout", "0",
                     root=node.sim.root, config=written)
    assert forced.returncode != 0 and "could not unload nvidia" in forced.stdout + forced.stderr
    assert node.record()["stopped_mps"] == [] and node.record()["step"] == "upgrade-failed"
    assert node.pids()[GPU] not in (None, pid) and node.compute_modes() == [EXCLUSIVE]


@pytest.mark.parametrize("quit_done", [pytest.param(False, marks=pytest.mark.slow), True])
def test_abort_during_the_mps_quit(made: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   quit_done: bool) -> None:
    """The agent died at the quit (recorded, or made), then `--abort`: the record ends with no daemon held; one
    still running is left as it is, one quit stays down while the old driver cannot serve (NVML's mismatch) and
    is the watch's to start once the driver serves: after the reload `gpu-agent driver reload` makes."""
    node = made(profile="a30")
    node.client_came_and_went()
    node.sim.sim("install-driver", NEW)
    pid = node.pids()[GPU]
    killed_when(node, CRASHES["the daemons quit" if quit_done else "the quit recorded"], monkeypatch)
    written = tmp_path / "command.yaml"
    written.write_text(json.dumps({"version": "v1", **node.config}))
    a_minute_later(node.sim)
    aborted = run_cli("--simulate", node.sim.simulate, "driver", "reload", "--abort", "--json", root=node.sim.root,
                      config=written)
    outcome = json.loads(aborted.stdout)
    assert aborted.returncode == 0 and outcome["reload"]["step"] == "upgrade-abandoned", aborted.stdout
    assert outcome["reload"]["stopped_mps"] == [] and not node.api.get_node(NODE)["spec"].get("unschedulable")
    if quit_done:
        assert node.pids()[GPU] is None
        assert f"the MPS control daemon for {GPU} stays stopped until the driver serves (the MPS watch starts it " \
               "then)" in outcome["reload"]["notes"]
    else:
        assert node.pids()[GPU] == pid  # never quit: left running
    node.sync()
    assert node.shown()[GPU]["error"] is None or "quit by the driver reload" not in node.shown()[GPU]["error"]
    a_minute_later(node.sim)
    again = run_cli("--simulate", node.sim.simulate, "driver", "reload", root=node.sim.root, config=written)
    assert again.returncode == 0, again.stdout + again.stderr
    node.sync(2)
    assert node.pids()[GPU] is not None and node.compute_modes() == [EXCLUSIVE] and node.shown()[GPU]["up"]


def test_a_reboot_after_the_quit_starts_the_daemons_once_validated(made: Callable[..., Node],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A reboot after the daemons were quit: it ended every daemon and loaded the new driver; the watch starts
    none the record holds; the reload (nothing to unload) starts them after validation."""
    node = made(profile="dgx-h100", split=True)
    node.sim.sim("install-driver", NEW)
    before = {SHARED: node.pids()[SHARED]}
    pipe = node.sim.root / pipe_dir(SHARED).lstrip("/")
    inode = pipe.stat().st_ino
    killed_when(node, CRASHES["the daemons quit"], monkeypatch)
    node.sim.sim("reboot")
    assert all(pid is None for pid in node.pids().values()) and node.compute_modes() == [DEFAULT] * 8
    node.watch = node.agent(AgentState(node.watch.state.config, inventory=node.watch.state.inventory))
    node.sync(2)
    assert all(pid is None for pid in node.pids().values())
    assert_done(node.apply(), node, before)
    assert pipe.stat().st_ino == inode  # started again in its directories: the pods' mounts kept
