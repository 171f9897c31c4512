"""/metrics carries dcgm-exporter's default counters (name, type, help, labels) from the background
sample, so dashboards and alerts written for dcgm-exporter keep working; a scrape makes no NVML call."""
from __future__ import annotations

import asyncio
import csv
import functools
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from upstream_data import upstream_file

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.metrics.dcgm import DEFAULT_COUNTERS, LABELS, MIG_LABELS, XID_ERRORS
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import AgentState

CAPTURE = Path(__file__).parent / "data" / "captures" / "h100-580-vm"

# dcgm-exporter 4.5.3-4.8.2 (its current release), etc/default-counters.csv and etc/dcp-metrics-included.csv,
# read from ../shared/upstream/dcgm-exporter: every counter there but those NVML cannot give (docs/metrics.md
# lists them, with why) is exported with the same name, type and help text. DCGM_FI_DRIVER_VERSION, of type
# "label", is a label of every series.
NOT_EXPORTED = {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}


@functools.cache
def _counters(name: str) -> dict[str, tuple[str, str]]:
    """A dcgm-exporter counters file: `name, type, help` per line, # comments (its own parser: csv, trimmed)."""
    found = {}
    text = upstream_file("dcgm-exporter", f"etc/{name}").read_text()
    for row in csv.reader(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")):
        found[row[0].strip()] = (row[1].strip(), ",".join(row[2:]).strip())
    return found


def _exported() -> dict[str, tuple[str, str]]:
    """The default counters the agent exports: all but the labels and those NVML cannot give."""
    return {name: value for name, value in _counters("default-counters.csv").items()
            if name not in NOT_EXPORTED and value[0] != "label"}


def test_the_dcp_file_lists_the_default_counters() -> None:
    """dcp-metrics-included.csv (the Helm chart's and image's profiling set) has the same counters and types."""
    default = _counters("default-counters.csv")
    assert {name: kind for name, (kind, _) in _counters("dcp-metrics-included.csv").items()} == \
        {name: kind for name, (kind, _) in default.items()}
    assert default["DCGM_FI_DRIVER_VERSION"][0] == "label" and "DCGM_FI_DRIVER_VERSION" in LABELS
    metrics_doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    assert all(f"`{name}`" in metrics_doc for name in NOT_EXPORTED)


class Node:
    def __init__(self, tmp_path: Path, spec: str) -> None:
        self.machine = MachineState(Root(tmp_path))
        self.machine.ensure(spec)
        SimModprobe(self.machine, Root(tmp_path)).load("nvidia")
        self.fake = FakeNvml(self.machine)
        self.nvml = Nvml(self.fake, call_timeout=2.0)
        self.state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
        self.state.inventory = self.nvml.inventory.read()
        self.sampler = Sampler(self.nvml, self.state, Root(tmp_path))
        self.registry = make_registry(AgentCollector(self.state, lambda: 0, "node-1"))

    def scrape(self) -> dict[str, Any]:
        return {family.name: family for family in text_string_to_metric_families(render(self.registry).decode())}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(spec: str = "dgx-h100") -> Node:
        made.append(Node(tmp_path / str(len(made)), spec))
        return made[-1]

    yield make
    for n in made:
        n.nvml.close()


def test_default_dcgm_counters_by_name_type_and_help_are_dcgm_exporters(node) -> None:
    expected = _exported()
    n = node()
    n.sampler.sample()
    n.sampler.sample()  # NVLink bandwidth and the GPM (PROF) series are over an interval: two readings
    families = n.scrape()
    assert {c.name for c in DEFAULT_COUNTERS + (XID_ERRORS,)} == set(expected)
    for name, (kind, help_text) in expected.items():
        assert (families[name].type, families[name].documentation) == (kind, help_text), name


def test_default_dcgm_counters_labels_and_values(node) -> None:
    names = [c.name for c in DEFAULT_COUNTERS + (XID_ERRORS,)]
    n = node()
    n.sampler.sample()
    n.sampler.sample()
    families = n.scrape()
    gpus = n.state.inventory.gpus
    for name in names:
        family = families[name]
        assert len(family.samples) == 8, name
        # dcgm-exporter's attributes of the XID series: its err_code and err_msg, after the labels
        xid = {"err_code": "0", "err_msg": "No Error"} if name == "DCGM_FI_DEV_XID_ERRORS" else {}
        for sample, gpu in zip(family.samples, gpus):
            assert list(sample.labels) == list(LABELS) + list(xid), name  # dcgm-exporter's order
            assert sample.labels == {
                "gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": "0000" + gpu.pci_bus_id.upper(),
                "device": f"nvidia{gpu.index}", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1",
                "DCGM_FI_DRIVER_VERSION": "550.90.07", **xid}, name
    value = {name: families[name].samples[0].value for name in names}
    assert value["DCGM_FI_DEV_SM_CLOCK"] == 345 and value["DCGM_FI_DEV_MEM_CLOCK"] == 2619
    assert 20 < value["DCGM_FI_DEV_GPU_TEMP"] < 90 and 50 < value["DCGM_FI_DEV_POWER_USAGE"] <= 700
    assert value["DCGM_FI_DEV_FB_USED"] + value["DCGM_FI_DEV_FB_FREE"] + value["DCGM_FI_DEV_FB_RESERVED"] == 81559
    assert value["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] >= 0 and value["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == 0
    assert families["gpu_agent_sample_age_seconds"].samples[0].value >= 0


def test_a_scrape_makes_no_nvml_call(node) -> None:
    n = node()
    n.sampler.sample()
    before = dict(n.fake.calls)
    for _ in range(3):
        n.scrape()
    assert dict(n.fake.calls) == before


def test_busy_gpu_reads_higher_and_the_energy_counter_grows(node) -> None:
    n = node()
    n.sampler.sample()
    idle = n.scrape()
    with n.machine.edit() as doc:
        doc["gpus"][1]["processes"].append({"pid": 4242, "name": "python3", "used_mib": 1024})
    n.sampler.sample()
    busy = n.scrape()

    def at(families: dict[str, Any], name: str, gpu: str) -> float:
        return next(s.value for s in families[name].samples if s.labels["gpu"] == gpu)

    assert at(busy, "DCGM_FI_DEV_SM_CLOCK", "1") > at(idle, "DCGM_FI_DEV_SM_CLOCK", "1")
    assert at(busy, "DCGM_FI_DEV_GPU_UTIL", "1") > 0 and at(busy, "DCGM_FI_DEV_FB_USED", "1") == 1024
    energy = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    assert at(busy, energy, "1") >= at(idle, energy, "1")


def test_a_gpu_with_gpu_instances_is_reported_per_gpu_instance(node) -> None:
    """dcgm-exporter's default (flex) monitoring: a GPU with GPU instances is monitored through them only;
    framebuffer per GPU instance, the GPU's own value for the whole-GPU counters."""
    n = node()
    assert n.nvml.mig.set_mode(0, True) is None
    profiles = {p.name: p for p in n.nvml.mig.state(0).profiles}
    for placement in ((0, 4), (4, 4)):
        gi = n.nvml.mig.create_gpu_instance(0, profiles["3g.40gb"].id, placement)
        n.nvml.mig.create_compute_instance(0, gi, 3, 0)
    n.state.inventory = n.nvml.inventory.read()
    n.sampler.sample()
    families = n.scrape()
    used = families["DCGM_FI_DEV_FB_USED"].samples
    mig = [s for s in used if "GPU_I_ID" in s.labels]
    assert len(used) == 9 and len(mig) == 2 and not any(s.labels["gpu"] == "0" and "GPU_I_ID" not in s.labels
                                                        for s in used)
    assert all(list(s.labels) == list(MIG_LABELS) for s in mig)
    assert {(s.labels["gpu"], s.labels["GPU_I_PROFILE"]) for s in mig} == {("0", "3g.40gb")}
    assert {s.labels["GPU_I_ID"] for s in mig} == {str(gi.id) for gi in n.state.inventory.gpus[0].mig.gpu_instances}
    assert all(s.value == 0 for s in mig)
    clocks = [s for s in families["DCGM_FI_DEV_SM_CLOCK"].samples if s.labels["gpu"] == "0"]
    assert len(clocks) == 2 and all("GPU_I_ID" in s.labels and s.value == 345 for s in clocks)
    assert len(families["DCGM_FI_DEV_SM_CLOCK"].samples) == 9


def test_what_a_gpu_does_not_report_is_left_out_not_faked(node) -> None:
    n = node("t4")  # a T4 retires pages; it has no remapped rows
    n.sampler.sample()
    families = n.scrape()
    assert "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" not in families
    assert len(families["DCGM_FI_DEV_GPU_TEMP"].samples) == 1


def test_the_real_h100_capture_answers_as_the_node_did(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    runtime = Runtime.build(Root(tmp_path / "root"), load_config(config, required=True), str(CAPTURE))
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
        Sampler(runtime.nvml, runtime.state, runtime.root).sample()
        text = render(make_registry(AgentCollector(runtime.state, lambda: 0, "node-1"))).decode()
    finally:
        runtime.nvml.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # nvml.json: nvmlDeviceGetClockInfo SM 345, MEM 2619; energy 2195042 mJ; no replays; rows [0, 0, 0, 0]
    value = {name: families[name].samples[0].value for name in families if name.startswith("DCGM_")}
    assert value["DCGM_FI_DEV_SM_CLOCK"] == 345 and value["DCGM_FI_DEV_MEM_CLOCK"] == 2619
    assert value["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 2195042 and value["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"] == 0
    assert value["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] == 0 and value["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == 0
    assert families["DCGM_FI_DEV_SM_CLOCK"].samples[0].labels["pci_bus_id"] == "00000000:00:06.0"
    assert "DCGM_FI_DEV_ENC_UTIL" not in families  # not recorded: NotSupported, never simulated


# dcgm-exporter's XID attributes: internal/pkg/collector/gpu_collector.go (toMetric) sets err_code to the
# value and err_msg to xidErrCodeToText[value] (internal/pkg/collector/xid_errors.go) or "Unknown Error";
# gpu_collector_test.go checks 0, 42 and 255. The map itself is Go source, so it is not kept here; what is
# kept is a fact about it, read at NVIDIA/dcgm-exporter d5e5f510a1b6b393f39a43293ccd9dc985defc79: its keys
# are 0-172 without a gap, and the SHA-256 of its entries written one a line as "<xid>\t<text>\n", in
# order, is XID_MAP_SHA256. A changed text in the agent's table changes that digest.
XID_MAP_SIZE = 173
XID_MAP_SHA256 = "575a731f3e7ee9551fc59f0dff7abc39b17ecf1187b72c485d44ed836cdefccf"


def test_the_xid_texts_are_dcgm_exporters_xid_err_code_to_text() -> None:
    import hashlib

    from gpu_agent.metrics.dcgm import XID_TEXT, xid_labels

    entries = "".join(f"{xid}\t{text}\n" for xid, text in enumerate(XID_TEXT))
    assert len(XID_TEXT) == XID_MAP_SIZE
    assert hashlib.sha256(entries.encode()).hexdigest() == XID_MAP_SHA256
    # gpu_collector_test.go's cases: no error, a known value, an unknown value
    assert xid_labels(0) == ("0", "No Error")
    assert xid_labels(42) == ("42", XID_TEXT[42])
    assert xid_labels(255) == ("255", "Unknown Error")
    assert xid_labels(79) == ("79", "GPU has fallen off the bus")


def test_the_xid_series_carries_err_code_and_err_msg_after_the_labels(node) -> None:
    from gpu_agent.nvml.model import GpuHealth

    n = node()
    gpus = n.state.inventory.gpus
    n.state.health[gpus[3].uuid] = GpuHealth(last_xid=79, xid_counts=((79, 1),))
    n.state.health[gpus[5].uuid] = GpuHealth(last_xid=999, xid_counts=((999, 1),))
    samples = n.scrape()["DCGM_FI_DEV_XID_ERRORS"].samples
    assert [(s.value, s.labels["err_code"], s.labels["err_msg"]) for s in samples] == \
        [(0, "0", "No Error")] * 3 + [(79, "79", "GPU has fallen off the bus"), (0, "0", "No Error"),
                                      (999, "999", "Unknown Error"), (0, "0", "No Error"), (0, "0", "No Error")]
    assert list(samples[3].labels)[-3:] == ["DCGM_FI_DRIVER_VERSION", "err_code", "err_msg"]
