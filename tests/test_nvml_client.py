"""gpu_agent.nvml.client.Nvml over the simulator: inventory, MIG placements, faults, hangs, XIDs."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pynvml
import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlHung, NvmlUnavailable, describe
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState

H100_PLACEMENTS = {
    "1g.10gb": ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)),
    "1g.20gb": ((0, 2), (2, 2), (4, 2), (6, 2)),
    "2g.20gb": ((0, 2), (2, 2), (4, 2)),
    "3g.40gb": ((0, 4), (4, 4)),
    "4g.40gb": ((0, 4),),
    "7g.80gb": ((0, 8),),
}
A100_PLACEMENTS = {
    "1g.5gb": H100_PLACEMENTS["1g.10gb"],
    "1g.10gb": H100_PLACEMENTS["1g.20gb"],
    "2g.10gb": H100_PLACEMENTS["2g.20gb"],
    "3g.20gb": H100_PLACEMENTS["3g.40gb"],
    "4g.20gb": H100_PLACEMENTS["4g.40gb"],
    "7g.40gb": H100_PLACEMENTS["7g.80gb"],
}
A30_PLACEMENTS = {"1g.6gb": ((0, 1), (1, 1), (2, 1), (3, 1)), "2g.12gb": ((0, 2), (2, 2)), "4g.24gb": ((0, 4),)}


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Any]:
    """Builds a simulated machine and an Nvml over it; clears faults at the end so no worker hangs on."""
    made: list[tuple[MachineState, Nvml]] = []

    def make(spec: str, call_timeout: float = 2.0) -> tuple[MachineState, Nvml]:
        state = MachineState(Root(tmp_path))
        state.ensure(spec)
        if state.read()["driver_version"]:
            SimModprobe(state, Root(tmp_path)).load("nvidia")  # NVML needs the kernel module, as on a real node
        nvml = Nvml(FakeNvml(state), call_timeout=call_timeout)
        made.append((state, nvml))
        return state, nvml

    yield make
    for state, nvml in made:
        if state.exists():
            with state.edit() as doc:
                doc["faults"].clear()
        nvml.close()


def add_fault(state: MachineState, call: str, error: str, times: Any = None) -> None:
    with state.edit() as doc:
        fault_id = max((f["id"] for f in doc["faults"]), default=0) + 1
        doc["faults"].append({"id": fault_id, "call": call, "gpu": None, "times": times, "error": error})


@pytest.mark.parametrize(
    "profile, count, product, bus0",
    [
        ("dgx-a100", 8, "NVIDIA A100-SXM4-40GB", "0000:07:00.0"),
        ("dgx-h100", 8, "NVIDIA H100 80GB HBM3", "0000:18:00.0"),
        ("a30", 1, "NVIDIA A30", "0000:3b:00.0"),
        ("t4", 1, "Tesla T4", "0000:00:1e.0"),
    ],
)
def test_inventory_of_builtin_profiles(machine: Any, profile: str, count: int, product: str, bus0: str) -> None:
    _, nvml = machine(profile)
    inventory = nvml.inventory.read()
    assert inventory.cuda_version == "12.4"
    assert inventory.driver_version == "550.90.07"
    assert len(inventory.gpus) == count
    assert [gpu.index for gpu in inventory.gpus] == list(range(count))
    assert {gpu.product for gpu in inventory.gpus} == {product}
    assert len({gpu.uuid for gpu in inventory.gpus}) == count
    assert all(gpu.uuid.startswith("GPU-") for gpu in inventory.gpus)
    assert inventory.gpus[0].pci_bus_id == bus0
    assert len({gpu.pci_bus_id for gpu in inventory.gpus}) == count
    assert all(not gpu.mig.enabled and gpu.mig.devices == () for gpu in inventory.gpus)


def test_dgx_h100_bus_ids_and_summary(machine: Any) -> None:
    _, nvml = machine("dgx-h100")
    inventory = nvml.inventory.read()
    assert [g.pci_bus_id for g in inventory.gpus][:3] == ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"]
    assert inventory.summary() == "8x H100 80GB HBM3, driver 550.90.07"
    assert inventory.gpus[0].compute_capability == (9, 0)
    assert inventory.gpus[0].memory_mib == 81559


def test_no_driver_is_unavailable(machine: Any) -> None:
    _, nvml = machine("none")
    with pytest.raises(NvmlUnavailable, match="not installed") as info:
        nvml.inventory.read()
    assert info.value.no_driver is True


def test_t4_is_not_mig_capable(machine: Any) -> None:
    _, nvml = machine("t4")
    mig = nvml.inventory.read().gpus[0].mig
    assert mig.capable is False
    assert mig.profiles == ()


@pytest.mark.parametrize(
    "profile, expected", [("dgx-a100", A100_PLACEMENTS), ("dgx-h100", H100_PLACEMENTS), ("a30", A30_PLACEMENTS)]
)
def test_mig_profile_placements(machine: Any, profile: str, expected: dict[str, Any]) -> None:
    _, nvml = machine(profile)
    for gpu in nvml.inventory.read().gpus:
        assert gpu.mig.capable
        placements = {p.name: p.placements for p in gpu.mig.profiles}
        for name, wanted in expected.items():
            assert placements[name] == wanted, name
        by_name = {p.name: p for p in gpu.mig.profiles}
        for name, wanted in expected.items():
            assert by_name[name].instances == len(wanted), name


def test_a30_has_four_slices(machine: Any) -> None:
    _, nvml = machine("a30")
    profiles = {p.name: p for p in nvml.inventory.read().gpus[0].mig.profiles}
    assert profiles["1g.6gb"].instances == 4
    assert profiles["2g.12gb"].instances == 2
    assert profiles["4g.24gb"].instances == 1
    assert max(start + size for p in profiles.values() for start, size in p.placements) == 4


def test_hung_call_times_out_then_fails_fast_then_recovers(machine: Any) -> None:
    state, nvml = machine("dgx-h100", call_timeout=0.3)
    nvml.inventory.read()
    add_fault(state, "nvmlDeviceGetTemperature", "hang")
    with pytest.raises(NvmlHung, match=r"nvmlDeviceGetTemperature did not return within 0.3 s"):
        nvml.sampling.sample(0)
    assert nvml.session.timeouts == 1

    with pytest.raises(NvmlHung, match="nvmlDeviceGetTemperature") as info:
        nvml.inventory.read()
    assert "not attempted" in str(info.value)
    assert nvml.session.timeouts == 1  # refused at once while the stuck call holds: no second wait that times out

    with state.edit() as doc:
        doc["faults"].clear()
    deadline = time.monotonic() + 3.0
    while True:
        try:
            sample = nvml.sampling.sample(0)
            break
        except NvmlHung:
            assert time.monotonic() < deadline, "NVML still reported hung after the stuck call returned"
            time.sleep(0.05)
    assert sample.temperature_c is not None
    assert len(nvml.inventory.read().gpus) == 8


def test_injected_error_fires_once_and_is_that_gpus_alone(machine: Any) -> None:
    """The failed query is GPU 0's fact, not the inventory's: the others are read whole, and GPU 0 is known by
    what NVML still answers of it (its UUID, asked again, answers: the fault fired once)."""
    state, nvml = machine("dgx-a100")
    nvml.session.init()
    add_fault(state, "nvmlDeviceGetUUID", "GpuIsLost", times=1)
    first = nvml.inventory.read()
    assert [gpu.index for gpu in first.readable] == [1, 2, 3, 4, 5, 6, 7]
    lost = first.gpus[0]
    assert lost.unreadable == "nvmlDeviceGetUUID: GPU is lost" and lost.known_from == "identity only"
    assert (lost.uuid, lost.pci_bus_id) == (state.read()["gpus"][0]["uuid"], "0000:07:00.0")
    again = nvml.inventory.read()
    whole = again.gpus[0]
    assert len(again.readable) == 8 and whole.known_from == "nvml"
    assert (lost.uuid, lost.product, lost.minor_number) == (whole.uuid, whole.product, whole.minor_number)
    assert state.read()["faults"] == []


def test_describe_without_call_is_the_message() -> None:
    assert describe(ValueError("plain")) == "plain"


def test_xid_event_names_the_gpu(machine: Any) -> None:
    state, nvml = machine("dgx-h100")
    uuids = [gpu.uuid for gpu in nvml.inventory.read().gpus]
    wait = nvml.events.watch_xids()
    with state.edit() as doc:
        doc["xids"].append({"seq": doc["next_seq"], "gpu": 2, "xid": 79, "at": 0.0})
        doc["next_seq"] += 1
    event = wait(2000)
    assert event is not None
    assert event.gpu_uuid == uuids[2]
    assert event.xid == 79
    assert wait(100) is None  # consumed once


def test_xid_wait_times_out_with_none(machine: Any) -> None:
    state, nvml = machine("dgx-h100")
    wait = nvml.events.watch_xids()
    assert wait(200) is None
    assert nvml.session.timeouts == 0  # NVML's own Timeout answer, not a call that hung
    with state.edit() as doc:
        doc["xids"].append({"seq": doc["next_seq"], "gpu": 1, "xid": 48, "at": 0.0})
        doc["next_seq"] += 1
    event = wait(2000)
    assert event is not None and event.xid == 48  # the wait that timed out left the event set usable


def write_machine(tmp_path: Path, gpus: str) -> str:
    path = tmp_path / "machine.yaml"
    path.write_text("name: lab\ngpus:\n" + gpus)
    return str(path)


def test_custom_machine_with_mig_devices(machine: Any, tmp_path: Path) -> None:
    spec = write_machine(tmp_path, "  - model: H100-80GB-HBM3\n    mig:\n      enabled: true\n"
                                   "      devices: [3g.40gb, 3g.40gb]\n")
    _, nvml = machine(spec)
    (gpu,) = nvml.inventory.read().gpus
    assert gpu.mig.enabled and gpu.mig.pending_enabled
    devices = gpu.mig.devices
    assert [d.placement for d in devices] == [(0, 4), (4, 4)]
    assert [d.profile for d in devices] == ["3g.40gb", "3g.40gb"]
    assert len({d.uuid for d in devices}) == 2
    assert all(d.uuid.startswith("MIG-") for d in devices)
    assert len({d.gpu_instance_id for d in devices}) == 2


def test_custom_machine_unknown_model(tmp_path: Path) -> None:
    spec = write_machine(tmp_path, "  - model: B200\n")
    with pytest.raises(AgentError) as info:
        MachineState(Root(tmp_path / "root")).ensure(spec)
    assert spec in str(info.value)
    assert "gpus.0.model" in str(info.value) and "B200" in str(info.value)


def test_custom_machine_unknown_key(tmp_path: Path) -> None:
    spec = write_machine(tmp_path, "  - model: H100-80GB-HBM3\n    colour: green\n")
    with pytest.raises(AgentError) as info:
        MachineState(Root(tmp_path / "root")).ensure(spec)
    assert spec in str(info.value)
    assert "gpus.0.colour: unknown key" in str(info.value)


def test_a_counted_hang_holds_its_calls_until_cleared_and_spares_later_ones(machine: Any) -> None:
    state, nvml = machine("dgx-h100", call_timeout=0.3)
    nvml.inventory.read()
    add_fault(state, "nvmlDeviceGetTemperature", "hang", times=1)
    with pytest.raises(NvmlHung):
        nvml.sampling.sample(0)
    assert [f["times"] for f in state.read()["faults"]] == [0]  # spent, but still holding its call
    with state.edit() as doc:
        doc["faults"].clear()
    deadline = time.monotonic() + 3.0
    while True:
        try:
            assert nvml.sampling.sample(0).temperature_c is not None
            break
        except NvmlHung:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_memory_v2_reports_the_reserved_memory_apart_from_used(machine: Any) -> None:
    """An idle H100 with driver 580: NVML v1 says 480 MiB used, v2 says 0 used and 480 reserved
    (tests/data/captures/h100-580-vm-raw/nvml-readonly-dump.json, memory_v2)."""
    _, nvml = machine("dgx-h100")
    sample = nvml.sampling.sample(0)
    assert (sample.memory_used_mib, sample.memory_reserved_mib) == (0, 480)
    assert sample.memory_free_mib == 81559 - 480


class _WithoutMemoryV2:
    """A driver older than NVML's v2 memory info: pynvml finds no nvmlDeviceGetMemoryInfo_v2."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        if version:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._lib.nvmlDeviceGetMemoryInfo(handle)


def test_memory_falls_back_to_v1_without_a_reserved_figure(machine: Any) -> None:
    state, _ = machine("dgx-h100")
    nvml = Nvml(_WithoutMemoryV2(FakeNvml(state)), call_timeout=2.0)
    try:
        sample = nvml.sampling.sample(0)
    finally:
        nvml.close()
    assert (sample.memory_used_mib, sample.memory_reserved_mib) == (480, None)


def test_a_gpus_identity_is_read_once_until_its_mig_mode_changes(machine: Any) -> None:
    """UUID, bus id, name, compute capability and minor cannot change while NVML is initialised, except
    where a MIG mode change rebinds the GPU (NVML's nvmlDeviceSetMigMode: "attributes ... such as minor
    number, might change"): a pass asks only for what can change."""
    state, nvml = machine("dgx-h100")
    identity_calls = ("nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName",
                      "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMinorNumber")
    first = nvml.inventory.read()
    calls = nvml.lib.calls
    asked = {name: calls[name] for name in identity_calls}
    assert all(count >= 8 for count in asked.values())
    nvml.inventory.begin_pass()
    assert nvml.inventory.read() == first
    assert {name: calls[name] for name in identity_calls} == asked

    with state.edit() as doc:  # another tool turns MIG on for GPU 2
        doc["gpus"][2]["mig"]["current"] = doc["gpus"][2]["mig"]["pending"] = 1
    nvml.inventory.begin_pass()
    changed = nvml.inventory.read()
    assert changed.gpus[2].mig.enabled and changed.gpus[2].uuid == first.gpus[2].uuid
    assert {name: calls[name] - asked[name] for name in identity_calls} == dict.fromkeys(identity_calls, 1)


def _waiting(nvml: Nvml, timeout_ms: int) -> tuple[Any, list[Any]]:
    """An XID event wait of `timeout_ms` running on its own thread, as the XID watcher's; what it ended with."""
    import threading

    wait = nvml.events.watch_xids()
    ended: list[Any] = []

    def run() -> None:
        try:
            ended.append(wait(timeout_ms))
        except AgentError as exc:
            ended.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while not nvml.session._waits and time.monotonic() < deadline:  # the wait is in flight
        time.sleep(0.005)
    return thread, ended


def test_pausing_nvml_waits_for_an_event_wait_in_flight_rather_than_calling_the_driver_hung(machine: Any) -> None:
    """A real driver (an H200, 580.159.04) holds nvmlShutdown until a concurrent nvmlEventSetWait returns:
    pausing NVML for a driver reload must not take that for a hung driver (which left NVML refusing
    calls while the reload went on to unload the module this process still held)."""
    state, nvml = machine("dgx-h100", call_timeout=0.2)
    nvml.inventory.read()
    thread, ended = _waiting(nvml, 600)
    nvml.session.pause("the driver is being reloaded")
    assert nvml.session.timeouts == 0 and nvml.lib._init_count == 0  # shut down: the module is not held
    with pytest.raises(NvmlUnavailable, match="the driver is being reloaded"):
        nvml.events.watch_xids()  # nothing new starts while NVML is let go
    thread.join()
    assert ended == [None]  # the wait ended at its timeout
    nvml.session.resume()
    assert len(nvml.inventory.read().gpus) == 8


def test_closing_with_an_event_wait_in_flight_leaves_nvml_to_the_process_exit(machine: Any) -> None:
    """The agent's stop (2 s for everything) does not sit behind the XID watcher's wait, nor say NVML hung."""
    state, nvml = machine("dgx-h100", call_timeout=0.2)
    nvml.inventory.read()
    thread, ended = _waiting(nvml, 800)
    nvml.close()
    assert not ended and nvml.lib._init_count == 1 and nvml.session.timeouts == 0
    with pytest.raises(NvmlUnavailable, match="NVML is closed"):
        nvml.inventory.read()
    thread.join()


def test_what_was_allocated_is_let_go_quietly_while_nvml_is_paused(machine: Any) -> None:
    """nvmlShutdown released a GPM sample and an event set already; freeing one while NVML is let go (a
    sample's GPU dropped just after a reload's pause began) must not raise out of the sampler as a bug."""
    state, nvml = machine("dgx-h100")
    nvml.inventory.read()
    sample, xids = nvml.gpm.alloc(), nvml.events.watch_xids()
    nvml.session.pause("the driver is being reloaded")
    nvml.gpm.free(sample)
    xids.free()
    with pytest.raises(NvmlUnavailable, match="the driver is being reloaded"):
        nvml.gpm.alloc()
    nvml.session.resume()
