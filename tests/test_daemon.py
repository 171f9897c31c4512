"""The daemon's contract, checked on the real process: notify messages, endpoints, signals, exit codes."""
from __future__ import annotations

import pytest

import json
import re
import signal
import stat
import time
from pathlib import Path

from conftest import cli
from harness import run_cli

from gpu_agent.daemon import app

# The process contract: the daemon as systemd runs it (signals, notify, endpoints, exit codes).
pytestmark = pytest.mark.subprocess


def test_dgx_h100_ready_serves_status_metrics_and_stops_cleanly(agent, root: Path) -> None:
    daemon = agent("dgx-h100")
    ready = daemon.wait_ready()
    assert "STATUS=ready: 8x H100 80GB HBM3, driver 550.90.07" in ready.splitlines()

    assert daemon.get("/healthz") == (200, "ok\n")
    assert daemon.get("/readyz")[0] == 200
    status, body = daemon.get("/readyz?verbose")
    assert status == 200 and ("[+]driver ok\n[+]driver-features ok\n[+]discovery ok\n[+]device-path ok\n[+]toolkit ok\n"
                              "[+]cdi ok\n[+]owned-files ok\n[+]gpu-health ok") in body

    document = json.loads(daemon.get("/status")[1])
    assert document["ready"] is True
    assert [stage["name"] for stage in document["stages"]] == ["driver", "driver-features", "discovery", "device-path",
                                                           "toolkit", "cdi", "owned-files"]
    gpus = document["gpus"]
    assert len(gpus) == 8 and len({gpu["uuid"] for gpu in gpus}) == 8
    assert {gpu["product"] for gpu in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert gpus[0]["pci_bus_id"] == "0000:18:00.0" and gpus[0]["memory_mib"] == 81559
    mig = gpus[0]["mig"]
    assert (mig["capable"], mig["mode"], mig["pending_mode"], mig["instances"]) == (True, "disabled", "disabled", [])
    assert mig["gpu_instances"] == []
    assert [p["name"] for p in mig["profiles"]][:2] == ["1g.10gb", "1g.10gb+me"]
    assert document["config"]["digest"].startswith("sha256:")

    metrics = daemon.get("/metrics")[1]
    temps = [line for line in metrics.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP{")]
    assert len(temps) == 8
    assert 'gpu="0"' in temps[0] and 'device="nvidia0"' in temps[0] and 'modelName="NVIDIA H100 80GB HBM3"' in temps[0]
    assert 'gpu_agent_stage_ok{stage="discovery"} 1.0' in metrics

    sock = root / "run/gpu-agent/agent.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660

    assert daemon.stop(timeout=5) == 0
    assert any("STOPPING=1" in m.splitlines() for m in daemon.messages)
    assert not sock.exists()


def test_invalid_config_exits_1_naming_the_key_and_touches_nothing(root: Path, write_config) -> None:
    config = write_config(text="version: v1\nhttp:\n  lissten: 127.0.0.1:1\n")
    result = cli("--simulate", "dgx-h100", "run", root=root, config=config)
    assert result.returncode == 1
    assert f"{config}:3: http.lissten: unknown key" in result.stderr
    assert list(root.iterdir()) == []


def test_no_gpu_is_alive_but_not_ready_with_a_reason(agent) -> None:
    daemon = agent("none")
    ready = daemon.wait_ready()
    assert "STATUS=not ready: driver: no NVIDIA GPU was found on the PCI bus" in ready
    assert daemon.get("/healthz")[0] == 200
    status, body = daemon.get("/readyz?verbose")
    assert status == 503
    assert "[-]driver failed: no NVIDIA GPU was found" in body
    assert "[-]discovery failed: no NVIDIA GPU was found: NVML library" in body
    assert body.endswith("readyz check failed\n")
    assert daemon.get("/readyz")[0] == 503


def test_sighup_reloads_and_an_invalid_reload_keeps_the_running_config(agent) -> None:
    daemon = agent("dgx-h100")
    daemon.wait_ready()
    digest = json.loads(daemon.get("/status")[1])["config"]["digest"]

    good = daemon.config.read_text()
    daemon.config.write_text(good + "bogus: 1\n")
    daemon.messages.clear()
    daemon.signal(signal.SIGHUP)
    daemon.wait_message(lambda m: "RELOADING=1" in m.splitlines())
    daemon.wait_message(lambda m: "READY=1" in m.splitlines())
    document = json.loads(daemon.get("/status")[1])
    assert "bogus: unknown key" in document["config"]["reload_error"]
    assert document["config"]["digest"] == digest
    assert daemon.get("/readyz")[0] == 200

    daemon.config.write_text(good)  # the running config's own text again: nothing to load, nothing wrong
    daemon.messages.clear()
    daemon.signal(signal.SIGHUP)
    daemon.wait_message(lambda m: "READY=1" in m.splitlines())
    document = json.loads(daemon.get("/status")[1])
    assert document["config"]["reload_error"] is None and document["config"]["digest"] == digest

    daemon.config.write_text(good + "discovery:\n  expected_gpus: 7\n")
    daemon.signal(signal.SIGHUP)
    _, body = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert "expected 7 GPUs (discovery.expected_gpus) but NVML reports 8" in body
    # /status shows a config once the pass it forced has published (the plugin and the other watchers
    # follow it then); /readyz may answer for that pass's stages a moment before
    _, text = daemon.wait_http("/status", lambda _, text: json.loads(text)["config"]["digest"] != digest)
    assert json.loads(text)["config"]["reload_error"] is None
    assert daemon.proc.poll() is None


def test_simulated_faults_reach_the_running_daemon_as_they_happen(agent, root: Path) -> None:
    # No periodic sample, check or pass within the test: what it sees, the change itself brought.
    daemon = agent("dgx-h100", settings={"metrics": {"sample_interval_seconds": 3600},
                                         "health": {"check_interval_seconds": 3600},
                                         "reconcile": {"interval_seconds": 86400}})
    daemon.wait_ready()
    # XID 48, not 79: a GPU off the bus fails discovery too (see test_health_daemon's quick start)
    assert run_cli("sim", "inject-xid", "--gpu", "3", "--xid", "48", root=root).returncode == 0
    _, body = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert "[-]gpu-health failed: GPU 3" in body and "XID 48 (double-bit ECC error)" in body
    daemon.wait_message(lambda m: m.startswith("STATUS=not ready: gpu-health: GPU 3"))
    metrics = daemon.get("/metrics")[1]
    assert any(line.startswith("DCGM_FI_DEV_XID_ERRORS{") and 'gpu="3"' in line and line.endswith(" 48.0")
               for line in metrics.splitlines())

    assert run_cli("sim", "add-process", "--gpu", "1", "--pid", "4242", "--name", "python3", root=root).returncode == 0
    _, body = daemon.wait_http("/status", lambda _, b: bool(json.loads(b)["gpus"][1]["processes"]))
    gpu = json.loads(body)["gpus"][1]
    assert gpu["processes"] == [{"pid": 4242, "name": "python3", "used_mib": 1024.0, "sm_util": None, "pod_uid": "",
                                 "gpu_instance_id": None}]
    assert gpu["metrics"]["memory_used_mib"] == 1024 and gpu["metrics"]["memory_reserved_mib"] == 480


def test_application_xids_do_not_make_a_gpu_unhealthy(agent, root: Path) -> None:
    daemon = agent("dgx-a100")
    daemon.wait_ready()
    run_cli("sim", "inject-xid", "--gpu", "0", "--xid", "13", root=root)
    daemon.wait_http("/status", lambda _, b: json.loads(b)["gpus"][0]["xid_counts"] == {"13": 1})
    assert daemon.get("/readyz")[0] == 200


def test_a_failing_stage_is_retried_with_backoff_and_recovers(agent, root: Path) -> None:
    run_cli("--simulate", "dgx-h100", "sim", "fail", "nvmlDeviceGetCount", "--times", "2", "--error", "Unknown",
        root=root)
    daemon = agent("dgx-h100", settings={"reconcile": {"backoff_initial_seconds": 0.2}})
    assert "NVML query failed: nvmlDeviceGetCount: Unknown Error" in daemon.wait_ready()
    daemon.wait_http("/readyz", lambda status, _: status == 200, timeout=10)
    stage = json.loads(daemon.get("/status")[1])["stages"][0]
    assert stage["name"] == "driver" and stage["state"] == "ok"
    assert "nvmlDeviceGetCount: Unknown Error" in stage["last_error"]


def test_a_hung_driver_fails_readiness_but_not_the_daemon(agent, root: Path) -> None:
    # 1 s, not less: a sample of one GPU is one batch of calls, and a loaded test machine can take a few
    # hundred ms over it, which a shorter timeout would call a hang long after `sim clear`. The driver stage
    # fails while NVML hangs; retries at most 1 s apart see it pass soon after `sim clear` however long the hang
    # lasted (the default backoff reaches 10 s after two failures, which a loaded machine met).
    daemon = agent("dgx-h100", settings={"nvml": {"call_timeout_seconds": 1.0},
                                         "metrics": {"sample_interval_seconds": 0.2},
                                         "reconcile": {"backoff_initial_seconds": 0.2, "backoff_max_seconds": 1}})
    daemon.wait_ready()
    run_cli("sim", "fail", "nvmlDeviceGetTemperature", "--error", "hang", root=root)
    _, body = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert "[-]gpu-health failed: NVML call nvmlDeviceGetTemperature" in body and "(the driver looks hung)" in body
    assert daemon.get("/healthz")[0] == 200
    run_cli("sim", "clear", root=root)
    daemon.wait_http("/readyz", lambda status, _: status == 200)
    assert "gpu_agent_nvml_call_timeouts_total 1.0" in daemon.get("/metrics")[1]


def test_watchdog_pings_again_and_again_when_systemd_asks(agent) -> None:
    daemon = agent("t4", env={"WATCHDOG_USEC": "400000"})
    daemon.wait_ready()
    daemon.messages.clear()
    daemon.wait_message(lambda m: m == "WATCHDOG=1")
    daemon.messages.clear()
    daemon.wait_message(lambda m: m == "WATCHDOG=1")


def test_status_command_reads_the_daemon_over_its_unix_socket(agent, root: Path) -> None:
    daemon = agent("a30", settings={"http": {"listen": ""}})
    daemon.wait_ready()
    result = cli("status", root=root, config=daemon.config)
    assert result.returncode == 0, result.stderr
    assert "ready: 1x A30, driver 550.90.07" in result.stdout and re.search(r"^discovery +ok", result.stdout, re.M)
    as_json = cli("status", "--json", root=root, config=daemon.config)
    assert json.loads(as_json.stdout)["gpus"][0]["product"] == "NVIDIA A30"
    daemon.stop()
    gone = cli("status", root=root, config=daemon.config)
    assert gone.returncode == 1 and "not running" in gone.stderr


def test_status_wait_times_out_with_exit_2_when_not_ready(agent, root: Path) -> None:
    daemon = agent("none")
    daemon.wait_ready()
    result = cli("status", "--wait", "--timeout", "1", root=root, config=daemon.config)
    assert result.returncode == 2 and "not ready: driver: no NVIDIA GPU was found" in result.stdout


def test_apply_once_runs_one_pass_and_refuses_to_race_the_daemon(agent, root: Path, write_config) -> None:
    once = cli("--simulate", "dgx-a100", "apply", "--once", root=root)
    assert once.returncode == 0 and "[+] discovery: ok: 8x A100-SXM4-40GB, driver 550.90.07" in once.stdout
    daemon = agent("dgx-a100")
    daemon.wait_ready()
    racing = cli("--simulate", "dgx-a100", "apply", "--once", root=root)
    assert racing.returncode == 1 and f"another gpu-agent (pid {daemon.proc.pid})" in racing.stderr
    dry = cli("--simulate", "dgx-a100", "apply", "--once", "--dry-run", root=root)
    assert dry.returncode == 0 and "dry run: 0 change(s) planned, nothing changed" in dry.stdout


def test_check_reports_and_exits_2_without_a_gpu(root: Path) -> None:
    result = cli("--simulate", "none", "check", root=root)
    assert result.returncode == 2
    assert "[-] driver: no NVIDIA GPU was found on the PCI bus" in result.stdout
    assert cli("--simulate", "t4", "apply", "--once", root=root).returncode == 0
    ok = cli("--simulate", "t4", "check", root=root)
    assert ok.returncode == 0 and "[+] discovery: 1x Tesla T4, driver 550.90.07" in ok.stdout


def test_environment_variables_stand_in_for_flags(root: Path, write_config) -> None:
    config = write_config()
    assert cli("--simulate", "a30", "apply", "--once", root=root).returncode == 0
    result = cli("check", root=root, env={"GPU_AGENT_SIMULATE": "a30", "GPU_AGENT_CONFIG": str(config),
                                          "GPU_AGENT_ROOT": str(root)})
    assert result.returncode == 0 and str(config) in result.stdout and "1x A30" in result.stdout


def test_a_squatter_on_the_tcp_port_never_stops_the_agent_from_starting_serving_or_becoming_ready(
        agent, root: Path, write_config) -> None:
    """The issue's reproduction: a local user binds 127.0.0.1:9445 in the second between a stop and a start.
    Before, every start exited 1 with "Address already in use" and the unit restarted it forever; now the
    agent starts, is ready, serves on its unix socket, and says in /status and its log that TCP is not
    served. The squatter answers as a ready agent would: `status --wait` asks the unix socket only."""
    import socket as socketlib

    squatter = socketlib.socket()
    squatter.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", write_config.port))
    squatter.listen(8)
    try:
        daemon = agent("t4")
        assert "STATUS=ready: 1x Tesla T4" in daemon.wait_ready()
        waited = cli("status", "--wait", "--timeout", "30", root=root, config=daemon.config)
        assert waited.returncode == 0 and "ready: 1x Tesla T4" in waited.stdout, waited.stderr
        error = f"cannot serve HTTP on 127.0.0.1:{write_config.port} (http.listen): Address already in use"
        assert f"http: {error}" in waited.stdout
        document = json.loads(cli("status", "--json", root=root, config=daemon.config).stdout)
        assert document["ready"] is True and document["http"]["error"].startswith(error)
        assert daemon.stop() == 0
    finally:
        squatter.close()
    log = daemon.output()
    assert log.count(error) == 1 and "Traceback" not in log, log[-3000:]


def test_sigterm_exits_cleanly_with_an_nvml_call_still_hung(agent, root: Path) -> None:
    # 1 s, not less: a sample of one GPU is one batch of calls, and a loaded test machine can take a few
    # hundred ms over it, which a shorter timeout would call a hang long after `sim clear`
    daemon = agent("dgx-h100", settings={"nvml": {"call_timeout_seconds": 1.0},
                                         "metrics": {"sample_interval_seconds": 0.2}})
    daemon.wait_ready()
    run_cli("sim", "fail", "nvmlDeviceGetTemperature", "--error", "hang", root=root)
    daemon.wait_http("/readyz", lambda status, _: status == 503)
    assert daemon.stop(timeout=10) == 0  # the call hangs until `sim clear`: the exit does not wait for it


def test_an_unreadable_config_on_reload_keeps_the_loop_alive(agent) -> None:
    daemon = agent("t4")
    daemon.wait_ready()
    daemon.config.write_bytes(b"version: v1\n\xff\xfe\n")
    daemon.messages.clear()
    daemon.signal(signal.SIGHUP)
    daemon.wait_message(lambda m: "READY=1" in m.splitlines())
    document = json.loads(daemon.get("/status")[1])
    assert "not UTF-8 text" in document["config"]["reload_error"]
    assert daemon.get("/healthz")[0] == 200


def test_the_daemons_own_use_of_a_counted_fault_does_not_skip_backoff(agent, root: Path) -> None:
    run_cli("--simulate", "t4", "sim", "fail", "nvmlSystemGetDriverVersion", "--times", "5", root=root)
    daemon = agent("t4", settings={"reconcile": {"backoff_initial_seconds": 3}})
    daemon.wait_ready()
    time.sleep(1.5)
    stage = json.loads(daemon.get("/status")[1])["stages"][0]
    assert (stage["state"], stage["failures"]) == ("failed", 1)


def test_usage_errors_exit_1_not_2(root: Path) -> None:
    assert cli("status", "--bogus", root=root).returncode == 1
    assert cli("apply", root=root).returncode == 1


def test_a_notify_socket_nobody_reads_never_blocks_the_sender(tmp_path, monkeypatch) -> None:
    import socket as socketlib

    from gpu_agent.daemon.notify import Notifier

    path = tmp_path / "notify.sock"
    receiver = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    receiver.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notifier = Notifier()
    import threading

    sender = threading.Thread(target=lambda: [notifier.status(f"line {n}") for n in range(5000)], daemon=True)
    sender.start()  # far more than the socket's queue holds
    sender.join(60)
    assert not sender.is_alive(), "a blocking send hangs once the queue is full"
    receiver.close()


def _hung_calls(root: Path) -> int:
    """Calls now held by hang faults set with --times 1: a spent hang stays listed with times 0."""
    faults = json.loads(run_cli("sim", "show", "--json", root=root).stdout)["faults"]
    return sum(1 for fault in faults if fault["error"] == "hang" and fault.get("times") == 0)


def test_sigterm_stops_while_a_stage_is_blocked_in_nvml(agent, root: Path) -> None:
    daemon = agent("dgx-h100", settings={"nvml": {"call_timeout_seconds": 120}})
    daemon.wait_ready()
    # The driver stage's next pass (the simulator's change wakes it) hangs in the driver for 120 s.
    run_cli("sim", "fail", "nvmlSystemGetDriverVersion", "--error", "hang", "--times", "1", root=root)
    deadline = time.monotonic() + 30  # a wait, generous for a loaded machine
    while _hung_calls(root) == 0:
        assert time.monotonic() < deadline, "no stage reached the hung call"
        time.sleep(0.1)
    try:
        assert daemon.stop(timeout=10) == 0  # the stage's worker thread is abandoned, not joined
    finally:
        run_cli("sim", "clear", root=root)
    assert any("STOPPING=1" in m.splitlines() for m in daemon.messages)


def test_sigterm_stops_while_an_api_request_hangs(agent, root: Path, tmp_path: Path) -> None:
    from kube_emulator import KubeEmulator

    api = KubeEmulator(tmp_path / "pki", nodes=("gpu-node-1",), hang_seconds=120).start()
    try:
        api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf", mode="cert-data")
        api.hang_next("*")
        daemon = agent("t4", settings={"kubernetes": {"node_name": "gpu-node-1", "request_timeout_seconds": 120}})
        api.wait_for_requests(1, completed=False, timeout=15)
        assert daemon.stop(timeout=10) == 0
    finally:
        api.close()


def test_a_storm_of_sighups_is_coalesced_into_a_pass_a_second(agent) -> None:
    """SIGHUPs as fast as a script sends them (the issue's 1,800 in 10 s cost 1,700 passes): those within
    a second of the last reload are one reload and one pass; the last one is never lost."""
    daemon = agent("t4")
    daemon.wait_ready()
    before = json.loads(daemon.get("/status")[1])["reconciles"]
    started = time.monotonic()
    for _ in range(300):
        daemon.signal(signal.SIGHUP)
        time.sleep(0.005)
    daemon.config.write_text(daemon.config.read_text() + "discovery:\n  expected_gpus: 7\n")
    daemon.signal(signal.SIGHUP)  # the last one: its config applies
    sent = time.monotonic() - started
    _, body = daemon.wait_http("/readyz?verbose", lambda status, _: status == 503)
    assert "expected 7 GPUs" in body
    passes = json.loads(daemon.get("/status")[1])["reconciles"] - before
    assert 1 <= passes <= sent / app.RELOAD_GAP_S + 3, (passes, sent)
    assert daemon.stop() == 0
    log = daemon.output()
    assert log.count("reloading configuration") <= sent / app.RELOAD_GAP_S + 3, log[-2000:]
