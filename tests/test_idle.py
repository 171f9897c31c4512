"""Idle means idle: watchers block on inotify instead of polling, the simulated NVML event wait too,
the XID watcher sleeps until a recovery is due, and a GPU's NVML queries make one trip to a worker."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from test_health import Node
from test_metrics_fields import built
from test_nvml_client import machine  # noqa: F401  (a fixture)
from test_plugin_service import sim_state

from gpu_agent.health.checks import HealthChecks
from gpu_agent.host.inotify import DirectoryWatch
from gpu_agent.host.paths import Root
from gpu_agent.host.threads import daemon_thread
from gpu_agent.metrics.pods import PodLabels
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.sim.machine import MachineState


def test_a_directory_watch_wakes_on_a_write_and_on_a_missing_files_directory_appearing(tmp_path: Path) -> None:
    watch = DirectoryWatch()
    try:
        existing, missing = tmp_path / "a" / "config.toml", tmp_path / "b" / "c" / "daemon.json"
        existing.parent.mkdir()
        watch.watch_for([existing, missing])
        assert not watch.wait(0)
        (existing.parent / "other").write_text("x")  # not a watched entry
        assert not watch.wait(0)
        existing.write_text("x")
        assert watch.wait(5) and not watch.wait(0)  # drained: one wake per burst
        missing.parent.parent.mkdir()  # the nearest existing ancestor (tmp_path) is watched
        assert watch.wait(5)
        watch.watch_for([missing])  # now b/ is the nearest; a/ is no longer watched
        existing.write_text("y")
        assert not watch.wait(0)
        missing.parent.mkdir()
        assert watch.wait(5)
    finally:
        watch.close()


def test_the_simulated_event_wait_blocks_instead_of_polling(machine: Any) -> None:  # noqa: F811
    state, nvml = machine("dgx-h100")
    uuids = [gpu.uuid for gpu in nvml.inventory.read().gpus]
    reads = 0
    read = state.read

    def counting() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return read()

    wait = nvml.events.watch_xids()
    state.read = counting  # type: ignore[method-assign]
    assert wait(300) is None
    assert reads <= 3  # polling every 50 ms read it 8 times

    def inject() -> None:
        with state.edit() as doc:
            doc["xids"].append({"seq": doc["next_seq"], "gpu": 5, "xid": 48, "at": 0.0})
            doc["next_seq"] += 1

    timer = threading.Timer(0.2, inject)
    timer.start()
    event = wait(30_000)  # the write wakes it, long before the timeout
    timer.join()
    assert event is not None and event.gpu_uuid == uuids[5] and event.xid == 48


def test_the_xid_watcher_waits_until_the_next_recovery_is_due(tmp_path: Path) -> None:
    node = Node(tmp_path, "{recover_after_seconds: 30}")
    assert node.watcher._wait_ms() == 1_000  # nothing due: the longest wait
    node.xid(3, 79)  # lost: time alone does not bring it back
    node.xid(1, 48)
    node.clock.now += 25
    assert node.watcher._wait_ms() == 1_000
    node.clock.now += 4.5
    assert node.watcher._wait_ms() == 501
    node.later(2)
    assert node.gpu_json(1)["health"] == "healthy" and node.watcher._wait_ms() == 1_000


def test_a_sample_makes_one_trip_to_an_nvml_worker_per_gpu(machine: Any) -> None:  # noqa: F811
    _, nvml = machine("dgx-h100")
    nvml.inventory.read()
    trips: list[str] = []
    calls = nvml.session._call
    here = threading.current_thread()

    def counting(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is here:  # not a call within a batch, on the worker
            trips.append(name)
        return calls(name, fn, *args, **kwargs)

    nvml.session._call = counting  # type: ignore[assignment]
    try:
        sample = nvml.sampling.sample(4)
        assert sample.temperature_c is not None and len(trips) == 1
        nvml.inventory.read()
    finally:
        nvml.session._call = calls
    assert trips[1:] == ["nvmlDevice*(inventory)"]  # the whole inventory, 8 GPUs, in one batch


def test_a_sample_and_a_round_of_health_checks_make_one_trip_each_for_every_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path, "{}")
    node.sampler.sample()  # the first GPM sample of each GPU
    trips: list[str] = []
    calls = node.nvml.session._call
    here = threading.current_thread()

    def counting(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is here:
            trips.append(name)
        return calls(name, fn, *args, **kwargs)

    node.nvml.session._call = counting  # type: ignore[assignment]
    try:
        node.sampler.sample()  # GPM and processes included
        HealthChecks(node.nvml, node.state).run()
    finally:
        node.nvml.session._call = calls
    assert trips == ["nvmlDeviceGet*(every GPU)", "nvmlDeviceGet*(health of every GPU)"]
    assert len(node.state.samples) == 8 and len(node.state.processes) == 8
    assert node.state.checked_at is not None and node.state.nvml_check is None


def test_the_agents_threads_carry_their_names_for_the_kernel(machine: Any) -> None:  # noqa: F811
    _, nvml = machine("dgx-h100")
    seen: list[str] = []
    thread = daemon_thread(lambda: seen.append(Path("/proc/thread-self/comm").read_text().strip()), "xid-watcher")
    thread.start()
    thread.join(5)
    assert seen == ["xid-watcher"] and thread.name == "xid-watcher"
    names = {task.read_text().strip() for task in Path("/proc/self/task").glob("*/comm")}
    assert {"nvml-0", "nvml-1", "nvml-2", "nvml-3"} <= names  # top -H and bench's wake-up counts name them


def test_a_sample_asks_for_a_handle_once_per_gpu_and_for_mig_devices_once_per_layout(tmp_path: Path) -> None:
    spec = tmp_path / "mig.yaml"
    spec.write_text("gpus:\n  - model: H100-80GB-HBM3\n    count: 2\n    mig:\n      enabled: true\n"
                    "      devices: [1g.10gb, 1g.10gb, 1g.10gb, 2g.20gb]\n")
    runtime = built(tmp_path, str(spec))
    try:
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        calls = runtime.nvml.lib.calls
        calls.clear()  # the reconcile pass's
        sampler.sample()
        first = Counter(calls)
        sampler.sample()
        second = Counter(calls) - first
        runtime.nvml.inventory.forget()  # a reconcile pass begins: the layout may have changed meanwhile
        sampler.sample()
        third = Counter(calls) - first - second
    finally:
        runtime.nvml.close()
    assert first["nvmlDeviceGetMigDeviceHandleByIndex"] == 8 and third["nvmlDeviceGetMigDeviceHandleByIndex"] == 8
    assert second["nvmlDeviceGetMigDeviceHandleByIndex"] == 0
    assert second["nvmlDeviceGetHandleByIndex"] == 2  # metrics, processes and 5 GPM samples per GPU share it
    assert second["nvmlDeviceGetMemoryInfo"] == 2 + 8  # what does change is read at every sample
    assert len(runtime.state.samples) == 2
    assert all(len(sample.mig) == 4 and sample.mig[0].memory_free_mib for sample in runtime.state.samples.values())


def test_the_device_plugin_sleeps_until_the_kubelet_comes_and_retries_only_what_failed(tmp_path: Path) -> None:
    root, state = sim_state(tmp_path)
    directory = root / "var/lib/kubelet/device-plugins"
    directory.mkdir(parents=True)
    manager = DevicePluginManager(Root(root), state)
    syncs: list[float] = []
    sync = manager.sync

    async def counted() -> None:
        syncs.append(time.monotonic())
        await sync()

    manager.sync = counted  # type: ignore[method-assign]

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the plugin did not get there in 10 s")

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(manager.run())
        try:
            await until(lambda: state.plugin is not None)
            await asyncio.sleep(2.5)  # a poll every second would have synced twice more
            waiting = len(syncs)
            (directory / "kubelet.sock").write_text("")  # a kubelet.sock that is no socket: registration fails
            await until(lambda: "registration with the kubelet failed" in str(manager.errors))
            failed = len(syncs)
            await until(lambda: len(syncs) >= failed + 2)  # retried while it fails
            manager.wake()  # a publish of the model
            return waiting, failed
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    waiting, failed = asyncio.run(scenario())
    assert waiting == 1  # waiting for the kubelet, it slept
    assert failed >= 2  # kubelet.sock's creation woke it (inotify); the failed registration is retried


def test_pod_labels_turned_off_sleep_until_a_reload_turns_them_on(tmp_path: Path) -> None:
    enabled = [False]
    published: list[Any] = []
    labels = PodLabels(Root(tmp_path), lambda: None, published.append, lambda: enabled[0], lambda: 0.05)

    async def scenario() -> tuple[int, list[Any]]:
        task = asyncio.create_task(labels.run())
        try:
            await asyncio.sleep(0.5)  # ten intervals
            off = len(published)
            enabled[0] = True
            labels.reconfigured()
            for _ in range(200):
                if len(published) >= off + 2:
                    break
                await asyncio.sleep(0.05)
            return off, published[off:]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    off, on = asyncio.run(scenario())
    assert off == 1 and published[0] is None  # said once that there are none, then slept
    assert len(on) >= 2 and all(pods is not None and "no kubelet pod-resources socket" in pods.error for pods in on)


def test_a_simulated_call_sees_another_writers_change_at_once_without_a_stat_each_time(tmp_path: Path) -> None:
    writer, reader = MachineState(Root(tmp_path)), MachineState(Root(tmp_path))  # as `gpu-agent sim` and the agent
    writer.ensure("dgx-h100")
    stamps = 0
    stamp = reader.stamp

    def counting() -> Any:
        nonlocal stamps
        stamps += 1
        return stamp()

    reader.stamp = counting  # type: ignore[method-assign]
    first = reader.read()
    assert all(reader.read() is first for _ in range(100)) and stamps == 1  # the mapped counter said: unchanged
    with writer.edit() as doc:
        doc["gpus"][2]["temperature_c"] = 91
    assert reader.read()["gpus"][2]["temperature_c"] == 91 and stamps == 2

    old_root = Root(tmp_path / "older")  # a state written before the counter existed: reads look at the file
    MachineState(old_root).ensure("dgx-h100")
    MachineState(old_root).writes_path.unlink()
    older = MachineState(old_root)
    assert older.read()["gpus"][2].get("temperature_c") is None and older.read() is older.read()
    with MachineState(old_root).edit() as doc:  # its next write makes the counter, and readers map it
        doc["gpus"][2]["temperature_c"] = 40
    assert older.read()["gpus"][2]["temperature_c"] == 40 and older.read() is older.read()
    assert older._writes is not None
