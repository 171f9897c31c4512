"""`gpu-agent capture` and `--simulate DIR`, and the committed capture of a real node.

tests/data/captures/h100-580-vm/ was built from tests/data/captures/h100-580-vm-raw/ (what one NVIDIA H100
80GB HBM3 passed through to a VM, open kernel module 580.159.04, no modprobe, showed; see its README) by
tests/data/captures/build_h100_580_vm.py. NODE and MIG_PROFILES below are what that node itself showed,
each with the file it came from; two tests check them and the committed capture against those files value
for value. Everything else runs on the committed capture alone.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.cli import build_parser
from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import compute
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.plan import CreateLink
from gpu_agent.capture import MutationRefused, RecordingNvml, capture
from gpu_agent.sim.fake import FakeNvml, SimHandle
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.replay import Capture, ReplayNvml
from gpu_agent.stages.labels import machine_name

HERE = Path(__file__).resolve().parent
CAPTURE = HERE / "data" / "captures" / "h100-580-vm"
NODE_FILES = HERE / "data" / "captures" / "h100-580-vm-raw"

NODE = {
    "uuid": "GPU-b278b05b-1081-df83-4ef3-aab244def6a4",  # nvidia-smi-L.txt, proc-driver-nvidia-gpus-information.txt
    "product": "NVIDIA H100 80GB HBM3",  # nvidia-smi-q.txt Product Name, nvml dump nvmlDeviceGetName
    "pci_bus_id": "0000:00:06.0",  # nvidia-smi-q.txt Bus Id 00000000:00:06.0, sys-bus-pci-nvidia.txt
    "pci_device_id": 0x233010DE,  # nvidia-smi-q.txt Device Id, nvml dump pciDeviceId
    "pci_subsystem_id": 0x16C110DE,  # nvidia-smi-q.txt Sub System Id, nvml dump pciSubSystemId
    "pci_class": "0x030200",  # sys-bus-pci-nvidia.txt class
    "numa_node": "-1",  # sys-bus-pci-nvidia.txt numa (NVML: nvmlDeviceGetNumaNodeId NotSupported)
    "driver_version": "580.159.04",  # nvidia-smi-q.txt Driver Version, proc-driver-nvidia-version.txt
    "cuda_version": "13.0",  # nvidia-smi-q.txt CUDA Version (nvml dump: 13000)
    "compute_capability": "9.0",  # nvml dump nvmlDeviceGetCudaComputeCapability
    "minor": 0,  # nvidia-smi-q.txt Minor Number
    "memory_total_mib": 81559,  # nvidia-smi-q.txt FB Memory Usage Total (nvml dump total 85520809984 B)
    "memory_reserved_mib": 480,  # ... Reserved (nvml dump memory_v2 reserved 503316480 B)
    "memory_used_mib": 0,  # ... Used (v2 used 0; v1 counts the reserved memory as used)
    "memory_free_mib": 81079,  # ... Free
    "persistence": True,  # nvidia-smi-q.txt Persistence Mode Enabled
    "mig_mode": "disabled",  # nvidia-smi-q.txt MIG Mode Current
}
# nvidia-smi-mig-lgip.txt: name, id, instances, GiB, SM, DEC, ENC, CE, JPEG, OFA; memory in MiB from the
# nvml dump's memorySizeMB; nvidia-smi-mig-lgipp.txt: placement starts and size.
MIG_PROFILES = [
    ("1g.10gb", 19, 7, 9984, 16, 1, 0, 1, 1, 0, (0, 1, 2, 3, 4, 5, 6), 1),
    ("1g.10gb+me", 20, 1, 9984, 16, 1, 0, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    ("1g.20gb", 15, 4, 20096, 26, 1, 0, 1, 1, 0, (0, 2, 4, 6), 2),
    ("2g.20gb", 14, 3, 20096, 32, 2, 0, 2, 2, 0, (0, 2, 4), 2),
    ("3g.40gb", 9, 2, 40448, 60, 3, 0, 3, 3, 0, (0, 4), 4),
    ("4g.40gb", 5, 1, 40448, 64, 4, 0, 4, 4, 0, (0,), 4),
    ("7g.80gb", 0, 1, 81152, 132, 7, 0, 8, 7, 1, (0,), 8),
]
DEV_CHAR_LINKS = {  # dev-listing.txt: the device nodes the driver made; the node has no /dev/char links
    "/dev/char/195:0": "/dev/nvidia0", "/dev/char/195:255": "/dev/nvidiactl",
    "/dev/char/238:0": "/dev/nvidia-uvm", "/dev/char/238:1": "/dev/nvidia-uvm-tools",
    "/dev/char/241:1": "/dev/nvidia-caps/nvidia-cap1", "/dev/char/241:2": "/dev/nvidia-caps/nvidia-cap2",
}


def config(tmp_path: Path, text: str = "") -> Any:
    path = tmp_path / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("version: v1\n" + text)
    return load_config(path, required=True)


def replay(tmp_path: Path, directory: Path = CAPTURE, settings: str = "") -> Runtime:
    return Runtime.build(Root(tmp_path / "root"), config(tmp_path, settings), str(directory))


def command(capsys: Any, root: Path, *argv: str) -> tuple[int, str]:
    """`gpu-agent --root ROOT ARGV` in this process: its exit status and what it printed."""
    args = build_parser().parse_args(["--root", str(root), *argv])
    capsys.readouterr()
    code = importlib.import_module(f"gpu_agent.cli.{args.command}").main(args)
    return code, capsys.readouterr().out


def snapshot(directory: Path) -> dict[str, Any]:
    """Every entry under `directory`: file contents, link targets, device numbers, modes and owners."""
    found: dict[str, Any] = {}
    for path in sorted(directory.rglob("*")):
        st = os.lstat(path)
        relative = str(path.relative_to(directory))
        if stat.S_ISLNK(st.st_mode):
            found[relative] = ("link", os.readlink(path))
        elif stat.S_ISCHR(st.st_mode):
            found[relative] = ("char", os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode),
                               st.st_uid, st.st_gid)
        elif stat.S_ISDIR(st.st_mode):
            found[relative] = ("dir", stat.S_IMODE(st.st_mode))
        else:
            found[relative] = ("file", path.read_bytes(), stat.S_IMODE(st.st_mode))
    return found


# --- where the committed capture came from ---------------------------------------------------------


def _builder() -> Any:
    spec = importlib.util.spec_from_file_location("build_h100_580_vm", CAPTURE.parent / "build_h100_580_vm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_capture_is_what_its_script_builds_from_the_node_files(tmp_path: Path) -> None:
    _builder().build(NODE_FILES, tmp_path / "built")
    for name in ("files.json", "links.json", "devices.json", "ldcache.json", "nvml.json", "manifest.json"):
        built = json.loads((tmp_path / "built" / name).read_text())
        committed = json.loads((CAPTURE / name).read_text())
        if name == "manifest.json":
            built.pop("gpu_agent_version"), committed.pop("gpu_agent_version")
        assert built == committed, f"{name} differs: rebuild with tests/data/captures/build_h100_580_vm.py"


def _smi(field: str) -> str:
    match = re.search(rf"^\s*{re.escape(field)}\s+: (.+)$", (NODE_FILES / "nvidia-smi-q.txt").read_text(), re.MULTILINE)
    assert match, field
    return match.group(1).strip()


def _mib(field: str) -> int:
    text = (NODE_FILES / "nvidia-smi-q.txt").read_text()
    section = text[text.index("FB Memory Usage"):text.index("BAR1 Memory Usage")]
    match = re.search(rf"{field}\s+: (\d+) MiB", section)
    assert match, field
    return int(match.group(1))


def _cuda(version: int) -> str:
    """NVML's 13000 as nvidia-smi writes it: 13.0."""
    return f"{version // 1000}.{version % 1000 // 10}"


def test_node_values_are_those_the_node_showed() -> None:
    """NODE and MIG_PROFILES, read again from the node's own nvidia-smi, NVML dump and /proc and /sys files."""
    dump = json.loads((NODE_FILES / "nvml-readonly-dump.json").read_text())
    device = dump["devices"][0]
    assert NODE["uuid"] in (NODE_FILES / "nvidia-smi-L.txt").read_text()
    assert f"GPU UUID: \t {NODE['uuid']}" in (NODE_FILES / "proc-driver-nvidia-gpus-information.txt").read_text()
    assert _smi("Product Name") == device["nvmlDeviceGetName"]["ok"] == NODE["product"]
    assert _smi("Bus Id") == "0000" + NODE["pci_bus_id"].upper()
    assert int(_smi("Device Id"), 16) == device["nvmlDeviceGetPciInfo"]["ok"]["pciDeviceId"] == NODE["pci_device_id"]
    assert int(_smi("Sub System Id"), 16) == device["nvmlDeviceGetPciInfo"]["ok"]["pciSubSystemId"] \
        == NODE["pci_subsystem_id"]
    pci = (NODE_FILES / "sys-bus-pci-nvidia.txt").read_text()
    assert f"/sys/bus/pci/devices/{NODE['pci_bus_id']} " in pci
    assert f"class={NODE['pci_class']}" in pci and f"numa={NODE['numa_node']}" in pci
    assert device["nvmlDeviceGetNumaNodeId"]["error"] == "NVMLError_NotSupported"
    assert _smi("Driver Version") == dump["nvmlSystemGetDriverVersion"]["ok"] == NODE["driver_version"]
    assert f"  {NODE['driver_version']}  " in (NODE_FILES / "proc-driver-nvidia-version.txt").read_text()
    assert _smi("CUDA Version") == NODE["cuda_version"] == _cuda(dump["nvmlSystemGetCudaDriverVersion"]["ok"])
    assert "{}.{}".format(*device["nvmlDeviceGetCudaComputeCapability"]["ok"]) == NODE["compute_capability"]
    assert int(_smi("Minor Number")) == NODE["minor"]
    v2 = device["memory_v2"]["ok"]
    for field, key, nvml in (("Total", "memory_total_mib", "total"), ("Reserved", "memory_reserved_mib", "reserved"),
                             ("Used", "memory_used_mib", "used"), ("Free", "memory_free_mib", "free")):
        assert _mib(field) == NODE[key] == v2[nvml] // (1 << 20), field
    assert _smi("Persistence Mode") == "Enabled" and NODE["persistence"]
    lgip = (NODE_FILES / "nvidia-smi-mig-lgip.txt").read_text().splitlines()
    rows = [line.split() for line in lgip if "MIG " in line]
    details = [line.split() for line in lgip if re.fullmatch(r"\|\s+\d+\s+\d+\s+\d+\s+\|", line)]
    placements = {int(m.group(1)): (tuple(int(s) for s in m.group(2).split(",")), int(m.group(3)))
                  for m in re.finditer(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)",
                                       (NODE_FILES / "nvidia-smi-mig-lgipp.txt").read_text())}
    infos = {p["info"]["ok"]["id"]: p["info"]["ok"] for p in device["gi_profiles"].values() if "ok" in p["info"]}
    assert len(rows) == len(details) == len(infos) == len(MIG_PROFILES)
    for row, detail, expected in zip(rows, details, MIG_PROFILES):
        name, pid, instances, mib, sms, dec, enc, ce, jpeg, ofa, starts, size = expected
        # | 0  MIG 1g.10gb  19  7/7  9.75  No  16  1  0  |   then   |  1  1  0  |
        assert (row[3], int(row[4]), row[5], row[8:11]) == (name, pid, f"{instances}/{instances}",
                                                             [str(sms), str(dec), str(enc)])
        assert abs(float(row[6]) - mib / 1024) < 0.01
        assert detail[1:4] == [str(ce), str(jpeg), str(ofa)]
        info = infos[pid]
        assert (info["name"], info["instanceCount"], info["memorySizeMB"], info["multiprocessorCount"],
                info["decoderCount"], info["encoderCount"], info["copyEngineCount"], info["jpegCount"],
                info["ofaCount"]) == (f"MIG {name}", instances, mib, sms, dec, enc, ce, jpeg, ofa)
        assert placements[pid] == (starts, size)
    listing = (NODE_FILES / "dev-listing.txt").read_text()
    for target in DEV_CHAR_LINKS.values():
        assert target in listing or os.path.basename(target) in listing


def test_the_committed_capture_holds_the_node_value_for_value() -> None:
    captured = Capture.load(CAPTURE)
    gpu = SimHandle(0)
    assert captured.manifest.host.modprobe is None  # binaries-on-path.txt: no modprobe on the node
    assert captured.answer("nvmlDeviceGetUUID", gpu) == NODE["uuid"]
    assert captured.answer("nvmlDeviceGetName", gpu) == NODE["product"]
    pci = captured.answer("nvmlDeviceGetPciInfo", gpu)
    assert (pci.busIdLegacy.lower(), pci.pciDeviceId, pci.pciSubSystemId) == (
        NODE["pci_bus_id"], NODE["pci_device_id"], NODE["pci_subsystem_id"])
    sysfs = f"/sys/bus/pci/devices/{NODE['pci_bus_id']}"
    assert {key: captured.files[f"{sysfs}/{key}"].strip() for key in
            ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node")} == {
        "vendor": "0x10de", "device": "0x2330", "class": NODE["pci_class"], "subsystem_vendor": "0x10de",
        "subsystem_device": "0x16c1", "numa_node": NODE["numa_node"]}
    with pytest.raises(pynvml.NVMLError_NotSupported):
        captured.answer("nvmlDeviceGetNumaNodeId", gpu)
    assert captured.answer("nvmlSystemGetDriverVersion") == NODE["driver_version"]
    assert captured.files["/sys/module/nvidia/version"] == NODE["driver_version"] + "\n"
    assert _cuda(captured.answer("nvmlSystemGetCudaDriverVersion")) == NODE["cuda_version"]
    v2 = captured.answer("nvmlDeviceGetMemoryInfo", gpu, pynvml.nvmlMemory_v2)
    assert (v2.total >> 20, v2.reserved >> 20, v2.used >> 20, v2.free >> 20) == (
        NODE["memory_total_mib"], NODE["memory_reserved_mib"], NODE["memory_used_mib"], NODE["memory_free_mib"])
    v1 = captured.answer("nvmlDeviceGetMemoryInfo", gpu)
    assert v1.used >> 20 == NODE["memory_reserved_mib"]  # v1 counts the reserved memory as used
    assert captured.files["/proc/modules"] == ("nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)\n"
                                               "nvidia 14299136 - - Live 0xffffffffc0400000 (O)\n")
    params = dict(line.split(": ", 1) for line in captured.files["/proc/driver/nvidia/params"].splitlines())
    assert (params["DeviceFileMode"], params["ModifyDeviceFiles"], params["RegistryDwords"]) == ("438", "1", '""')
    profiles = captured.model(0).mig_profiles
    assert [(p.name.removeprefix("MIG "), p.id, p.instances, p.memory_mib, p.multiprocessors, p.decoders, p.encoders,
             p.copy_engines, p.jpeg, p.ofa, p.starts, p.size) for p in profiles] == MIG_PROFILES
    assert not any(path.startswith("/dev/char/") for path in captured.links)


# --- the agent on the captured node ----------------------------------------------------------------


def test_check_on_the_captured_node_wants_nothing_but_the_dev_char_links(tmp_path: Path) -> None:
    runtime = replay(tmp_path)
    try:
        runs = asyncio.run(runtime.engine.reconcile(dry_run=True))
    finally:
        runtime.nvml.close()
    changes = [change for run in runs for action in run.planned for change in action.changes]
    assert all(isinstance(change, CreateLink) for change in changes), changes
    assert {change.path: change.target for change in changes} == DEV_CHAR_LINKS
    assert {run.stage: run.state for run in runs if not run.planned} == {
        "driver-features": "waiting", "discovery": "ok", "device-path": "ok", "toolkit": "ok", "cdi": "ok",
        "owned-files": "ok"}


def test_apply_converges_without_modprobe_and_adds_only_the_dev_char_links(tmp_path: Path) -> None:
    runtime = replay(tmp_path)
    machine = runtime.nvml.lib.machine
    loads: list[str] = []
    load = runtime.loader.load

    def spy(module: str) -> None:
        loads.append(module)
        load(module)

    runtime.loader.load = spy  # type: ignore[method-assign]
    before = snapshot(tmp_path / "root")
    try:
        first = asyncio.run(runtime.engine.reconcile(force=True))
        after = snapshot(tmp_path / "root")
        second = asyncio.run(runtime.engine.reconcile(force=True))
    finally:
        runtime.nvml.close()
    assert loads == []
    assert {run.stage: run.state for run in first} == {
        "driver": "ok", "driver-features": "ok", "discovery": "ok", "device-path": "ok", "toolkit": "ok", "cdi": "ok",
        "owned-files": "ok"}
    assert "already loaded when gpu-agent started" in next(r.message for r in first if r.stage == "driver")
    kernel = machine.kernel_dir.relative_to(tmp_path / "root")
    changed = {path: after.get(path) for path in set(before) | set(after)
               if before.get(path) != after.get(path) and not path.startswith(f"{kernel.parent}/machine")}
    ledger = changed.pop("var/lib/gpu-agent/ledger.json")  # the links, recorded so that uninstall removes them
    assert ledger is not None and json.loads(ledger[1])["links"] == {
        link: {"owner": "driver", "target": os.path.relpath(target, "/dev/char")}
        for link, target in DEV_CHAR_LINKS.items()}
    assert changed.pop("var/lib/gpu-agent/ledger.lock") == ("file", f"{os.getpid()}\n".encode(), 0o600)  # its lock
    assert changed == {f"{kernel}/dev/char": ("dir", 0o755), **{
        f"{kernel}{link}": ("link", os.path.relpath(target, "/dev/char")) for link, target in DEV_CHAR_LINKS.items()}}
    assert [action for run in second for action in run.planned] == []
    assert runtime.state.readiness(one_shot=True) == (True, None)


def test_status_metrics_and_labels_show_the_node_as_it_is(tmp_path: Path) -> None:
    runtime = replay(tmp_path)
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
        runtime.state.first_reconcile_done = True
        Sampler(runtime.nvml, runtime.state, runtime.root).sample()
        document = runtime.state.to_json()
        metrics = render(make_registry(AgentCollector(runtime.state, lambda: 0, "node-1"))).decode()
        labels = compute(runtime.state.inventory, runtime.state.ready, "single", machine_name(runtime.root))
        inventory = runtime.state.inventory
    finally:
        runtime.nvml.close()
    assert document["ready"] and document["driver"]["version"] == NODE["driver_version"]
    assert document["driver"]["cuda_version"] == NODE["cuda_version"]
    [gpu] = document["gpus"]
    assert (gpu["uuid"], gpu["product"], gpu["pci_bus_id"], gpu["memory_mib"], gpu["compute_capability"]) == (
        NODE["uuid"], NODE["product"], NODE["pci_bus_id"], NODE["memory_total_mib"], NODE["compute_capability"])
    assert (gpu["mig"]["capable"], gpu["mig"]["mode"], gpu["mig"]["instances"]) == (True, NODE["mig_mode"], [])
    assert gpu["metrics"]["memory_used_mib"] == NODE["memory_used_mib"]
    assert gpu["metrics"]["memory_reserved_mib"] == NODE["memory_reserved_mib"]
    assert gpu["metrics"]["memory_free_mib"] == NODE["memory_free_mib"]
    profiles = gpu["mig"]["profiles"]  # /status, as nvidia-smi mig -lgip/-lgipp shows the table
    assert [(p["name"], p["id"], p["instances"], p["memory_mib"], p["multiprocessors"], p["decoders"],
             p["encoders"], p["copy_engines"], p["jpeg_engines"], p["ofa_engines"],
             tuple(s for s, _ in p["placements"]), {n for _, n in p["placements"]})
            for p in profiles] == [(*row[:11], {row[11]}) for row in MIG_PROFILES]
    assert len(inventory.gpus[0].mig.profiles) == len(profiles)
    samples = {(family.name, sample.name): sample for family in text_string_to_metric_families(metrics)
               for sample in family.samples}
    used = samples[("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED")]
    assert used.value == NODE["memory_used_mib"] and used.labels["UUID"] == NODE["uuid"]
    assert used.labels["modelName"] == NODE["product"] and used.labels["device"] == "nvidia0"
    assert samples[("DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_RESERVED")].value == NODE["memory_reserved_mib"]
    assert samples[("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_FREE")].value == NODE["memory_free_mib"]
    assert samples[("gpu_agent_gpus", "gpu_agent_gpus")].value == 1
    prefix = "nvidia.com/"
    assert {key[len(prefix):]: value for key, value in labels.items() if not key.startswith(f"{prefix}gpu-agent")} == {
        "cuda.driver-version.full": "580.159.04", "cuda.driver-version.major": "580",
        "cuda.driver-version.minor": "159", "cuda.driver-version.revision": "04",
        "cuda.driver.major": "580", "cuda.driver.minor": "159", "cuda.driver.rev": "04",
        "cuda.runtime-version.full": "13.0", "cuda.runtime-version.major": "13", "cuda.runtime-version.minor": "0",
        "cuda.runtime.major": "13", "cuda.runtime.minor": "0",
        "gpu.compute.major": "9", "gpu.compute.minor": "0", "gpu.count": "1", "gpu.family": "hopper",
        "gpu.memory": str(NODE["memory_total_mib"]), "gpu.mode": "compute", "gpu.present": "true",
        "gpu.product": "NVIDIA-H100-80GB-HBM3", "gpu.replicas": "1", "gpu.sharing-strategy": "none",
        "mig.capable": "true", "mps.capable": "false", "gpu.machine": "unknown", "mig.strategy": "single",
    }
    assert labels[f"{prefix}gpu-agent.ready"] == "true"


def test_labels_and_check_commands_on_the_capture(root: Path, capsys: Any) -> None:
    code, out = command(capsys, root, "--simulate", str(CAPTURE), "check")
    assert code == 2, out  # it needs the /dev/char links
    needs = [line.strip() for line in out.splitlines() if line.strip().startswith("needs:")]
    assert len(needs) == len(DEV_CHAR_LINKS) and all(n.startswith("needs: link /dev/char/") for n in needs)
    assert command(capsys, root, "--simulate", str(CAPTURE), "apply", "--once")[0] == 0
    assert command(capsys, root, "--simulate", str(CAPTURE), "check")[0] == 0
    code, out = command(capsys, root, "--simulate", str(CAPTURE), "labels", "--json")
    assert json.loads(out)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


@pytest.mark.subprocess
def test_run_on_the_capture_is_ready_with_the_nodes_numbers(agent: Any) -> None:
    process = agent(simulate=str(CAPTURE), settings={"metrics": {"sample_interval_seconds": 0.2}})
    process.wait_ready()
    status, _ = process.wait_http("/readyz", lambda code, body: code == 200)
    assert status == 200
    _, body = process.get("/status")
    document = json.loads(body)
    [gpu] = document["gpus"]
    assert (gpu["uuid"], gpu["product"], gpu["memory_mib"]) == (NODE["uuid"], NODE["product"], NODE["memory_total_mib"])
    assert document["driver"]["version"] == NODE["driver_version"] and document["driver"]["cuda_version"] == "13.0"
    _, metrics = process.wait_http("/metrics", lambda code, body: "DCGM_FI_DEV_FB_RESERVED{" in body)
    values = {sample.name: sample.value for family in text_string_to_metric_families(metrics)
              for sample in family.samples}
    assert values["DCGM_FI_DEV_FB_USED"] == 0 and values["DCGM_FI_DEV_FB_RESERVED"] == 480
    assert process.stop() == 0


# --- simulated on top of the capture -----------------------------------------------------------------


def test_processes_faults_xids_and_mig_are_simulated_on_top(tmp_path: Path) -> None:
    runtime = replay(tmp_path, settings="toolkit: {enabled: false}\n")
    machine = runtime.nvml.lib.machine
    try:
        with machine.edit() as state:
            state["gpus"][0]["processes"].append({"pid": 4242, "name": "trainer", "used_mib": 2048})
        sample = runtime.nvml.sampling.sample(0)
        assert sample.memory_used_mib == 2048 and sample.memory_reserved_mib == 480
        assert sample.memory_free_mib == NODE["memory_free_mib"] - 2048
        assert runtime.nvml.inventory.processes(0) == [(4242, 2048.0)]
        assert (runtime.root("/proc/4242/comm")).read_text() == "trainer\n"
        with machine.edit() as state:  # `gpu-agent sim fail` on an answer only the capture knows
            state["faults"].append({"id": 1, "call": "nvmlDeviceGetBAR1MemoryInfo", "gpu": None, "error": "GpuIsLost",
                                    "times": 1})
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            runtime.nvml.lib.nvmlDeviceGetBAR1MemoryInfo(SimHandle(0))
        assert runtime.nvml.lib.nvmlDeviceGetBAR1MemoryInfo(SimHandle(0)).bar1Total == 137438953472
        wait = runtime.nvml.events.watch_xids()
        with machine.edit() as state:  # `gpu-agent sim inject-xid --gpu 0 --xid 79`
            state["xids"].append({"seq": state["next_seq"], "gpu": 0, "xid": 79, "at": 0.0})
            state["next_seq"] += 1
        event = wait(2000)
        assert event is not None and (event.gpu_uuid, event.xid) == (NODE["uuid"], 79)
        wait.free()
        with machine.edit() as state:  # MIG enabled, one 3g.40gb, placed from the captured profile table
            from gpu_agent.sim.mig import add_device

            gpu = state["gpus"][0]
            gpu["mig"].update(current=1, pending=1, gpu_instances=[])
            add_device(gpu, runtime.nvml.lib._model(gpu), "3g.40gb")
        [mig] = runtime.nvml.inventory.read().gpus[0].mig.devices
        assert (mig.profile, mig.memory_mib, mig.multiprocessors, mig.placement) == ("3g.40gb", 40448, 60, (0, 4))
        access = runtime.root(f"/proc/driver/nvidia/capabilities/gpu0/mig/gi{mig.gpu_instance_id}/access")
        assert access.read_text().startswith("DeviceFileMinor: ")
        assert runtime.root("/proc/driver/nvidia/capabilities/fabric-imex-mgmt").is_file()  # captured, kept
    finally:
        runtime.nvml.close()


def test_a_captured_host_without_modprobe_cannot_load_a_module(tmp_path: Path) -> None:
    runtime = replay(tmp_path)
    try:
        with pytest.raises(AgentError, match=r"^cannot run modprobe: not installed or not on PATH$"):
            runtime.loader.load("nvidia_drm")
        assert "nvidia_drm" not in runtime.root("/proc/modules").read_text()
    finally:
        runtime.nvml.close()


def test_a_module_loaded_on_a_captured_kernel_looks_like_the_captured_ones(tmp_path: Path) -> None:
    (tmp_path / "capture").mkdir()
    for part in CAPTURE.iterdir():
        shutil.copy(part, tmp_path / "capture" / part.name)
    manifest = json.loads((tmp_path / "capture" / "manifest.json").read_text())
    manifest["host"]["modprobe"] = "/usr/sbin/modprobe"
    (tmp_path / "capture" / "manifest.json").write_text(json.dumps(manifest))
    runtime = replay(tmp_path, tmp_path / "capture")
    try:
        runtime.loader.load("nvidia_modeset")
        modules = runtime.root("/proc/modules").read_text().splitlines()
        assert modules[0].startswith("nvidia_modeset ") and modules[0].split()[2:4] == ["-", "-"]
        assert modules[1:] == ["nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)",
                               "nvidia 14299136 - - Live 0xffffffffc0400000 (O)"]
        assert runtime.root("/sys/module/nvidia_modeset/version").read_text() == "580.159.04\n"
        with pytest.raises(AgentError, match="gdrdrv not found in directory /lib/modules/6.18.44-fc-v657-gpu"):
            runtime.loader.load("gdrdrv")
    finally:
        runtime.nvml.close()


# --- capture ----------------------------------------------------------------------------------------


def _apply_sim(root: Path, tmp_path: Path, profile: str) -> None:
    runtime = Runtime.build(Root(root), config(tmp_path), profile)
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
    finally:
        runtime.nvml.close()


def _gpus(runtime: Runtime) -> list[dict[str, Any]]:
    asyncio.run(runtime.engine.reconcile(force=True))
    return [{key: value for key, value in gpu.items() if key not in ("metrics", "processes")}
            for gpu in runtime.state.to_json()["gpus"]]


def test_a_captured_simulated_node_replays_with_the_same_gpus(tmp_path: Path) -> None:
    original = tmp_path / "original"
    _apply_sim(original, tmp_path, "dgx-h100")
    runtime = Runtime.build(Root(original), config(tmp_path), "dgx-h100")
    try:
        manifest = capture(runtime.root, runtime.nvml.lib, tmp_path / "capture", 5.0, "--simulate dgx-h100",
                           "simulated")
        gpus = _gpus(runtime)
    finally:
        runtime.nvml.close()
    assert manifest["problems"] == [] and manifest["host"]["modprobe"] == "simulated"
    replayed = replay(tmp_path / "replayed", tmp_path / "capture")
    try:
        assert _gpus(replayed) == gpus
        assert len(gpus) == 8 and gpus[0]["product"] == "NVIDIA H100 80GB HBM3"
        assert [run.planned for run in asyncio.run(replayed.engine.reconcile(dry_run=True))] == [[]] * 7
    finally:
        replayed.nvml.close()


def test_a_captured_mig_node_replays_its_mig_devices(tmp_path: Path) -> None:
    machine = tmp_path / "lab.yaml"
    machine.write_text("name: lab\ngpus:\n  - model: H100-80GB-HBM3\n    mig: {devices: [3g.40gb, 2g.20gb]}\n"
                       "  - model: A30\n")
    original = tmp_path / "original"
    _apply_sim(original, tmp_path, str(machine))
    runtime = Runtime.build(Root(original), config(tmp_path), str(machine))
    try:
        manifest = capture(runtime.root, runtime.nvml.lib, tmp_path / "capture", 5.0, "lab", "simulated")
        gpus = _gpus(runtime)
    finally:
        runtime.nvml.close()
    assert manifest["problems"] == []
    assert [(d["profile"], d["placement"]) for d in gpus[0]["mig"]["instances"]] == [("3g.40gb", (0, 4)),
                                                                                    ("2g.20gb", (4, 2))]
    replayed = replay(tmp_path / "replayed", tmp_path / "capture")
    try:
        assert _gpus(replayed) == gpus
        gi = gpus[0]["mig"]["instances"][0]["gpu_instance_id"]
        assert replayed.root(f"/proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}/access").read_text() == \
            runtime.root(f"/proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}/access").read_text()
    finally:
        replayed.nvml.close()


def test_capture_changes_nothing_and_reads_no_other_process(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "node"
    _apply_sim(root, tmp_path, "dgx-a100")
    assert command(capsys, root, "--simulate", "dgx-a100", "sim", "add-process", "--gpu", "0", "--pid", "4242",
                   "--name", "trainer")[0] == 0
    kernel = root / "var/lib/gpu-agent/sim/kernel"
    (kernel / "proc/4242/environ").write_text("AWS_SECRET_ACCESS_KEY=do-not-capture\0")
    (kernel / "proc/1").mkdir()
    (kernel / "proc/1/environ").write_text("PASSWORD=do-not-capture\0")
    before = snapshot(root)
    assert command(capsys, root, "--simulate", "dgx-a100", "capture", str(tmp_path / "capture"))[0] == 0
    after = snapshot(root)
    state = "var/lib/gpu-agent/sim/machine.json"
    assert {path for path in set(before) | set(after) if before.get(path) != after.get(path)} <= {state}
    assert json.loads(before[state][1]) == json.loads(after[state][1])
    written = "".join(path.read_text() for path in (tmp_path / "capture").iterdir())
    assert "do-not-capture" not in written and "/proc/4242" not in written and "cmdline" not in written
    nvml = json.loads((tmp_path / "capture" / "nvml.json").read_text())
    processes = next(e for e in nvml if e["call"] == "nvmlDeviceGetComputeRunningProcesses")
    assert processes["ok"][0]["object"]["pid"] == 4242  # NVML's answer, yes; the process's files, no
    assert not any(answers_call.startswith(("nvmlDeviceSet", "nvmlDeviceCreate")) for answers_call in
                   (e["call"] for e in nvml))


def test_the_recorder_refuses_every_call_that_changes_a_gpu(tmp_path: Path) -> None:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    root = Root(tmp_path).with_kernel(machine.kernel_dir)
    for module in ("nvidia", "nvidia_uvm"):
        SimModprobe(machine, root).load(module)
    recorder = RecordingNvml(FakeNvml(machine))
    nvml = Nvml(recorder, call_timeout=5.0)
    try:
        nvml.session.init()
        gpu = SimHandle(0)
        for call, args in (("nvmlDeviceSetPersistenceMode", (gpu, 1)), ("nvmlDeviceSetMigMode", (gpu, 1)),
                           ("nvmlDeviceCreateGpuInstance", (gpu, 9)), ("nvmlDeviceResetGpuLockedClocks", (gpu,)),
                           ("nvmlEventSetCreate", ()), ("nvmlDeviceClearEccErrorCounts", (gpu, 0))):
            with pytest.raises(MutationRefused, match=f"capture is read-only: {call} was not called"):
                getattr(recorder, call)(*args)
        with pytest.raises(MutationRefused):
            nvml.inventory.enable_persistence(0)
        assert machine.read()["gpus"][0].get("persistence", 0) == 0
        assert nvml.inventory.persistence_modes()[0] is False  # a read goes through, and is recorded
        assert {entry["call"] for entry in recorder.recorded()} >= {"nvmlInit", "nvmlDeviceGetPersistenceMode"}
    finally:
        nvml.close()


def test_capture_refuses_a_directory_that_is_not_empty(tmp_path: Path, root: Path, capsys: Any) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes").write_text("mine\n")
    with pytest.raises(AgentError, match="busy: not empty; capture into a new directory"):
        command(capsys, root, "--simulate", "t4", "capture", str(tmp_path / "busy"))
    assert sorted(os.listdir(tmp_path / "busy")) == ["notes"]


# --- bad captures --------------------------------------------------------------------------------


def _broken(tmp_path: Path, part: str, edit: Any) -> Path:
    directory = tmp_path / "broken"
    shutil.copytree(CAPTURE, directory)
    path = directory / part
    if callable(edit):
        document = json.loads(path.read_text())
        edit(document)
        path.write_text(json.dumps(document))
    elif edit is None:
        path.unlink()
    else:
        path.write_text(edit)
    return directory


def _entry(document: list[dict[str, Any]], call: str) -> dict[str, Any]:
    return next(e for e in document if e["call"] == call)


def _first_memory(document: list[dict[str, Any]]) -> dict[str, Any]:
    return _entry(document, "nvmlDeviceGetMemoryInfo")


@pytest.mark.parametrize("part, edit, message", [
    ("manifest.json", None, r"not a gpu-agent capture \(no manifest.json\)"),
    ("nvml.json", None, r"nvml.json: missing; a capture has manifest.json and"),
    ("files.json", '{"files": {', r"files.json:1:\d+: not valid JSON"),
    ("devices.json", "\xff\xfe", r"devices.json:1:1: not valid JSON"),
    ("manifest.json", lambda d: d.update(format="gpu-agent-capture/9"),
     r"unknown capture format 'gpu-agent-capture/9'"),
    ("manifest.json", lambda d: d.update(colour="blue"), r"manifest.json: colour: unknown key"),
    ("files.json", lambda d: d["files"].update({"/proc/../etc/shadow": "x"}),
     r"'/proc/../etc/shadow' is not a normalised"),
    ("files.json", lambda d: d["files"].update({"/proc/driver/nvidia/params": "Mode: \ud800\n"}),
     r"files.json: '/proc/driver/nvidia/params': text no file can hold"),
    ("files.json", lambda d: d["files"].update({"/root/.ssh/id_rsa": "x"}),
     r"/root/.ssh/id_rsa: a capture holds files under"),
    ("devices.json", lambda d: d.append({"path": "/dev/sda", "type": "block", "major": 8, "minor": 0, "mode": "0660",
                                         "uid": 0, "gid": 6}),
     r"devices.json: \[7\] path: .*/dev/sda: a capture holds"),
    ("devices.json", lambda d: d[1].update(mode="rwx"), r"devices.json: \[1\] mode: .*'rwx' is not an octal"),
    ("devices.json", lambda d: d[1].update(major=-1), r"devices.json: \[1\] major: Input should be greater than"),
    ("ldcache.json", lambda d: d[0].update(flags=1 << 40), r"ldcache.json: \[0\] flags: Input should be less than"),
    ("links.json", lambda d: d.update({"/dev/char/1:1": "a\0b"}), r"links.json: '/dev/char/1:1': expected a link"),
    ("links.json", lambda d: d.update({"/etc/passwd": "/tmp/x"}), r"links.json: '/etc/passwd': expected a link under"),
    ("ldcache.json", lambda d: d[0].update(path="relative/lib.so"), r"ldcache.json: \[0\] path: .*not a normalised"),
    ("nvml.json", lambda d: d[0].pop("ok"), r"nvml.json: \[0\] nvmlInit: needs either ok or error"),
    ("nvml.json", lambda d: d.append([1, 2]), r"nvml.json: \[\d+\] .*"),
    ("nvml.json", lambda d: _first_memory(d)["ok"].update(struct="c_nvmlNoSuchThing_t"),
     r"nvml.json: \[11\] nvmlDeviceGetMemoryInfo: cannot replay the recorded answer: pynvml has no structure"),
    ("nvml.json", lambda d: _first_memory(d)["ok"]["fields"].update(colour=1),
     r"nvml.json: \[11\] nvmlDeviceGetMemoryInfo: cannot replay .*: pynvml's c_nvmlMemory_t has no field 'colour'"),
    ("nvml.json", lambda d: _first_memory(d)["ok"]["fields"].update(total="lots"),
     r"nvml.json: \[11\] nvmlDeviceGetMemoryInfo: cannot replay the recorded answer"),
    ("nvml.json", lambda d: _first_memory(d)["ok"].update(struct="c_nvmlUtilization_t", fields={}),
     r"nvmlDeviceGetMemoryInfo: expected a c_nvmlMemory_t or c_nvmlMemory_v2_t structure"),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetMigMode").update(ok="disabled"),
     r"nvmlDeviceGetMigMode: expected a list of two integers, the capture has \"disabled\""),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetCount").update(ok=True),
     r"nvmlDeviceGetCount: expected an integer"),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetCount").update(ok=10 ** 9),
     r"nvml.json: nvmlDeviceGetCount: 1000000000 GPUs; a node has 0 to 256"),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetGpuInstancePossiblePlacements").update(ok=[[-1, 2]]),
     r"nvmlDeviceGetGpuInstancePossiblePlacements: expected a list of \[start, size\] pairs"),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetComputeRunningProcesses").update(ok=[{"object": {}}]),
     r"nvmlDeviceGetComputeRunningProcesses: expected a list of processes"),
    ("nvml.json", lambda d: _entry(d, "nvmlDeviceGetUUID").update(ok={"handle": "../../etc"}),
     r"nvmlDeviceGetUUID: cannot replay the recorded answer: unknown handle reference '../../etc'"),
])
def test_a_bad_capture_is_a_clear_error_naming_the_file(tmp_path: Path, part: str, edit: Any, message: str,
                                                        capsys: Any) -> None:
    directory = _broken(tmp_path, part, edit)
    with pytest.raises(AgentError) as refused:  # an error for the user (exit 1), nothing else
        command(capsys, tmp_path / "root", "--simulate", str(directory), "check")
    assert re.search(message, str(refused.value)), refused.value
    assert str(directory) in str(refused.value)


def test_bytes_that_are_not_utf8_replay_as_they_were_captured(tmp_path: Path, capsys: Any) -> None:
    """The capture keeps a file that is not UTF-8 with its bytes escaped (surrogateescape); the replay writes
    those bytes back, not an error."""
    def latin1_comment(document: dict[str, Any]) -> None:
        document["files"]["/proc/driver/nvidia/params"] += "Comment: caf\udce9\n"

    directory = _broken(tmp_path, "files.json", latin1_comment)
    _, out = command(capsys, tmp_path / "root", "--simulate", str(directory), "check")
    assert "[+] discovery: 1x H100 80GB HBM3" in out and "internal error" not in out, out
    params = tmp_path / "root/var/lib/gpu-agent/sim/kernel/proc/driver/nvidia/params"
    assert params.read_bytes().endswith(b"Comment: caf\xe9\n")


def test_a_huge_capture_part_is_refused_before_it_is_read(tmp_path: Path) -> None:
    directory = _broken(tmp_path, "files.json", "")
    with open(directory / "files.json", "wb") as handle:
        handle.truncate(17 << 20)  # sparse: nothing is written
    with pytest.raises(AgentError, match=r"files.json: larger than 16 MiB"):
        Capture(directory)


def test_capture_of_a_node_whose_nvml_fails_says_so_and_replays_the_failure(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "node"
    code, out = command(capsys, root, "--simulate", "dgx-h100", "capture", str(tmp_path / "capture"))  # cold kernel
    assert code == 0
    assert "not captured: nvmlInit: the NVIDIA kernel driver is not loaded" in out
    nvml = json.loads((tmp_path / "capture" / "nvml.json").read_text())
    assert nvml == [{"call": "nvmlInit", "args": [], "error": "DriverNotLoaded",
                     "code": pynvml.NVML_ERROR_DRIVER_NOT_LOADED}]
    replayed = replay(tmp_path / "replay", tmp_path / "capture")
    try:
        assert isinstance(replayed.nvml.lib, ReplayNvml)
        with pytest.raises(Exception, match="the NVIDIA kernel driver is not loaded"):
            replayed.nvml.session.init()
    finally:
        replayed.nvml.close()
