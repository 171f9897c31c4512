"""The vfio stage on a simulated dgx-h100: GPUs 4-7 passed through to vfio-pci in one pass, back byte for byte by
uninstall or by their mode going back to container, refused while a process holds one or without an IOMMU, and a
switch cut by kill -9 at any of its writes finished by the next agent, never leaving a GPU without a driver."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from harness import run_cli

from gpu_agent.host.paths import Root
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.pci import gpu_driver

PASSED = ("0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0")  # dgx-h100's GPUs 4-7
VM_CONFIG = 'version: v1\nworkload:\n  gpus: {"4": vm-passthrough, "5": vm-passthrough, "6": vm-passthrough, ' \
            '"7": vm-passthrough}\n'
CONTAINER_CONFIG = "version: v1\n"


def _configure(root: Path, text: str) -> None:
    path = root / "etc/gpu-agent/config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _drivers(root: Path) -> list[Optional[str]]:
    state = MachineState(Root(root)).read()
    return [gpu_driver(state, gpu) for gpu in state["gpus"]]


def _bindings(root: Path) -> dict[str, str]:
    """Every GPU's and the drivers' PCI entries in the simulated sysfs: file contents and link texts."""
    sys_dir = root / "var/lib/gpu-agent/sim/kernel/sys/bus/pci"
    found = {}
    for base in [*(sys_dir / "devices").iterdir(), sys_dir / "drivers/nvidia"]:
        for path in sorted(base.rglob("*")) if base.is_dir() else ():
            found[str(path.relative_to(sys_dir))] = ("-> " + os.readlink(path)) if path.is_symlink() else \
                path.read_text(errors="replace") if path.is_file() else "dir"
    return found


@pytest.fixture
def h100(root: Path) -> Path:
    _configure(root, CONTAINER_CONFIG)
    assert run_cli("--simulate", "dgx-h100", "apply", "--once", root=root).returncode == 0
    return root


def test_one_pass_passes_gpus_4_to_7_through_and_uninstall_puts_back_every_byte(h100: Path) -> None:
    root = h100
    before = _bindings(root)
    _configure(root, VM_CONFIG)
    done = run_cli("apply", "--once", "--json", root=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _drivers(root) == ["nvidia"] * 4 + ["vfio-pci"] * 4
    groups = json.loads(run_cli("sim", "show", "--json", root=root).stdout)["gpus"]
    nodes = sorted(os.listdir(root / "var/lib/gpu-agent/sim/kernel/dev/vfio"))
    assert nodes == sorted(["vfio", *(str(gpu["iommu_group"]) for gpu in groups[4:])])
    stages = {run["stage"]: run for run in json.loads(done.stdout)["stages"]}
    kinds = [change["kind"] for change in stages["vfio"]["changes"]]
    assert kinds[:2] == ["VfioStep", "LoadModule"]
    assert kinds.count("UnbindPciFunction") == 4 and kinds.count("BindPciFunction") == 4
    checked = {run["stage"]: run for run in json.loads(run_cli("check", "--json", root=root).stdout)["stages"]}
    assert checked["discovery"]["message"].startswith("4x H100")  # GPUs 4-7 are outside NVML
    assert "nvidia.com/GH100_H100_SXM5_80GB: 4" in checked["vfio"]["message"]
    again = run_cli("apply", "--once", "--json", root=root)  # converged: nothing planned
    assert {run["stage"]: run for run in json.loads(again.stdout)["stages"]}["vfio"]["changes"] == []

    assert run_cli("uninstall", root=root).returncode == 0
    assert _drivers(root) == ["nvidia"] * 8
    assert _bindings(root) == before


def test_switching_back_to_container_restores_the_bindings(h100: Path) -> None:
    root = h100
    before = _bindings(root)
    _configure(root, VM_CONFIG)
    assert run_cli("apply", "--once", root=root).returncode == 0
    _configure(root, CONTAINER_CONFIG)
    assert run_cli("apply", "--once", root=root).returncode == 0
    assert _drivers(root) == ["nvidia"] * 8 and _bindings(root) == before
    assert "vfio" not in json.loads((root / "var/lib/gpu-agent/ledger.json").read_text())


def test_a_gpu_with_a_process_is_not_switched_and_status_says_why(h100: Path) -> None:
    root = h100
    assert run_cli("sim", "add-process", "--gpu", "5", "--pid", "4242", "--name", "trainer", root=root).returncode == 0
    _configure(root, VM_CONFIG)
    done = run_cli("apply", "--once", "--json", root=root)
    assert done.returncode != 0
    assert _drivers(root) == ["nvidia"] * 4 + ["vfio-pci", "nvidia", "vfio-pci", "vfio-pci"]
    vfio = {run["stage"]: run for run in json.loads(done.stdout)["stages"]}["vfio"]
    assert "GPU 5 (0000:ab:00.0) not passed through: process 4242 (trainer) has it open" in vfio["message"]


def test_no_iommu_is_a_clear_error_naming_the_kernel_parameters(h100: Path) -> None:
    root = h100
    assert run_cli("sim", "fail", "iommu", root=root).returncode == 0
    _configure(root, VM_CONFIG)
    done = run_cli("apply", "--once", "--json", root=root)
    message = {run["stage"]: run for run in json.loads(done.stdout)["stages"]}["vfio"]["message"]
    assert done.returncode != 0 and "intel_iommu=on" in message and "iommu=pt" in message
    assert _drivers(root) == ["nvidia"] * 8


def test_a_refused_bind_puts_the_gpu_back_on_nvidia(h100: Path) -> None:
    root = h100
    assert run_cli("sim", "fail", "bind", "--gpu", "6", "--times", "1", root=root).returncode == 0
    _configure(root, VM_CONFIG)
    done = run_cli("apply", "--once", "--json", root=root)
    message = {run["stage"]: run for run in json.loads(done.stdout)["stages"]}["vfio"]["message"]
    assert "bind 0000:ba:00.0 to vfio-pci: No such device" in message and "back on its drivers" in message
    assert _drivers(root)[6] == "nvidia"
    assert run_cli("apply", "--once", root=root).returncode == 0  # the fault fired once: the next pass switches it
    assert _drivers(root) == ["nvidia"] * 4 + ["vfio-pci"] * 4


def _apply(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GPU_AGENT_")}
    return subprocess.run([sys.executable, "-m", "gpu_agent", "--root", str(root), "apply", "--once"],
                          env={**environment, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.subprocess
def test_kill_9_in_the_middle_of_a_switch_then_a_restart_finishes_it(h100: Path, tmp_path: Path) -> None:
    root = h100
    _configure(root, VM_CONFIG)
    log = tmp_path / "points"
    assert _apply(root, {"GPU_AGENT_SIM_CRASH_LOG": str(log)}).returncode == 0
    points = log.read_text().splitlines()
    machine_writes = [int(line.split()[0]) for line in points if line.endswith("sim/machine.json")]
    assert run_cli("uninstall", root=root).returncode == 0
    # a few points among the switch's own writes: the first, one in the middle, the last
    for kill_at in sorted({machine_writes[1], machine_writes[len(machine_writes) // 2], machine_writes[-1]}):
        killed = _apply(root, {"GPU_AGENT_SIM_KILL_AT": str(kill_at)})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        state = MachineState(Root(root)).read()
        assert None not in _drivers(root) or any(entry for entry in _ledger_vfio(root).values()), state
        done = run_cli("apply", "--once", root=root)
        assert done.returncode == 0, f"killed at {kill_at}: {done.stdout}"
        assert _drivers(root) == ["nvidia"] * 4 + ["vfio-pci"] * 4
        assert run_cli("uninstall", root=root).returncode == 0
        assert _drivers(root) == ["nvidia"] * 8


def _ledger_vfio(root: Path) -> dict[str, object]:
    path = root / "var/lib/gpu-agent/ledger.json"
    return json.loads(path.read_text()).get("vfio", {}) if path.exists() else {}


def test_status_shows_each_gpus_mode_and_binding(tmp_path: Path) -> None:
    """/status's GPU entries: GPUs 0-3 in container mode on nvidia, 4 and 6-7 passed through on vfio-pci (outside
    NVML: no NVML index, their PCI place and IOMMU group), 5 wanted for a VM but held by a process: on nvidia, and
    why; `gpu-agent status` prints the mode and driver of each."""
    from harness import SimNode

    from gpu_agent.cli.status import print_table

    node = SimNode(tmp_path / "root", "dgx-h100")
    node.apply({"toolkit": {"enabled": False}})
    node.sim("add-process", "--gpu", "5", "--pid", "4242", "--name", "trainer")
    done = node.apply({"toolkit": {"enabled": False}, "workload": {"gpus": dict.fromkeys("4567", "vm-passthrough")}})
    gpus = done.state.to_json()["gpus"]
    shown = {gpu["pci_bus_id"].lower()[-12:]: gpu for gpu in gpus}
    groups = {gpu["pci_bus_id"].lower()[-12:]: str(gpu["iommu_group"]) for gpu in json.loads(
        run_cli("sim", "show", "--json", root=node.root).stdout)["gpus"]}
    assert len(gpus) == 8 and [gpu["index"] for gpu in gpus] == [0, 1, 2, 3, 4, None, None, None]
    for address, gpu in shown.items():
        passed = address in (PASSED[0], *PASSED[2:])
        assert gpu["mode"] == ("vm-passthrough" if address in PASSED else "container"), gpu
        assert gpu["binding"]["driver"] == ("vfio-pci" if passed else "nvidia"), gpu
        assert gpu["binding"]["iommu_group"] == groups[address], gpu
    assert shown[PASSED[1]]["binding"]["reason"] == "process 4242 (trainer) has it open"
    assert shown[PASSED[1]]["index"] == 4 and shown[PASSED[1]]["health"] == "healthy"  # NVML's 4th now
    assert [shown[a]["pci_index"] for a in (PASSED[0], *PASSED[2:])] == [4, 6, 7]
    assert all(shown[a]["known_from"] == "vfio" and shown[a]["health"] == "n/a" for a in (PASSED[0], *PASSED[2:]))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_table(done.state.to_json())
    lines = printed.getvalue().splitlines()
    assert any(PASSED[0] in line and "vm-passthrough" in line and "vfio-pci" in line for line in lines), lines
    assert any(PASSED[1] in line and "vm-passthrough" in line and " nvidia " in line for line in lines), lines
    assert f"GPU {PASSED[1]} not as its mode (vm-passthrough) wants it: process 4242 (trainer) has it open" in lines


def test_without_the_vfio_stage_every_gpu_serves_containers_on_nvidia(tmp_path: Path) -> None:
    from harness import SimNode

    gpus = SimNode(tmp_path / "root", "dgx-h100").apply({"toolkit": {"enabled": False}}).state.to_json()["gpus"]
    assert [(gpu["mode"], gpu["binding"]["driver"]) for gpu in gpus] == [("container", "nvidia")] * 8


GFD_KEYS = ("gpu.product", "gpu.count", "gpu.memory", "gpu.family", "gpu.compute.major", "gpu.machine", "gpu.mode",
            "gpu.replicas", "gpu.sharing-strategy", "mig.capable", "mps.capable", "cuda.driver-version.full",
            "vgpu.present")


def _labels(done: Any) -> dict[str, str]:
    from gpu_agent.kube.labels import node_labels

    state = done.state
    return node_labels(state.config.config, state.inventory, True, "DGX H100", state.workload)


def test_labels_of_a_mixed_node_and_of_a_node_whose_every_gpu_is_passed_through(tmp_path: Path) -> None:
    """GFD's labels describe the GPUs NVML sees (those serving containers); with none left they go, and the node
    keeps gpu.present=true (as the GPU Operator keeps it in vm-passthrough) and the agent's gpu-agent.workload. The
    agent never writes the Operator's gpu.workload.config (its input) or gpu.deploy.* labels; the driver and
    discovery stages are ok with every GPU passed through."""
    from harness import SimNode

    node = SimNode(tmp_path / "root", "dgx-h100")
    base = {"toolkit": {"enabled": False}}
    plain = _labels(node.apply(base))
    assert "nvidia.com/gpu-agent.workload" not in plain and plain["nvidia.com/gpu.count"] == "8"

    mixed = _labels(node.apply({**base, "workload": {"gpus": dict.fromkeys("4567", "vm-passthrough")}}))
    assert mixed["nvidia.com/gpu-agent.workload"] == "mixed"
    assert mixed["nvidia.com/gpu.count"] == "4" and mixed["nvidia.com/gpu.product"] == plain["nvidia.com/gpu.product"]
    assert mixed["nvidia.com/gpu.present"] == "true"

    whole = node.apply({**base, "workload": {"mode": "vm-passthrough"}})
    assert _drivers(node.root) == ["vfio-pci"] * 8
    assert {run.stage: run.state for run in whole.runs if run.stage in ("driver", "vfio", "discovery")} == {
        "driver": "ok", "vfio": "ok", "discovery": "ok"}, [(run.stage, run.message) for run in whole.runs]
    labels = _labels(whole)
    assert labels["nvidia.com/gpu-agent.workload"] == "vm-passthrough" and labels["nvidia.com/gpu.present"] == "true"
    assert not [key for key in GFD_KEYS if "nvidia.com/" + key in labels], labels
    for written in (plain, mixed, labels):
        assert "nvidia.com/gpu.workload.config" not in written
        assert not [key for key in written if key.startswith("nvidia.com/gpu.deploy.")]


def test_an_nvswitch_board_split_between_host_and_vms_is_passed_through_with_a_warning(tmp_path: Path) -> None:
    """dgx-h100's GPUs 4-7 are passed through (the acceptance case: vfio-manage binds single GPUs too), and the
    stage says what is given up: their NVLinks, whose NVSwitches and Fabric Manager stay with the host. Every GPU
    passed through: the NVSwitches still stay (as vfio-manage without BIND_NVSWITCHES). No NVSwitch: no warning."""
    from harness import SimNode

    node = SimNode(tmp_path / "root", "dgx-h100")
    base: dict[str, Any] = {"toolkit": {"enabled": False}}
    node.apply(base)
    split = node.apply({**base, "workload": {"gpus": dict.fromkeys("4567", "vm-passthrough")}}).stage("vfio")
    assert split.state == "ok" and _drivers(node.root)[4:] == ["vfio-pci"] * 4
    assert "warning: GPUs 4, 5, 6, 7 are passed through from an NVSwitch board (4 NVSwitches)" in split.message
    assert "Fabric Manager" in split.facts["fabric_warning"] and split.facts["nvswitches"] == 4
    devices = node.root / "var/lib/gpu-agent/sim/kernel/sys/bus/pci/devices"
    for bus in ("05", "06", "07", "08"):  # dgx-h100's NVSwitches are never the agent's to bind
        link = devices / f"0000:{bus}:00.0" / "driver"
        assert (devices / f"0000:{bus}:00.0").is_dir()
        assert not link.is_symlink() or os.path.basename(os.readlink(link)) != "vfio-pci"
    whole = node.apply({**base, "workload": {"mode": "vm-passthrough"}}).stage("vfio")
    assert "warning: every GPU is passed through, the 4 NVSwitches stay with the host" in whole.message

    single = SimNode(tmp_path / "a30", "a30")
    single.apply(base)
    alone = single.apply({**base, "workload": {"mode": "vm-passthrough"}}).stage("vfio")
    assert alone.state == "ok" and "warning" not in alone.message and alone.facts["fabric_warning"] is None
