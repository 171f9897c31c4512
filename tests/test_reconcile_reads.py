"""What a reconcile pass reads, on a long-lived agent (as the daemon keeps one): the MIG geometry once per
pass on a converged node of two H100s with 7 MIG devices per GPU (what is read scales with the GPUs), and
never a reading older than the pass (another tool's change between passes is seen by the next) nor older
than the agent's own MIG change (seen by the stages after the mig stage in the same pass)."""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.daemon.engine import StageRun
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Inventory
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.machine import MachineState

SHIPPED = Path(__file__).resolve().parent.parent / "packaging" / "mig.yaml"
GPUS, DEVICES_PER_GPU = 2, 7
MACHINE = "name: two-h100\ngpus:\n" + "  - model: H100-80GB-HBM3\n" * GPUS
MIG_DEVICES = GPUS * DEVICES_PER_GPU
# What one inventory costs: per MIG device its handle and UUID (its GPU and compute instance ids only when
# the UUID is new), and per GPU instance its info, its compute instances and their info (a 1g GPU instance
# has one compute instance); per GPU a dozen calls (handle, UUID, PCI, memory, MIG mode, device count, one
# profile's GPU instances). A second reading in the same pass would double it.
ONE_READING = 5 * MIG_DEVICES + 12 * GPUS
OTHER_STAGES = 40  # the driver stage's persistence modes and bus ids, and the like


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    root = tmp_path / "root"
    (root / "etc/gpu-agent").mkdir(parents=True)
    shutil.copy(SHIPPED, root / "etc/gpu-agent/mig.yaml")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"version": "v1", "mig": {"config": "all-1g.10gb"}}))
    machine = tmp_path / "machine.yaml"
    machine.write_text(MACHINE)
    built = Runtime.build(Root(root), load_config(config, required=True), str(machine))
    yield built
    built.nvml.close()


def reconcile(runtime: Runtime, force: bool = True) -> list[StageRun]:
    return asyncio.run(runtime.engine.reconcile(force=force))


def devices(inventory: Inventory, gpu: int) -> int:
    return len(inventory.gpus[gpu].mig.devices)


def another_tool(runtime: Runtime) -> Nvml:
    """NVML as another process on the node sees it (nvidia-smi, mig-parted)."""
    assert runtime.machine is not None
    nvml = Nvml(FakeNvml(MachineState(runtime.root)))
    nvml.session.init()
    return nvml


def test_a_no_op_pass_reads_the_mig_geometry_once(runtime: Runtime) -> None:
    first = reconcile(runtime)
    assert all(run.state == "ok" for run in first), [(run.stage, run.message) for run in first]
    assert devices(runtime.state.inventory, 0) == DEVICES_PER_GPU
    # The driver stage, before the mig stage in a pass, makes the new instances' /dev/nvidia-caps nodes in the next
    # one (as nvidia-modprobe -f would for a process opening them); then nothing changes.
    settled = reconcile(runtime)
    assert [run.stage for run in settled if run.applied] == ["driver"], [(r.stage, r.message) for r in settled]
    calls = runtime.nvml.lib.calls
    calls.clear()
    runs = reconcile(runtime)
    assert not any(run.applied for run in runs), [(run.stage, run.message) for run in runs if run.applied]
    assert calls["nvmlDeviceGetMigDeviceHandleByIndex"] == MIG_DEVICES  # one reading: the mig stage's, reused
    assert calls["nvmlDeviceGetComputeInstanceId"] == 0  # the devices' UUIDs are those of the last reading
    assert calls["nvmlDeviceGetGpuInstances"] == GPUS  # 7 GPU instances fill each GPU: no other profile asked
    assert sum(calls.values()) <= ONE_READING + OTHER_STAGES, calls.most_common(12)


def test_another_tools_change_between_passes_is_seen_even_while_the_mig_stage_waits(runtime: Runtime) -> None:
    reconcile(runtime)
    other = another_tool(runtime)
    try:
        gi = runtime.state.inventory.gpus[1].mig.gpu_instances[0]
        other.mig.destroy_compute_instance(1, gi.id, gi.compute_instances[0].id)
        other.mig.destroy_gpu_instance(1, gi.id)
    finally:
        other.close()
    runtime.state.stages["mig"].next_retry = time.time() + 3600  # backing off: this pass skips it
    runs = reconcile(runtime, force=False)
    assert next(run for run in runs if run.stage == "mig").skipped
    assert devices(runtime.state.inventory, 1) == DEVICES_PER_GPU - 1  # discovery read the GPUs again
    runs = reconcile(runtime)  # the mig stage puts the instance back; discovery sees it in the same pass
    assert any(run.applied for run in runs if run.stage == "mig")
    assert devices(runtime.state.inventory, 1) == DEVICES_PER_GPU


def test_the_pass_reading_is_kept_until_a_mig_change_and_only_within_passes(runtime: Runtime) -> None:
    reconcile(runtime)
    nvml = runtime.nvml
    outside = another_tool(runtime)  # never told of a pass: a one-shot command
    try:
        assert outside.inventory.pass_reading() is not outside.inventory.pass_reading()
    finally:
        outside.close()
    nvml.inventory.begin_pass()
    reading = nvml.inventory.read()
    assert nvml.inventory.pass_reading() is reading
    gi = reading.gpus[1].mig.gpu_instances[-1]
    nvml.mig.destroy_compute_instance(1, gi.id, gi.compute_instances[0].id)
    after = nvml.inventory.pass_reading()
    assert after is not reading and len(after.gpus[1].mig.gpu_instances[-1].compute_instances) == 0
    nvml.inventory.begin_pass()
    assert nvml.inventory.pass_reading() is not after
