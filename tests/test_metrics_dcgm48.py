"""dcgm-exporter 4.5.3-4.8.2's additions on /metrics: pod UID and pod labels from the Kubernetes API,
legacy label names, the host label's name, hpc_job, per-process series on shared GPUs and the
DCGM_EXP_* series. Upstream's own cases are in tests/facts/dcgm_exporter_48.py (commit there)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from facts import dcgm_exporter_48 as facts
from gpu_agent.config import load_config
from gpu_agent.config.loader import parse_config
from gpu_agent.errors import ConfigError
from gpu_agent.host.paths import Root
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import KubeClient
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.extras import pod_uid_of
from gpu_agent.metrics.hpc import read_jobs
from gpu_agent.metrics.pod_metadata import PodMetadata, kept_labels, sanitized
from gpu_agent.metrics.pods import PodLabels
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import AgentState
from kube_emulator import KubeEmulator
from test_pod_labels import MACHINE, Kubelet, response

UID_A = "a9c80282-3f6b-4d5b-84d5-a137a6668011"
UID_B = "12345678-1234-1234-1234-123456789012"


class Node:
    def __init__(self, tmp_path: Path, metrics: str, processes: tuple[dict[str, Any], ...] = (),
                 reasons: int = 0) -> None:
        spec = tmp_path / "lab.yaml"
        spec.write_text(MACHINE)
        self.root = tmp_path / "root"
        machine = MachineState(Root(self.root))
        machine.ensure(str(spec))
        with machine.edit() as doc:
            doc["gpus"][1]["processes"].extend(processes)
            doc["gpus"][0]["clock_event_reasons"] = reasons
        SimModprobe(machine, Root(self.root)).load("nvidia")
        (self.root / "proc").symlink_to("var/lib/gpu-agent/sim/kernel/proc")  # as the simulator's boot mounts it
        config = tmp_path / "config.yaml"
        config.write_text("version: v1\nmetrics:\n" + metrics)
        self.nvml = Nvml(FakeNvml(machine), call_timeout=2.0)
        self.state = AgentState(load_config(config, required=True))
        self.state.inventory = self.nvml.inventory.read()
        self.sampler = Sampler(self.nvml, self.state, Root(self.root))
        self.sampler.sample()
        self.registry = make_registry(AgentCollector(self.state, lambda: 0, "node-1"))
        self.gpus = self.state.inventory.gpus

    def text(self) -> str:
        return render(self.registry).decode()

    def series(self, name: str) -> list[dict[str, str]]:
        families = {f.name: f for f in text_string_to_metric_families(self.text())}
        return [sample.labels for sample in families[name].samples] if name in families else []

    def values(self, name: str) -> list[tuple[dict[str, str], float]]:
        families = {f.name: f for f in text_string_to_metric_families(self.text())}
        return [(s.labels, s.value) for s in families[name].samples] if name in families else []

    def refresh(self, metadata: Any = None) -> Any:
        labels = PodLabels(Root(self.root), lambda: self.state.inventory, lambda p: setattr(self.state, "pods", p),
                           lambda: True, lambda: 0.05, 2.0, metadata=lambda: metadata)
        return asyncio.run(labels.refresh())


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=("gpu-node-1", "gpu-node-2")).start()
    yield emulator
    emulator.close()


def _lister(api: KubeEmulator, root: Path, node: str = "gpu-node-1") -> tuple[PodMetadata, KubeClient]:
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    client = KubeClient(Root(root), "/etc/kubernetes/kubelet.conf", 5.0, RequestBudget())
    return PodMetadata(lambda limit: client.list_pods(node, limit)), client


# --- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("metrics, expected", [
    ("  pod_uid: true\n", "pod_uid takes effect only with pod_labels: true"),
    ("  pod_labels: true\n  pod_label_allowlist_regex: app\n",
     "pod_label_allowlist_regex takes effect only with pod_kubernetes_labels: true"),
    ("  pod_labels: true\n  pod_kubernetes_labels: true\n  pod_label_allowlist_regex: ['(']\n",
     "c.yaml:5: metrics.pod_label_allowlist_regex.0: '(' is not a regular expression"),
    ("  exporter_series: [DCGM_EXP_XID_ERRORS_COUNT, DCGM_EXP_XID_ERRORS_COUNT]\n", "names a series twice"),
    ("  hostname_label: HOST\n", "metrics.hostname_label"),
    ("  hpc_job_mapping_dir: relative\n", "must be an absolute path"),
])
def test_settings_that_cannot_work_are_refused_naming_the_key(metrics: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("version: v1\nmetrics:\n" + metrics, "c.yaml")
    assert expected in str(info.value)


def test_one_regex_is_a_list_of_one() -> None:
    loaded = parse_config("version: v1\nmetrics:\n  pod_labels: true\n  pod_kubernetes_labels: true\n"
                          "  pod_label_allowlist_regex: '^app$'\n", "c.yaml")
    assert loaded.metrics.pod_label_allowlist_regex == ["^app$"]


# --- upstream's tables -----------------------------------------------------------------------------

@pytest.mark.parametrize("allowlist, key, kept", facts.LABEL_FILTER)
def test_label_allowlist_as_upstream(allowlist: tuple[str, ...], key: str, kept: bool) -> None:
    assert bool(kept_labels([(key, "v")], allowlist)) is kept


@pytest.mark.parametrize("allowlist, labels, expected", facts.POD_LABELS)
def test_pod_labels_filtered_and_sanitized_as_upstream(allowlist: tuple[str, ...], labels: dict[str, str],
                                                       expected: dict[str, str]) -> None:
    assert kept_labels(sorted(labels.items()), allowlist) == expected


@pytest.mark.parametrize("key, name", facts.SANITIZED)
def test_label_names_sanitized_as_upstream(key: str, name: str) -> None:
    assert sanitized(key) == name


def test_a_label_that_would_start_with_a_digit_or_collide_is_left_out() -> None:
    assert kept_labels([("2fa", "x"), ("a.b", "1"), ("a/b", "2")], ()) == {"a_b": "1"}


@pytest.mark.parametrize("entries, expected", facts.HPC_FILES)
def test_hpc_mapping_file_names_as_upstream(tmp_path: Path, entries: tuple[str, ...],
                                            expected: tuple[str, ...]) -> None:
    for name in entries:
        (tmp_path / name).write_text("job\n")
    (tmp_path / "7").mkdir()  # a directory is never a mapping file
    assert tuple(sorted(read_jobs(tmp_path, "/d").jobs)) == tuple(sorted(expected))


@pytest.mark.parametrize("path, uid", facts.POD_UID_PATHS)
def test_pod_uid_from_a_cgroup_path_as_upstream(path: str, uid: str) -> None:
    assert pod_uid_of(f"0::{path}\n") == uid


# --- the series ------------------------------------------------------------------------------------

def test_hpc_jobs_label_each_gpus_series_once_per_job(tmp_path: Path) -> None:
    mapping = tmp_path / "root/run/slurm"
    node = Node(tmp_path, "  hpc_job_mapping_dir: /run/slurm\n")
    mapping.mkdir(parents=True)
    gi = node.gpus[2].mig.devices[0].gpu_instance_id
    files = {"0" if name == "0" else "1" if name == "1" else f"2.{gi}": text
             for name, text in facts.HPC_MAPPING.items()}
    for name, text in files.items():
        (mapping / name).write_text(text)
    node.sampler.sample()
    jobs = {(s["gpu"], s.get("GPU_I_ID"), s.get("hpc_job")) for s in node.series("DCGM_FI_DEV_POWER_USAGE")}
    assert jobs == {("0", None, "job1-0"), ("1", None, "job1-1"), ("1", None, "job2-1"),
                    ("2", str(gi), "job3.0-0"), ("2", str(node.gpus[2].mig.devices[1].gpu_instance_id), None)}
    assert node.state.to_json()["hpc_jobs"]["error"] is None


def test_a_missing_mapping_directory_leaves_the_series_and_says_why(tmp_path: Path) -> None:
    node = Node(tmp_path, "  hpc_job_mapping_dir: /run/slurm\n")
    assert all("hpc_job" not in s for s in node.series("DCGM_FI_DEV_GPU_TEMP"))
    assert node.state.to_json()["hpc_jobs"]["error"] == "no directory /run/slurm"


def test_legacy_names_and_the_host_label(tmp_path: Path) -> None:
    node = Node(tmp_path, "  legacy_label_names: true\n  hostname_label: hostname\n")
    labels = node.series("DCGM_FI_DEV_GPU_TEMP")[0]
    assert list(labels)[:6] == ["gpu", "uuid", "pci_bus_id", "device", "modelName", "hostname"]
    node.state.config = load_config(_write(tmp_path, "  hostname_label: none\n"), required=True)
    assert "Hostname" not in node.series("DCGM_FI_DEV_GPU_TEMP")[0] and \
        "hostname" not in node.series("DCGM_FI_DEV_GPU_TEMP")[0]


def _write(tmp_path: Path, metrics: str) -> Path:
    path = tmp_path / "other.yaml"
    path.write_text("version: v1\nmetrics:\n" + metrics)
    return path


def test_pod_uid_and_pod_labels_come_from_the_api_and_are_kept(tmp_path: Path, api: KubeEmulator) -> None:
    node = Node(tmp_path, "  pod_labels: true\n  pod_uid: true\n  pod_kubernetes_labels: true\n"
                          "  pod_label_allowlist_regex: ['^app', 'team']\n  legacy_label_names: true\n")
    kubelet = Kubelet(node.root)
    try:
        kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": [node.gpus[0].uuid]}}))
        api.add_pod("ml", "trainer", "gpu-node-1", UID_A, {"app.kubernetes.io/name": "llm", "team": "a", "tier": "x"})
        api.add_pod("ml", "elsewhere", "gpu-node-2", UID_B, {"app": "other"})
        metadata, _ = _lister(api, node.root)
        node.refresh(metadata)
        node.refresh(metadata)
        assert metadata.lists == 1  # kept: the pod holding the GPU was in the first answer
        held = [s for s in node.series("DCGM_FI_DEV_GPU_TEMP") if s.get("pod_name")]
        assert len(held) == 1
        assert list(held[0])[6:] == ["DCGM_FI_DRIVER_VERSION", "app_kubernetes_io_name", "team", "container_name",
                                     "pod_name", "pod_namespace", "pod_uid"]
        assert held[0]["pod_uid"] == UID_A and held[0]["app_kubernetes_io_name"] == "llm"
        api.close()  # the API is gone: the pods as last read stay, the reason is said
        metadata.tried_at = metadata.listed_at = -1e9  # as if MAX_AGE_SECONDS had passed
        result = node.refresh(metadata)
        assert "listing this node's pods failed" in str(result.metadata_error)
        assert [s for s in node.series("DCGM_FI_DEV_GPU_TEMP") if s.get("pod_uid") == UID_A]
    finally:
        kubelet.stop()


def test_a_node_may_list_only_its_own_pods(tmp_path: Path, api: KubeEmulator) -> None:
    metadata, _ = _lister(api, tmp_path / "root", node="gpu-node-2")
    assert metadata.lookup({("ml", "x")}) == {} and "forbidden" in str(metadata.error)


def test_per_process_series_on_a_shared_gpu(tmp_path: Path, api: KubeEmulator) -> None:
    processes = ({"pid": 101, "name": "a", "used_mib": 1000, "sm_util": 20, "pod_uid": UID_A},
                 {"pid": 102, "name": "a2", "used_mib": 500, "sm_util": 15, "pod_uid": UID_A},
                 {"pid": 103, "name": "b", "used_mib": 300, "sm_util": 40, "pod_uid": UID_B})
    node = Node(tmp_path, "  pod_labels: true\n  virtual_gpus: true\n", processes)
    gpu1 = node.gpus[1].uuid
    kubelet = Kubelet(node.root)
    try:
        kubelet.answer = response(("ml", "a", {"c": {"nvidia.com/gpu": [f"{gpu1}::0"]}}),
                                  ("ml", "b", {"c": {"nvidia.com/gpu": [f"{gpu1}::1"]}}),
                                  ("ml", "idle", {"c": {"nvidia.com/gpu": [f"{gpu1}::2"]}}))
        api.add_pod("ml", "a", "gpu-node-1", UID_A)
        api.add_pod("ml", "b", "gpu-node-1", UID_B)
        api.add_pod("ml", "idle", "gpu-node-1", "c0ffee00-0000-0000-0000-000000000000")
        metadata, _ = _lister(api, node.root)
        node.refresh(metadata)
        node.sampler.sample()
        util = {s.get("pod"): (v, s.get("vgpu"), s.get("pod_uid")) for s, v in node.values("DCGM_FI_DEV_GPU_UTIL")
                if s["UUID"] == gpu1}
        assert util == {None: (75.0, None, None), "a": (35.0, "0", UID_A), "b": (40.0, "1", UID_B),
                        "idle": (0.0, "2", "c0ffee00-0000-0000-0000-000000000000")}
        used = {s.get("pod"): v for s, v in node.values("DCGM_FI_DEV_FB_USED") if s["UUID"] == gpu1}
        assert used["a"] == 1500.0 and used["b"] == 300.0 and used["idle"] == 0.0
        temp = {(s.get("pod"), s.get("vgpu")) for s in node.series("DCGM_FI_DEV_GPU_TEMP") if s["UUID"] == gpu1}
        assert temp == {("a", "0"), ("b", "1"), ("idle", "2")}  # no pod_uid without metrics.pod_uid
    finally:
        kubelet.stop()


def test_exporter_series(tmp_path: Path) -> None:
    node = Node(tmp_path, "  exporter_series: [DCGM_EXP_XID_ERRORS_COUNT, DCGM_EXP_CLOCK_EVENTS_COUNT, "
                          "DCGM_EXP_GPU_HEALTH_STATUS, DCGM_EXP_P2P_STATUS]\n  xid_count_window_seconds: 60\n",
                reasons=0x4 | 0x40)
    gpu0 = node.gpus[0].uuid
    now = time.time()
    for at, xid in ((now - 120, 31), (now - 5, 31), (now - 3, 31), (now - 1, 48)):
        node.state.note_xid(gpu0, xid, at)
    node.sampler.sample()
    text = node.text()
    assert "# TYPE DCGM_EXP_XID_ERRORS_COUNT counter\n" in text
    xids = {(s.get("xid"), s["window_size_in_ms"]): v for s, v in node.values("DCGM_EXP_XID_ERRORS_COUNT")
            if s["UUID"] == gpu0}
    assert xids == {("31", "60000"): 2.0, ("48", "60000"): 1.0}
    quiet = [(s, v) for s, v in node.values("DCGM_EXP_XID_ERRORS_COUNT") if s["UUID"] == node.gpus[1].uuid]
    assert len(quiet) == 1 and "xid" not in quiet[0][0] and quiet[0][1] == 0
    clocks = {s.get("clock_event"): v for s, v in node.values("DCGM_EXP_CLOCK_EVENTS_COUNT") if s["UUID"] == gpu0}
    assert clocks == {facts.CLOCK_EVENTS[0x4]: 2.0, facts.CLOCK_EVENTS[0x40]: 2.0}  # two samples taken
    node.state.update_health(gpu0, lambda h: h.__class__(check_reason="row-remap-failure: no spare rows"))
    health = [(s["health_watch"], s["health_error_code"], v) for s, v in node.values("DCGM_EXP_GPU_HEALTH_STATUS")
              if s["UUID"] == gpu0]
    assert [watch for watch, _, _ in health] == list(facts.HEALTH_WATCHES)
    assert ("MEM", "DCGM_FR_ROW_REMAP_FAILURE", 20.0) in health and ("PCIE", "DCGM_FR_OK", 0.0) in health
    p2p = [(s["peer_gpu"], s["link_status"], v) for s, v in node.values("DCGM_EXP_P2P_STATUS") if s["UUID"] == gpu0]
    assert sorted(peer for peer, _, _ in p2p) == ["1", "2"]
    assert all(facts.LINK_STATUS[int(v)] == name for _, name, v in p2p)
