"""The labels stage against the Kubernetes API emulator, over TLS with the node's client certificate."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import cli
from harness import FakeClock, Pass, SimNode, run_cli
from kube_emulator import KubeEmulator
from test_labels import DGX_A100

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import TIMESTAMP

NODE = "gpu-node-1"
KUBELET_CONDITIONS = {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE, "gpu-node-2")).start()
    yield emulator
    emulator.close()


@pytest.fixture
def kube_root(root: Path, api: KubeEmulator) -> Path:
    """A sandbox root whose kubelet.conf is the node's own identity (system:node:gpu-node-1)."""
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    return root


def settings(**kubernetes: object) -> dict:
    return {"kubernetes": {"node_name": NODE, **kubernetes},
            "reconcile": {"backoff_initial_seconds": 0.2}}


def apply(root: Path, simulate: str = "dgx-a100", **kubernetes: object) -> Pass:
    """`gpu-agent apply --once`, in this process."""
    return SimNode(root, simulate, settings(**kubernetes)).apply()


def labels_failed(done: Pass) -> str:
    run = done.stage("labels")
    assert run.state == "failed", (run.state, run.message)
    return run.message


def test_dgx_a100_labels_and_condition_reach_the_node(api: KubeEmulator, kube_root: Path) -> None:
    api.set_labels({"team": "ml", "nvidia.com/someone-elses": "keep"})
    done = apply(kube_root)
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    labels = api.labels()
    assert {k: v for k, v in labels.items() if k in DGX_A100 or k.startswith("nvidia.com/gpu")} == DGX_A100
    assert labels["team"] == "ml" and labels["nvidia.com/someone-elses"] == "keep"
    assert api.annotations()["nvidia.com/gpu-agent.managed-labels"] == ",".join(sorted({*DGX_A100, TIMESTAMP}))
    condition = api.condition("GPUAgentReady")
    assert (condition["status"], condition["reason"]) == ("True", "GPUsReady")
    types = {c["type"] for c in api.get_node()["status"]["conditions"]}
    assert KUBELET_CONDITIONS | {"GPUAgentReady"} <= types
    users = {r.user for r in api.requests}
    assert users == {"system:node:gpu-node-1"}


def test_stale_labels_go_and_others_stay(api: KubeEmulator, kube_root: Path) -> None:
    api.set_labels({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/old.feature": "true",
                    "nvidia.com/not-ours": "x"})
    api.set_annotations({"nvidia.com/gpu-agent.managed-labels": "nvidia.com/gpu.product,nvidia.com/old.feature"})
    assert apply(kube_root).ok
    labels = api.labels()
    assert "nvidia.com/old.feature" not in labels and labels["nvidia.com/not-ours"] == "x"


@pytest.mark.subprocess  # the daemon's own passes, forced by SIGHUP
def test_a_noop_reconcile_sends_no_request(agent, api: KubeEmulator, kube_root: Path) -> None:
    daemon = agent("dgx-a100", settings=settings())
    daemon.wait_ready()
    api.wait_for_requests(2, method="PATCH")
    daemon.wait_http("/status", lambda _, b: json.loads(b)["stages"][-1]["state"] == "ok")
    api.clear_requests()
    daemon.signal(signal.SIGHUP)  # a full, forced reconcile
    daemon.wait_message(lambda m: "READY=1" in m.splitlines() and "RELOADING" not in m)
    time.sleep(0.5)
    assert api.requests == []


@pytest.mark.subprocess  # the daemon, its SIGHUPs and `gpu-agent status`
def test_a_fault_storm_is_survived_at_a_bounded_rate(agent, api: KubeEmulator, kube_root: Path, root: Path,
                                                     write_config) -> None:
    api.fail_next("*", 500, count=None)
    daemon = agent("dgx-a100", settings=settings())
    daemon.wait_ready()
    _, body = daemon.wait_http("/readyz?verbose", lambda _, b: "[-]labels failed" in b)
    assert daemon.get("/readyz")[0] == 200  # the GPUs are fine: the sink only degrades the agent
    status = cli("status", root=root, config=daemon.config)  # the command's exit code, against the daemon
    assert status.returncode == 2 and "degraded: labels" in status.stdout
    assert json.loads(daemon.get("/status")[1])["kubernetes_api"]["state"] == "recovering"
    api.clear_faults()  # the API's schedule tries again within seconds (the forced pass may be held)
    daemon.signal(signal.SIGHUP)
    daemon.wait_http("/readyz?verbose", lambda _, b: "[+]labels ok" in b, timeout=30)
    assert api.labels()["nvidia.com/gpu.count"] == "8"
    assert json.loads(daemon.get("/status")[1])["kubernetes_api"]["state"] == "ok"
    # The storm again, and reloads that each build a new client (a new request timeout) and force a pass
    # that skips the stage's backoff: the API's schedule holds each forced request back until its retry
    # is due, and the node's budget would hold the rest. Reloads go on until a forced pass is seen held
    # (each reload of a changed file is validated first, and a loaded machine coalesces signals).
    api.fail_next("*", 500, count=None)
    deadline, reloads, held = time.monotonic() + 120, 0, False
    while not (held and reloads >= 10) and time.monotonic() < deadline:
        write_config(settings(request_timeout_seconds=5 + reloads % 40))
        daemon.signal(signal.SIGHUP)
        daemon._drain()  # read its notify messages, as systemd would: a full socket would block it
        reloads += 1
        time.sleep(0.1)
        held = held or "not sent: the next attempt is due in" in daemon.get("/readyz?verbose")[1]
    assert held, f"no forced pass was held back in {reloads} reloads"
    assert api.max_requests_in_window(60) <= 12


def test_clients_built_again_share_the_nodes_api_schedule_and_request_budget(api: KubeEmulator, kube_root: Path,
                                                                             write_config) -> None:
    """Each reload builds a new client; forced passes skip the stages' backoff. A failed request's retry
    is still held until due, and the budget still counts what every earlier client spent."""
    api.fail_next("*", 500, count=None)
    clock = FakeClock()
    runtime = Runtime.build(Root(kube_root), load_config(write_config(settings()), True), "t4", clock=clock)
    try:
        for timeout in range(1, 6):
            config = load_config(write_config(settings(request_timeout_seconds=timeout)), True).config
            runtime.engine.set_stages(runtime.stages(config))
            for _ in range(4):
                asyncio.run(runtime.engine.reconcile(force=True))
            assert "not sent: the next attempt is due in" in runtime.state.stages["labels"].message
            clock.wait_until(runtime.state.stages["labels"].next_retry or 0)
        assert len(api.requests) == 5  # one at each due retry; the forced passes between them sent nothing
        while runtime.kube_budget.take():  # another client of the node (`gpu-agent labels`) spends the rest
            pass
        runtime.engine.set_stages(runtime.stages(config))
        asyncio.run(runtime.engine.reconcile(force=True))
    finally:
        runtime.nvml.close()
    assert len(api.requests) == 5
    assert "not sent: 12 requests to the API server in the last minute" in runtime.state.stages["labels"].message


def test_a_conflict_is_followed_by_a_fresh_read_and_the_write_at_once(api: KubeEmulator, kube_root: Path) -> None:
    """Each patch carries the resourceVersion of the read it was made from; another writer changed the
    Node in between, so the server answers 409, and the same pass reads again and writes."""
    api.write_next("/api/v1/nodes/gpu-node-1", method="PATCH")
    done = apply(kube_root)
    assert done.ok, done.stage("labels").message
    assert api.labels()["nvidia.com/gpu.count"] == "8"
    assert [(r.method, r.path.rpartition("/")[2], r.status) for r in api.requests] == [
        ("GET", NODE, 200), ("PATCH", NODE, 409), ("GET", NODE, 200), ("PATCH", NODE, 200),
        ("PATCH", "status", 200)]
    patches = [r.json for r in api.requests if r.method == "PATCH"]
    assert patches[0]["metadata"]["resourceVersion"] != patches[1]["metadata"]["resourceVersion"]
    assert patches[2]["metadata"]["resourceVersion"] == api.requests[3].response["metadata"]["resourceVersion"]
    assert done.state.kube_api is not None
    assert (done.state.kube_api["state"], done.state.kube_api["conflicts"]) == ("ok", 1)


@pytest.mark.subprocess  # the daemon
def test_the_condition_turns_false_when_readyz_does(agent, api: KubeEmulator, kube_root: Path, root: Path) -> None:
    config = settings()
    config["reconcile"]["interval_seconds"] = 86400  # no periodic pass: only the health change can send it
    daemon = agent("dgx-a100", settings=config)
    daemon.wait_ready()
    daemon.wait_http("/status", lambda _, b: json.loads(b)["stages"][-1]["state"] == "ok")
    api.kubelet_heartbeat()
    assert run_cli("sim", "inject-xid", "--gpu", "2", "--xid", "48", root=root).returncode == 0
    daemon.wait_http("/readyz", lambda status, _: status == 503)
    deadline = time.monotonic() + 10
    while (api.condition("GPUAgentReady") or {}).get("status") != "False":
        assert time.monotonic() < deadline, "GPUAgentReady is still True 10 s after /readyz turned 503"
        time.sleep(0.05)
    condition = api.condition("GPUAgentReady")
    assert condition["reason"] == "GpuHealthFailed" and "XID 48" in condition["message"]
    assert KUBELET_CONDITIONS <= {c["type"] for c in api.get_node()["status"]["conditions"]}
    assert api.labels()["nvidia.com/gpu-agent.ready"] == "false"


def test_forbidden_names_the_identity(api: KubeEmulator, root: Path) -> None:
    api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", user="system:node:gpu-node-2", mode="cert-data")
    message = labels_failed(apply(root, "t4"))
    assert "403 Forbidden" in message and "user 'system:node:gpu-node-2'" in message


def test_nfd_feature_file_is_written(api: KubeEmulator, kube_root: Path) -> None:
    assert apply(kube_root, "t4", nfd_feature_file=True).ok
    text = (kube_root / "etc/kubernetes/node-feature-discovery/features.d/gpu-agent").read_text()
    assert "nvidia.com/gpu.product=Tesla-T4\n" in text and "nvidia.com/gpu-agent.ready=true\n" in text


def test_a_token_file_identity_works(api: KubeEmulator, root: Path) -> None:
    api.add_token("s3cr3t-node-token", "system:node:gpu-node-1", ["system:nodes"])
    (root / "var/lib/kubelet").mkdir(parents=True)
    (root / "var/lib/kubelet/token").write_text("s3cr3t-node-token\n")
    config = api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="token", token="unused")
    text = config.read_text().replace("token: unused", "tokenFile: /var/lib/kubelet/token")
    config.write_text(text)
    done = apply(root, "t4")
    assert done.ok, done.stage("labels").message
    assert {r.user for r in api.requests} == {"system:node:gpu-node-1"}


@pytest.mark.subprocess  # the daemon
def test_a_rotated_client_certificate_is_used_from_the_next_request(agent, api: KubeEmulator, root: Path) -> None:
    ours = api.node_credentials("gpu-node-1")
    pki = root / "var/lib/kubelet/pki"
    pki.mkdir(parents=True)
    current = pki / "kubelet-client-current.pem"
    current.write_bytes(ours.cert_pem + ours.key_pem)
    config = api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-files", combined_pem=True)
    text = config.read_text()
    (pki / "ca.crt").write_bytes(api.ca_pem)
    paths = {"client-certificate:": "/var/lib/kubelet/pki/kubelet-client-current.pem",
             "client-key:": "/var/lib/kubelet/pki/kubelet-client-current.pem",
             "certificate-authority:": "/var/lib/kubelet/pki/ca.crt"}  # host paths, under the agent's root
    text = "\n".join(next((line.split(":")[0] + ": " + path for key, path in paths.items()
                           if line.strip().startswith(key)), line) for line in text.splitlines()) + "\n"
    config.write_text(text)
    daemon = agent("t4", settings=settings())
    daemon.wait_ready()
    daemon.wait_http("/status", lambda _, b: json.loads(b)["stages"][-1]["state"] == "ok")
    other = api.node_credentials("gpu-node-2")  # the kubelet rotated to a certificate of another name
    current.write_bytes(other.cert_pem + other.key_pem)
    run_cli("sim", "inject-xid", "--gpu", "0", "--xid", "48", root=root)  # something to tell the API
    _, body = daemon.wait_http("/readyz?verbose", lambda _, b: "[-]labels failed" in b)
    assert "403" in body and "/var/lib/kubelet/pki/kubelet-client-current.pem" in body
    assert api.requests[-1].user == "system:node:gpu-node-2"


def test_an_nvml_hiccup_keeps_the_gpu_labels(api: KubeEmulator, kube_root: Path) -> None:
    assert apply(kube_root).ok
    assert api.labels()["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert run_cli("sim", "fail", "nvmlDeviceGetCount", "--times", "5", root=kube_root).returncode == 0
    assert not apply(kube_root).ok
    labels = api.labels()
    assert labels["nvidia.com/gpu-agent.ready"] == "false"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"  # nodeSelectors keep matching
    assert api.condition("GPUAgentReady")["status"] == "False"


NFD_FILE = "etc/kubernetes/node-feature-discovery/features.d/gpu-agent"


def test_the_nfd_feature_file_is_written_when_the_api_server_does_not_answer(api: KubeEmulator,
                                                                            kube_root: Path) -> None:
    api.close()  # the kubeconfig's server is gone: connection refused
    message = labels_failed(apply(kube_root, "t4", nfd_feature_file=True))
    assert "GET" in message and "the NFD feature file" in message
    text = (kube_root / NFD_FILE).read_text()
    assert "nvidia.com/gpu.product=Tesla-T4\n" in text and "nvidia.com/gpu-agent.ready=true\n" in text


def test_an_api_server_error_leaves_the_nfd_feature_file_written_and_is_asked_once_a_pass(
        api: KubeEmulator, kube_root: Path) -> None:
    api.fail_next("*", 500, count=None)
    assert "500" in labels_failed(apply(kube_root, "t4", nfd_feature_file=True))
    assert "nvidia.com/gpu.count=1\n" in (kube_root / NFD_FILE).read_text()
    assert [r.method for r in api.requests] == ["GET"]  # not again after the file was written


@pytest.mark.parametrize("enabled", [False, "auto"])
def test_with_kubernetes_off_the_nfd_feature_file_is_still_written(api: KubeEmulator, root: Path,
                                                                   enabled: object) -> None:
    """enabled: false, or auto with no kubeconfig: no API server is asked, the local file is written."""
    if enabled is False:
        api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    done = apply(root, "t4", enabled=enabled, nfd_feature_file=True)
    assert done.ok, done.stage("labels").message
    assert "the Kubernetes API is off" in done.stage("labels").message
    assert "nvidia.com/gpu.product=Tesla-T4\n" in (root / NFD_FILE).read_text()
    assert api.requests == []


def test_with_kubernetes_off_and_no_nfd_feature_file_there_is_no_labels_stage(root: Path) -> None:
    done = SimNode(root, "t4", {"kubernetes": {"enabled": False}}).apply()
    assert "labels" not in [run.stage for run in done.runs]


def test_a_hostname_that_is_no_node_name_asks_for_kubernetes_node_name(
        api: KubeEmulator, kube_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpu_agent.stages.labels.socket.gethostname", lambda: "gpu_node_1")
    done = SimNode(kube_root, "t4", {"kubernetes": {"nfd_feature_file": True}}).apply()
    message = labels_failed(done)
    assert "this host's name 'gpu_node_1'" in message and "set kubernetes.node_name" in message
    assert api.requests == []
    assert (kube_root / NFD_FILE).exists()  # the local file does not need the name


def test_the_hostname_is_the_node_name_in_lower_case_as_the_kubelets(
        api: KubeEmulator, kube_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpu_agent.stages.labels.socket.gethostname", lambda: "GPU-Node-1\n")
    done = SimNode(kube_root, "t4", {}).apply()
    assert done.ok, done.stage("labels").message
    assert {r.path for r in api.requests} >= {"/api/v1/nodes/gpu-node-1"}


def test_an_nvml_hiccup_without_the_api_server_keeps_the_gpu_labels_in_the_nfd_file(api: KubeEmulator,
                                                                                     kube_root: Path) -> None:
    assert apply(kube_root, nfd_feature_file=True).ok
    api.close()
    assert run_cli("sim", "fail", "nvmlDeviceGetCount", "--times", "5", root=kube_root).returncode == 0
    assert not apply(kube_root, nfd_feature_file=True).ok
    text = (kube_root / NFD_FILE).read_text()
    assert "nvidia.com/gpu-agent.ready=false\n" in text
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-40GB\n" in text  # nodeSelectors keep matching


def test_the_gfd_timestamp_is_kept_until_another_label_changes(api: KubeEmulator, kube_root: Path) -> None:
    assert apply(kube_root).ok
    assert api.labels()[TIMESTAMP].isdigit() and len(api.labels()[TIMESTAMP]) == 10  # GFD's [0-9]{10}
    api.set_labels({TIMESTAMP: "1594644571"})  # as GFD's docs show it, from an earlier pass
    api.clear_requests()
    assert apply(kube_root).ok
    assert api.labels()[TIMESTAMP] == "1594644571"  # nothing else changed: kept, and no label PATCH
    assert [r.method for r in api.requests if r.method == "PATCH"] == []
    api.set_labels({"nvidia.com/gpu.count": "7"})
    assert apply(kube_root).ok
    assert api.labels()["nvidia.com/gpu.count"] == "8" and int(api.labels()[TIMESTAMP]) > 1594644571


def test_a_read_only_nfd_directory_fails_the_stage_naming_it(api: KubeEmulator, kube_root: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """NFD's directory read-only (EROFS simulated; in the unit's sandbox: made after the agent started)."""
    from gpu_agent.host import files

    mkstemp = files.tempfile.mkstemp
    features = kube_root / NFD_FILE.rpartition("/")[0]

    def refused(dir: str, **kwargs: str) -> tuple[int, str]:
        if Path(dir) == features:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return mkstemp(dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkstemp", refused)
    message = labels_failed(apply(kube_root, "t4", nfd_feature_file=True))
    assert message == (f"cannot write the NFD features file /{NFD_FILE}: {features} is on a read-only file system "
                       "(EROFS)")


def test_the_device_path_decides_from_the_node_from_the_first_pass_on_and_across_restarts(
        api: KubeEmulator, kube_root: Path) -> None:
    """The package record says containerd 1.7.24, the Node (the kubelet's own runtime) 1.6.20: the first pass
    after a start already decides envvar, as every later one does. A restart while the API server fails
    decides the same from the versions the Node last gave, and sends no more reads than the labels' own."""
    def runtime(node: dict) -> None:
        node["status"]["nodeInfo"]["containerRuntimeVersion"] = "containerd://1.6.20"

    api.modify_node(NODE, runtime)
    sim = SimNode(kube_root, "dgx-a100", settings())
    sim.sim("install-runtime", "containerd", "1.7.24")
    sim.sim("install-runtime", "kubelet", "1.31.4")
    first = sim.apply()
    assert first.state.device_path.strategy == "envvar", first.state.device_path.reason
    assert "containerd 1.6.20 does not apply CDI" in first.state.device_path.reason
    assert len(api.requests_for("GET")) == 1  # the device path's read is the labels' read
    kept = json.loads((kube_root / "var/lib/gpu-agent/node-info.json").read_text())
    assert kept == {"containerRuntimeVersion": "containerd://1.6.20",
                    "kubeletVersion": api.get_node(NODE)["status"]["nodeInfo"]["kubeletVersion"]}

    api.clear_requests()
    api.fail_next("*", 403, count=None)  # a person must fix it: the labels stage's backoff
    restarted = SimNode(kube_root, "dgx-a100", settings()).apply()
    assert restarted.state.device_path.strategy == "envvar", restarted.state.device_path.reason
    assert restarted.stage("labels").state == "failed" and len(api.requests_for("GET")) == 1

    (kube_root / "var/lib/gpu-agent/node-info.json").unlink()  # never answered: the package record decides
    api.clear_requests()
    assert SimNode(kube_root, "dgx-a100", settings()).apply().state.device_path.strategy == "cdi-cri"
