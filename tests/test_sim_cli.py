"""gpu-agent sim: the commands that rehearse failures, and their errors."""
from __future__ import annotations

import json
from pathlib import Path

from harness import run_cli

# The sim subcommands as a user runs them, in this process: their output and exit codes.


def test_sim_commands_change_the_shared_machine(root: Path) -> None:
    assert run_cli("--simulate", "dgx-a100", "sim", "show", root=root).returncode == 0
    assert run_cli("sim", "fail", "nvmlDeviceGetPowerUsage", "--gpu", "2", "--times", "3", "--error", "GpuIsLost",
               root=root).returncode == 0
    assert run_cli("sim", "add-process", "--gpu", "0", "--pid", "77", "--name", "a-very-long-process-name",
               root=root).returncode == 0
    state = json.loads(run_cli("sim", "show", "--json", root=root).stdout)
    assert state["faults"] == [{"id": 1, "call": "nvmlDeviceGetPowerUsage", "gpu": 2, "times": 3,
                                "error": "GpuIsLost"}]
    assert state["gpus"][0]["processes"] == [{"pid": 77, "name": "a-very-long-process-name", "used_mib": 1024}]
    comm = root / "var/lib/gpu-agent/sim/kernel/proc/77/comm"  # the simulated kernel's /proc
    assert comm.read_text() == "a-very-long-pro\n"  # the kernel keeps 15 characters
    shown = run_cli("sim", "show", root=root).stdout
    assert "fault: nvmlDeviceGetPowerUsage on GPU 2 -> GpuIsLost, 3 more call(s)" in shown

    assert run_cli("sim", "clear", root=root).returncode == 0
    state = json.loads(run_cli("sim", "show", "--json", root=root).stdout)
    assert state["faults"] == [] and state["gpus"][0]["processes"] == []
    assert not comm.exists()


def test_sim_rejects_what_it_cannot_simulate(root: Path) -> None:
    missing = run_cli("sim", "show", root=root)
    assert missing.returncode == 1 and "no simulated machine under" in missing.stderr
    run_cli("--simulate", "t4", "sim", "show", root=root)
    unknown_call = run_cli("sim", "fail", "nvmlDeviceGetFrobnication", root=root)
    assert unknown_call.returncode == 1
    assert "not modprobe nor an NVML call the simulator implements" in unknown_call.stderr
    unknown_error = run_cli("sim", "fail", "nvmlDeviceGetCount", "--error", "Oops", root=root)
    assert unknown_error.returncode == 1 and "--error Oops: unknown" in unknown_error.stderr
    bad_gpu = run_cli("sim", "inject-xid", "--gpu", "1", "--xid", "79", root=root)
    assert bad_gpu.returncode == 1 and "--gpu 1: the simulated machine has 1 GPU(s)" in bad_gpu.stderr
    bad_profile = run_cli("--simulate", "dgx-z900", "sim", "show", root=root)
    assert bad_profile.returncode == 1 and "neither a built-in profile" in bad_profile.stderr


def test_switching_profile_on_a_root_builds_the_new_machine(root: Path) -> None:
    run_cli("--simulate", "dgx-h100", "sim", "show", root=root)
    state = json.loads(run_cli("--simulate", "a30", "sim", "show", "--json", root=root).stdout)
    assert state["machine"] == "a30" and len(state["gpus"]) == 1


def test_xid_79_takes_the_gpu_off_the_bus_until_sim_clear_or_reboot(root: Path) -> None:
    import pynvml
    import pytest

    from gpu_agent.host.paths import Root
    from gpu_agent.sim.fake import FakeNvml, SimHandle
    from gpu_agent.sim.kernel import SimModprobe
    from gpu_agent.sim.machine import MachineState

    missing = run_cli("sim", "inject-xid", "--gpu", "0", "--xid", "79", root=root)
    assert missing.returncode == 1 and "no simulated machine under" in missing.stderr
    machine = MachineState(Root(root))
    machine.ensure("dgx-h100")
    SimModprobe(machine, Root(root)).load("nvidia")
    nvml = FakeNvml(machine)
    nvml.nvmlInit()
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3))

    assert "GPU 3 has fallen off the bus" in run_cli("sim", "inject-xid", "--gpu", "3", "--xid", "79", root=root).stdout
    assert [line.split()[1] for line in run_cli("sim", "show", root=root).stdout.splitlines()
            if "OFF THE BUS" in line] == ["3"]
    for lost in (lambda: nvml.nvmlDeviceGetHandleByIndex(3), lambda: nvml.nvmlDeviceGetHandleByUUID(uuid),
                 lambda: nvml.nvmlDeviceGetTemperature(SimHandle(3), pynvml.NVML_TEMPERATURE_GPU)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            lost()
    assert nvml.nvmlDeviceGetUUID(SimHandle(3)) == uuid  # what an XID event's handle names: NVML read it before
    assert nvml.nvmlDeviceGetCount() == 8 and nvml.nvmlDeviceGetTemperature(SimHandle(2), 0) > 0
    reloaded = run_cli("sim", "reload-driver", root=root)
    assert "GPU 3 still off the bus" in reloaded.stdout  # a driver reload does not bring it back
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(3)

    cleared = run_cli("sim", "clear", root=root)
    assert "GPU 3 back on the bus" in cleared.stdout
    assert nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(3)).busId == "00000000:5D:00.0"
    run_cli("sim", "inject-xid", "--gpu", "3", "--xid", "79", root=root)
    assert "GPUs back on the bus" in run_cli("sim", "reboot", root=root).stdout
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3)) == uuid
