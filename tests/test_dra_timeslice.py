"""A DRA claim's TimeSlicing interval on its GPUs (gpu_agent/dra/timeslice.py): set as NVIDIA's gpu-kubelet-plugin
sets it (compute mode DEFAULT, then `nvidia-smi compute-policy -i <uuid> --set-timeslice <n>`: sharing.go and
nvlib.go of kubernetes-sigs/dra-driver-nvidia-gpu at 95932046), recorded first, put back after, across reboots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest

from gpu_agent.dra import timeslice
from gpu_agent.dra.claims import PreparedClaim, PreparedDevice, timeslice_levels
from gpu_agent.dra.params import Sharing
from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.ledger import PATH, Ledger, LedgerError, TimeSlice
from gpu_agent.host.paths import Root
from gpu_agent.plan import SetComputeMode, SetTimeSlice
from gpu_agent.sim.timeslice import SimTimeSlices
from harness import SimNode
from test_mps import SimDgx

class Gpus:
    """NVML's compute modes and nvidia-smi's time-slices, by GPU UUID, each change in `calls`; `fail`: the
    error every change raises."""

    def __init__(self, modes: Optional[dict[str, str]] = None) -> None:
        self.modes = dict(modes or {})
        self.calls: list[tuple[str, str, Any]] = []
        self.fail: Optional[str] = None

    def compute_mode(self, uuid: str) -> str:
        return self.modes.get(uuid, "DEFAULT")

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        self._change("mode", uuid, mode)
        self.modes[uuid] = mode

    def set_timeslice(self, uuid: str, level: int) -> None:
        self._change("timeslice", uuid, level)

    def _change(self, what: str, uuid: str, value: Any) -> None:
        if self.fail:
            raise AgentError(self.fail)
        self.calls.append((what, uuid, value))


A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(Root(tmp_path))


def test_the_levels_of_a_claim_are_those_of_its_whole_gpus_shared_by_time_slicing() -> None:
    claim = PreparedClaim("default", "c", (
        PreparedDevice(("a",), "node", "gpu-0", (f"nvidia.com/gpu={A}",), Sharing("TimeSlicing", "Long")),
        PreparedDevice(("a",), "node", "gpu-1", (f"nvidia.com/gpu={B}",), Sharing("TimeSlicing", "Default")),
        PreparedDevice(("a",), "node", "gpu-1-mig-1g.10gb-19-0", ("nvidia.com/gpu=MIG-x",), Sharing("TimeSlicing")),
        PreparedDevice(("a",), "node", "gpu-2", ("nvidia.com/gpu=GPU-c",), None)))
    assert timeslice_levels(claim) == {A: 3, B: 0}  # Long is nvidia-smi's 3, Default its 0; MIG and whole: none


def test_a_claim_sets_the_mode_then_the_time_slice_once_and_puts_both_back(ledger: Ledger) -> None:
    gpus = Gpus({A: "PROHIBITED"})
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-1", {A: 2, B: 1})
    assert gpus.calls == [("mode", A, "DEFAULT"), ("timeslice", A, 2), ("timeslice", B, 1)]
    assert ledger.timeslices() == {A: TimeSlice("uid-1", 2, "boot-1", "PROHIBITED", applied=True),
                                   B: TimeSlice("uid-1", 1, "boot-1", None, applied=True)}
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-1", {A: 2, B: 1})
    assert len(gpus.calls) == 3  # prepared again in the same boot: nothing to change
    assert timeslice.put_back(ledger, gpus, gpus, "boot-1", {"uid-1"}) == [] and len(gpus.calls) == 3  # still held
    assert timeslice.put_back(ledger, gpus, gpus, "boot-1", set()) == []
    assert gpus.calls[3:] == [("timeslice", A, 0), ("mode", A, "PROHIBITED"), ("timeslice", B, 0)]
    assert ledger.timeslices() == {}


def test_default_on_a_gpu_in_default_mode_changes_and_records_nothing(ledger: Ledger) -> None:
    gpus = Gpus()
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-1", {A: 0})
    assert gpus.calls == [] and ledger.timeslices() == {}


def test_a_reboot_is_read_from_the_record_the_claim_is_applied_again_and_nothing_stale_is_put_back(
        ledger: Ledger) -> None:
    gpus = Gpus({A: "PROHIBITED"})
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-1", {A: 3})
    gpus.modes = {}  # the reboot: DEFAULT and the driver's time-slice again
    timeslice.apply(ledger, gpus, gpus, "boot-2", "uid-1", {A: 3})  # the kubelet prepares the claim again
    assert gpus.calls[2:] == [("timeslice", A, 3)]
    assert ledger.timeslices() == {A: TimeSlice("uid-1", 3, "boot-2", None, True)}  # PROHIBITED went with the boot
    timeslice.put_back(ledger, gpus, gpus, "boot-3", set())  # another reboot, then the claim is unprepared
    assert gpus.calls[3:] == [] and ledger.timeslices() == {}


def test_what_cannot_be_put_back_stays_recorded_and_is_named(ledger: Ledger) -> None:
    gpus = Gpus()
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-1", {A: 1})
    gpus.fail = "nvidia-smi compute-policy -i GPU-aaaaaaaa: No devices were found"
    assert timeslice.put_back(ledger, gpus, gpus, "boot-1", set()) == [
        f"cannot put GPU {A}'s time-slice and compute mode back (set for DRA claim uid-1): nvidia-smi "
        "compute-policy -i GPU-aaaaaaaa: No devices were found"]
    assert A in ledger.timeslices()
    gpus.fail = None
    assert timeslice.put_back(ledger, gpus, gpus, "boot-1", set()) == [] and ledger.timeslices() == {}
    gpus.fail = "Insufficient Permissions"
    with pytest.raises(AgentError, match=f"cannot give GPU {A} the time-slice asked for: Insufficient Permissions"):
        timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-2", {A: 2})
    assert ledger.timeslices() == {A: TimeSlice("uid-2", 2, "boot-1", None)}  # recorded before, not applied
    gpus.fail = None
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-2", {A: 2})  # the kubelet asks again: set this time
    assert gpus.calls[-1] == ("timeslice", A, 2) and ledger.timeslices()[A].applied


def test_a_gpu_whose_mode_an_mps_daemon_holds_is_refused_until_it_stops_and_never_put_back_under_one(
        ledger: Ledger) -> None:
    gpus = Gpus({A: "EXCLUSIVE_PROCESS"})
    ledger.save_compute_mode(A, "DEFAULT", "k8s.gpu.nvidia.com/claim/uid-mps")  # its daemon stops, not yet gone
    with pytest.raises(AgentError, match="its compute mode is the MPS control daemon's of "
                                         "k8s.gpu.nvidia.com/claim/uid-mps until that daemon stops"):
        timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-ts", {A: 1})
    assert gpus.calls == [] and ledger.timeslices() == {}
    ledger.clear_compute_mode(A)
    gpus.modes = {A: "PROHIBITED"}
    timeslice.apply(ledger, gpus, gpus, "boot-1", "uid-ts", {A: 1})
    ledger.save_compute_mode(A, "DEFAULT", "nvidia.com/gpu")  # a daemon took the GPU since (a failed put back)
    assert timeslice.put_back(ledger, gpus, gpus, "boot-1", set()) == []
    assert gpus.calls[-1] == ("timeslice", A, 0) and gpus.modes[A] == "DEFAULT"  # its mode left to the daemon


def test_a_malformed_record_is_named_by_its_section(tmp_path: Path, ledger: Ledger) -> None:
    path = tmp_path / PATH.lstrip("/")
    path.parent.mkdir(parents=True)
    good = {"claim": "u", "level": 1, "boot": "b", "mode_before": None, "applied": True}
    for key, entry in ((A, {**good, "level": 9}), ("0", good), (A, {**good, "applied": "yes"})):
        path.write_text(json.dumps({"version": 1, "timeslices": {key: entry}}))
        with pytest.raises(LedgerError, match="timeslices: expected an object of GPU UUIDs.*a level 0 to 3"):
            ledger.timeslices()


def test_nvidia_smi_is_asked_as_nvidias_plugin_asks_it_and_only_on_the_running_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AgentError, match=f"GPU {A}: its time-slice is not set while --root is {tmp_path}"):
        timeslice.NvidiaSmiTimeSlices(Root(tmp_path)).set_timeslice(A, 1)
    asked: list[tuple[str, ...]] = []

    def run(argv: list[str], timeout: float) -> proc.Completed:
        asked.append(tuple(argv))
        return proc.Completed(tuple(argv), 3, "", "Unable to set the time-slice: Not Supported\n")

    monkeypatch.setattr(proc, "run", run)
    with pytest.raises(AgentError, match="failed: Unable to set the time-slice: Not Supported$"):
        timeslice.NvidiaSmiTimeSlices(Root(Path("/"))).set_timeslice(A, 1)
    assert asked == [("nvidia-smi", "compute-policy", "-i", A, "--set-timeslice", "1")]


def test_uninstall_puts_back_what_claims_never_unprepared_left_on_the_simulated_gpus(tmp_path: Path) -> None:
    dgx = SimDgx.make(tmp_path)
    with dgx.machine.edit() as state:
        state["gpus"][1]["compute_mode"] = 2  # PROHIBITED, as an admin left it
    uuids = [gpu.uuid for gpu in dgx.inventory.gpus]
    ledger = Ledger(dgx.root)
    boot = timeslice.boot_id(dgx.root.with_kernel(dgx.machine.kernel_dir))
    timeslice.apply(ledger, dgx.nvml.inventory, SimTimeSlices(dgx.machine), boot, "uid-1", {uuids[0]: 3, uuids[1]: 1})
    assert [gpu.get("timeslice") for gpu in dgx.machine.read()["gpus"][:3]] == [3, 1, None]
    assert dgx.compute_modes()[:2] == [0, 0]
    node = SimNode(dgx.root.path, "dgx-h100")
    planned = node.uninstall(dry_run=True).changes("owned-files")
    assert len(planned) == 3 and set(planned) == {
        SetTimeSlice(uuids[0], 0), SetTimeSlice(uuids[1], 0), SetComputeMode(uuids[1], "PROHIBITED")}
    assert ledger.timeslices()  # a dry run: nothing
    done = node.uninstall()
    assert done.stage("owned-files").state == "ok", done.stage("owned-files").message
    assert [gpu.get("timeslice") for gpu in dgx.machine.read()["gpus"]] == [None] * 8
    assert dgx.compute_modes() == [0, 2] + [0] * 6 and ledger.timeslices() == {}
    assert node.uninstall().changes("owned-files") == []
    dgx.nvml.close()
