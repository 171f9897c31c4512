"""The toolkit stage against hand-written runtime configs, checked with Debian's real containerd."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import tomlkit
import yaml
from harness import Pass, SimNode, run_cli

# In-process against the simulator; Debian's containerd validates every containerd config the stage
# writes (a real process), and one test runs the daemon.
pytestmark = pytest.mark.subprocess

BINARY = "/usr/bin/nvidia-container-runtime"
CONTAINERD_V2 = """\
# Hand-written containerd config: keep me.
version = 2
root = "/var/lib/containerd"   # state lives here

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"

  # our pull-through cache
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]
    endpoint = ["https://mirror.example.internal"]

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""
CONTAINERD_V3 = """\
version = 3  # containerd 2.x

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  SystemdCgroup = true
"""
DROP_IN = "etc/containerd/conf.d/99-nvidia.toml"

needs_containerd = pytest.mark.skipif(shutil.which("containerd") is None and not os.environ.get("CI"),
                                      reason="containerd missing: .ci/run installs Debian's containerd")


@pytest.fixture
def node(root: Path) -> Path:
    """A sandbox root with the NVIDIA Container Toolkit 1.17.8 installed."""
    for binary in (BINARY, "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-ctk", "/usr/bin/nvidia-cdi-hook"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n")
    return root


def containerd_config(root: Path, text: str) -> Path:
    path = root / "etc/containerd/config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def apply(root: Path, settings: dict | None = None, dry_run: bool = False, simulate: str = "dgx-h100") -> Pass:
    """`gpu-agent apply --once [--dry-run]` on a simulated DGX H100 (or `simulate`), in this process."""
    return SimNode(root, simulate).apply(settings or {}, dry_run=dry_run)


def changes(done: Pass, stage: str = "toolkit") -> list[tuple[str, str]]:
    """The typed changes a stage made (or would make): (kind, target)."""
    return [(change.kind, getattr(change, "path", None) or getattr(change, "unit", None)
             or getattr(change, "package", None)) for change in done.changes(stage)]


def failed(done: Pass, stage: str = "toolkit") -> str:
    """The stage's message, which must be a failure's."""
    run = done.stage(stage)
    assert run.state == "failed", (run.state, run.message)
    return run.message


CONTAINERD_TRANSACTION = [("WriteFile", "/etc/containerd/config.toml"),
                          ("WriteFile", "/etc/containerd/conf.d/99-nvidia.toml"),
                          ("RestartService", "containerd.service")]


def restarts(root: Path, unit: str = "containerd.service") -> int:
    return SimNode(root, "dgx-h100").machine.read().get("services", {}).get(unit, {}).get("restarts", 0)


def effective(root: Path, tmp_path: Path) -> dict:
    """`containerd config dump` of the sandbox's files, the imports pointed into the sandbox."""
    document = tomlkit.parse((root / "etc/containerd/config.toml").read_text())
    document["imports"] = [str(root / p.lstrip("/")) for p in document["imports"]]
    copy = tmp_path / "effective.toml"
    copy.write_text(tomlkit.dumps(document))
    done = subprocess.run(["containerd", "--config", str(copy), "config", "dump"], capture_output=True, text=True,
                          timeout=60, check=True)
    return tomlkit.parse(done.stdout).unwrap()


@needs_containerd
def test_containerd_v2_gets_the_runtime_and_keeps_every_byte(node: Path, tmp_path: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    done = apply(node)
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    assert changes(done)[:3] == CONTAINERD_TRANSACTION
    after = path.read_text()
    added = 'imports = ["/etc/containerd/conf.d/*.toml"]  # added by gpu-agent\n'
    assert after.replace(added, "") == CONTAINERD_V2 and after.index(added) + len(added) == after.index("root =")
    cri = effective(node, tmp_path)["plugins"]["io.containerd.grpc.v1.cri"]
    nvidia = cri["containerd"]["runtimes"]["nvidia"]
    assert nvidia["runtime_type"] == "io.containerd.runc.v2"
    assert nvidia["options"]["BinaryName"] == BINARY and nvidia["options"]["SystemdCgroup"] is True
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9"
    assert cri["registry"]["mirrors"]["docker.io"]["endpoint"] == ["https://mirror.example.internal"]
    assert cri["containerd"]["default_runtime_name"] == "runc"
    # Debian 12's containerd 1.6 predates enable_cdi (1.7) and drops it from the dump; it is in the drop-in.
    assert tomlkit.parse((node / DROP_IN).read_text())["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is True
    assert restarts(node) == 1
    assert list((node / "var/lib/gpu-agent/backups").iterdir())[0].read_text() == CONTAINERD_V2


@needs_containerd
def test_a_second_run_changes_no_file_and_restarts_nothing(node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    apply(node)
    stamps = {p: (os.stat(node / p).st_ino, os.stat(node / p).st_mtime_ns)
              for p in ("etc/containerd/config.toml", DROP_IN)}
    again = apply(node)
    assert again.ok and not any(run.planned for run in again.runs)
    assert stamps == {p: (os.stat(node / p).st_ino, os.stat(node / p).st_mtime_ns) for p in stamps}
    assert restarts(node) == 1


@needs_containerd
def test_a_bom_and_crlf_line_ends_are_read_as_containerd_reads_them(node: Path, tmp_path: Path) -> None:
    """containerd skips a byte order mark and reads CRLF files; the line the agent adds ends as the file's
    lines do (the mark goes: tomlkit refuses it, and containerd needs no mark)."""
    path = node / "etc/containerd/config.toml"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xef\xbb\xbf" + CONTAINERD_V2.replace("\n", "\r\n").encode())
    done = apply(node)
    assert done.ok, failed(done)
    after = path.read_bytes()
    assert after.count(b"\n") == after.count(b"\r\n") and not after.startswith(b"\xef\xbb\xbf")
    assert b'imports = ["/etc/containerd/conf.d/*.toml"]  # added by gpu-agent\r\n' in after
    assert effective(node, tmp_path)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    assert not any(run.planned for run in apply(node).runs)


def test_containerd_v3_v4_and_v1_drop_ins_keep_their_versions(node: Path) -> None:
    containerd_config(node, CONTAINERD_V3)
    assert apply(node).ok
    drop_in = tomlkit.parse((node / DROP_IN).read_text()).unwrap()
    assert drop_in["version"] == 3
    runtime = drop_in["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"]
    assert runtime["options"] == {"SystemdCgroup": True, "BinaryName": BINARY}

    # Version 4 (containerd 2.3 and later; v2.4.2's own default): the CRI's tables where version 3 has them.
    containerd_config(node, CONTAINERD_V3.replace("version = 3  # containerd 2.x", "version = 4  # containerd 2.3"))
    assert apply(node).ok
    drop_in = tomlkit.parse((node / DROP_IN).read_text()).unwrap()
    assert drop_in["version"] == 4
    runtime = drop_in["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"]
    assert runtime["options"] == {"SystemdCgroup": True, "BinaryName": BINARY}

    containerd_config(node, '[plugins.cri.containerd.runtimes.runc]\n  runtime_type = "io.containerd.runc.v2"\n')
    assert apply(node).ok
    drop_in = tomlkit.parse((node / DROP_IN).read_text()).unwrap()
    assert "version" not in drop_in and "nvidia" in drop_in["plugins"]["cri"]["containerd"]["runtimes"]


def test_a_broken_root_config_fails_naming_file_and_line_and_writes_nothing(node: Path) -> None:
    broken = CONTAINERD_V2.replace('sandbox_image = "registry.k8s.io/pause:3.9"', "sandbox_image = ")
    path = containerd_config(node, broken)
    message = failed(apply(node))
    assert message.startswith("/etc/containerd/config.toml:6:") and "nothing was changed" in message
    assert path.read_text() == broken and not (node / DROP_IN).exists()


@pytest.mark.parametrize("error, words", [("failed", "systemctl restart containerd.service failed"),
                                          ("not-ready", "no answer on /run/containerd/containerd.sock")])
def test_a_runtime_that_does_not_come_back_gets_its_files_back(node: Path, error: str, words: str) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    SimNode(node, "dgx-h100").sim("fail", "restart", "--unit", "containerd.service", "--error", error, "--times", "1")
    message = failed(apply(node))
    assert f"containerd: {words}" in message and "the previous files are restored" in message
    assert path.read_text() == CONTAINERD_V2 and not (node / DROP_IN).exists()
    assert restarts(node) == 2  # the failed one, and one on the restored files


def test_docker_daemon_json_is_merged_keeping_every_other_key(node: Path) -> None:
    daemon = node / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text(json.dumps({"log-driver": "journald", "features": {"buildkit": True},
                                  "runtimes": {"kata": {"path": "/usr/bin/kata-runtime"}}}))
    assert apply(node).ok
    merged = json.loads(daemon.read_text())
    assert merged["log-driver"] == "journald" and merged["runtimes"]["kata"] == {"path": "/usr/bin/kata-runtime"}
    assert merged["features"] == {"buildkit": True, "cdi": True}
    assert merged["runtimes"]["nvidia"] == {"path": BINARY, "args": []} and "default-runtime" not in merged
    assert restarts(node, "docker.service") == 1


def test_docker_default_runtime_only_when_asked(node: Path) -> None:
    daemon = node / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text("{}\n")
    assert apply(node, {"toolkit": {"set_as_default": True, "cdi": {"enabled": False}}}).ok
    merged = json.loads(daemon.read_text())
    assert merged["default-runtime"] == "nvidia" and "features" not in merged


def test_crio_drop_in_inherits_the_default_runtime(node: Path) -> None:
    conf = node / "etc/crio/crio.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text('[crio.runtime]\ndefault_runtime = "crun"\n[crio.runtime.runtimes.crun]\n'
                    'runtime_path = "/usr/bin/crun"\nmonitor_path = "/usr/libexec/crio/conmon"\n')
    assert apply(node).ok
    drop_in = tomlkit.parse((node / "etc/crio/crio.conf.d/99-nvidia.conf").read_text()).unwrap()
    assert drop_in == {"crio": {"runtime": {"runtimes": {"nvidia": {
        "runtime_path": BINARY, "runtime_type": "oci", "monitor_path": "/usr/libexec/crio/conmon"}}}}}
    assert restarts(node, "crio.service") == 1


def test_no_runtime_means_nothing_to_do(root: Path) -> None:
    toolkit = SimNode(root, "t4").apply().stage("toolkit")
    assert (toolkit.state, toolkit.message, toolkit.planned) == (
        "ok", "no container runtime found (containerd, Docker, CRI-O): nothing to configure", [])


def test_a_missing_or_vulnerable_toolkit_is_refused(root: Path, node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    (node / BINARY.lstrip("/")).unlink()
    missing = failed(apply(node))
    assert "the NVIDIA Container Toolkit is not installed (/usr/bin/nvidia-container-runtime missing)" in missing
    (node / BINARY.lstrip("/")).write_text("#!/bin/sh\n")
    (node / "var/lib/dpkg/status").write_text(
        "Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.16.2-1\n\n")
    old = failed(apply(node))
    assert "1.16.2 is older than 1.17.8" in old and "CVE-2025-23266" in old
    assert not (node / DROP_IN).exists()


def test_dry_run_prints_the_diffs_and_the_restart_and_changes_nothing(node: Path, write_config) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    apply(node, {"toolkit": {"enabled": False}})  # the driver up, the runtimes untouched
    assert changes(apply(node, {"toolkit": {"enabled": True}}, dry_run=True))[:3] == CONTAINERD_TRANSACTION
    # The command's output (in this process): the diffs, indented under the planned change.
    result = run_cli("--simulate", "dgx-h100", "apply", "--once", "--dry-run", root=node,
                     config=write_config({"toolkit": {"enabled": True}}))
    assert result.returncode == 2 and "    would: " in result.stdout
    assert '    +imports = ["/etc/containerd/conf.d/*.toml"]  # added by gpu-agent' in result.stdout
    assert "    +++ /etc/containerd/conf.d/99-nvidia.toml" in result.stdout
    assert path.read_text() == CONTAINERD_V2 and not (node / DROP_IN).exists() and restarts(node) == 0


def test_runtime_config_keys_are_set_and_the_rest_kept(node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    toml = node / "etc/nvidia-container-runtime/config.toml"
    toml.parent.mkdir(parents=True)
    toml.write_text('# shipped by the toolkit\n[nvidia-container-runtime]\nlog-level = "info"  # keep\n')
    assert apply(node, {"toolkit": {"runtime_config": {"nvidia-container-runtime.mode": "cdi"}}}).ok
    assert toml.read_text() == ('# shipped by the toolkit\n[nvidia-container-runtime]\nlog-level = "info"  # keep\n'
                                'mode = "cdi"\n')


def test_runtime_config_keys_the_config_stops_naming_are_undone(node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    toml = node / "etc/nvidia-container-runtime/config.toml"
    toml.parent.mkdir(parents=True)
    shipped = '[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\n\n[nvidia-container-runtime]\nlog-level = "info"\n'
    toml.write_text(shipped)

    def with_keys(keys: dict) -> str:  # fifteen passes: on one T4, the GPUs do not matter here
        for _ in range(2):  # the owned-files stage forgets, the pass after, a file whose keys all went back
            done = apply(node, {"toolkit": {"runtime_config": keys}}, simulate="t4")
            assert done.ok, failed(done)
        again = apply(node, {"toolkit": {"runtime_config": keys}}, simulate="t4")
        assert not any(run.planned for run in again.runs), [(r.stage, r.planned) for r in again.runs if r.planned]
        return toml.read_text()

    both = with_keys({"nvidia-container-runtime.debug": "/var/log/a.log",
                      "nvidia-container-runtime.log-level": "debug"})
    assert 'debug = "/var/log/a.log"' in both and 'log-level = "debug"' in both
    moved = with_keys({"nvidia-container-cli.debug": "/var/log/a.log", "nvidia-container-runtime.log-level": "debug"})
    assert moved == ('[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\ndebug = "/var/log/a.log"\n\n'
                     '[nvidia-container-runtime]\nlog-level = "debug"\n')  # the old key gone, not left behind
    assert with_keys({"nvidia-container-runtime.log-level": "debug"}) == shipped.replace('"info"', '"debug"')
    assert with_keys({"new-table.key": 1}) == shipped + "\n[new-table]\nkey = 1\n"  # log-level back to "info"
    assert with_keys({}) == shipped  # nothing asked: the file as the toolkit shipped it
    assert not (node / "var/lib/gpu-agent/runtime-config-keys.json").exists()


def test_runtime_config_keys_someone_else_changed_are_kept(node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    toml = node / "etc/nvidia-container-runtime/config.toml"
    toml.parent.mkdir(parents=True)
    toml.write_text('[nvidia-container-runtime]\nlog-level = "info"\n')
    assert apply(node, {"toolkit": {"runtime_config": {"nvidia-container-runtime.mode": "cdi"}}}).ok
    toml.write_text(toml.read_text() + 'runtimes = ["runc"]\n')  # an admin's edit since
    assert apply(node, {"toolkit": {"runtime_config": {"nvidia-container-runtime.debug": "/x.log"}}}).ok
    assert toml.read_text() == '[nvidia-container-runtime]\nlog-level = "info"\nruntimes = ["runc"]\ndebug = "/x.log"\n'


@pytest.mark.parametrize("record", ["not json", '["a"]', '{"a": 1}', '{"a": {"value": 1, "extra": 2}}', "{" * 100_000])
def test_a_runtime_config_record_not_written_by_the_agent_is_named(node: Path, record: str) -> None:
    containerd_config(node, CONTAINERD_V2)
    path = node / "var/lib/gpu-agent/runtime-config-keys.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record)
    done = apply(node, {"toolkit": {"runtime_config": {"nvidia-container-runtime.mode": "cdi"}}})
    assert "/var/lib/gpu-agent/runtime-config-keys.json: not the record of runtime config keys" in failed(done)
    assert path.read_text() == record and not (node / "etc/nvidia-container-runtime/config.toml").exists()
    assert (node / DROP_IN).exists() and restarts(node) == 1  # containerd's own change is not held up


def test_drift_is_repaired_by_the_running_daemon(agent, node: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    daemon = agent("dgx-h100")
    daemon.wait_ready()
    assert "imports" in path.read_text()
    path.write_text(CONTAINERD_V2)  # another tool rewrote the file
    deadline = time.monotonic() + 10  # a wait: the drift watch repairs it, the periodic pass is a minute away
    while "imports" not in path.read_text():
        assert time.monotonic() < deadline, "the import line was not restored within 10 s"
        time.sleep(0.1)


def test_the_cdi_spec_is_written_kept_and_follows_mig_changes(node: Path) -> None:
    from gpu_agent.host.paths import Root
    from gpu_agent.sim.machine import MachineState
    from gpu_agent.sim.mig import add_device
    from gpu_agent.sim.profiles import H100_80GB_HBM3

    containerd_config(node, CONTAINERD_V2)
    assert apply(node).ok
    spec_path = node / "var/run/cdi/nvidia.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    assert {"0", "7", "all"} <= {device["name"] for device in spec["devices"]}
    stamp = (spec_path.stat().st_ino, spec_path.stat().st_mtime_ns)
    assert not any(run.planned for run in apply(node).runs)
    assert (spec_path.stat().st_ino, spec_path.stat().st_mtime_ns) == stamp

    with MachineState(Root(node)).edit() as state:  # mig-parted (or an admin) repartitioned GPU 0
        gpu = state["gpus"][0]
        gpu["mig"] = {"current": 1, "pending": 1, "gpu_instances": []}
        add_device(gpu, H100_80GB_HBM3, "3g.40gb")
        mig_uuid = gpu["mig"]["gpu_instances"][0]["compute_instances"][0]["uuid"]
    assert changes(apply(node), "cdi") == [("WriteFile", "/var/run/cdi/nvidia.yaml")]
    spec = yaml.safe_load(spec_path.read_text())
    assert {"0:0", mig_uuid} <= {device["name"] for device in spec["devices"]}


def test_the_cdi_spec_written_through_the_toolkit_stage_is_valid_cdi(node: Path) -> None:
    from test_cdi import schema_validator

    containerd_config(node, CONTAINERD_V2)
    assert apply(node).ok
    schema_validator().validate(yaml.safe_load((node / "var/run/cdi/nvidia.yaml").read_text()))


def test_the_cdi_spec_goes_through_var_run_linked_to_run(node: Path) -> None:
    """Debian, Ubuntu and RHEL make /var/run an absolute link to /run: the spec is written there, once."""
    containerd_config(node, CONTAINERD_V2)
    (node / "run").mkdir()
    (node / "var/run").symlink_to("/run")
    first = apply(node)
    assert first.ok, failed(first, "cdi")
    assert (node / "var/run").is_symlink() and yaml.safe_load((node / "run/cdi/nvidia.yaml").read_text())["devices"]
    assert not any(run.planned for run in apply(node).runs)


def test_a_missing_toolkit_is_installed_when_asked(root: Path) -> None:
    containerd_config(root, CONTAINERD_V2)
    settings = {"toolkit": {"install": True}}
    SimNode(root, "dgx-h100").sim("fail", "install", "--times", "1")
    assert "E: Unable to locate package nvidia-container-toolkit" in failed(apply(root, settings))
    done = apply(root, settings)
    assert done.ok, done.stage("toolkit").message
    assert changes(done)[0] == ("InstallPackage", "nvidia-container-toolkit")
    assert ("WriteFile", "/etc/containerd/config.toml") in changes(done)
    assert "nvidia runtime configured for containerd; toolkit 1.17.8" in done.stage("toolkit").message


def test_a_root_file_without_runc_keeps_runc_through_the_drop_in(node: Path, tmp_path: Path) -> None:
    containerd_config(node, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x/pause:1"\n')
    assert apply(node).ok
    drop_in = tomlkit.parse((node / DROP_IN).read_text()).unwrap()["plugins"]["io.containerd.grpc.v1.cri"]
    assert drop_in["containerd"]["runtimes"]["runc"] == {"runtime_type": "io.containerd.runc.v2"}
    if shutil.which("containerd"):
        runtimes = effective(node, tmp_path)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
        assert {"runc", "nvidia"} <= set(runtimes)


def test_dormant_conf_d_files_are_not_switched_on(node: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    dormant = node / "etc/containerd/conf.d/50-mirrors.toml"
    dormant.parent.mkdir(parents=True)
    dormant.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "other"\n')
    assert "would also switch on /etc/containerd/conf.d/50-mirrors.toml" in failed(apply(node))
    assert path.read_text() == CONTAINERD_V2 and not (node / DROP_IN).exists() and restarts(node) == 0


def test_v3_imports_merge_key_by_key(node: Path) -> None:
    containerd_config(node, 'version = 3\nimports = ["/etc/containerd/extra/*.toml"]\n'
                            '[plugins."io.containerd.cri.v1.runtime".containerd]\n  default_runtime_name = "crun"\n'
                            '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.crun.options]\n'
                            '  SystemdCgroup = true\n')
    extra = node / "etc/containerd/extra/10-site.toml"
    extra.parent.mkdir(parents=True)
    extra.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n  enable_selinux = true\n')
    assert apply(node).ok
    cri = tomlkit.parse((node / DROP_IN).read_text()).unwrap()["plugins"]["io.containerd.cri.v1.runtime"]
    assert cri["containerd"]["runtimes"]["nvidia"]["options"] == {"SystemdCgroup": True, "BinaryName": BINARY}
    assert cri["enable_selinux"] is True


def test_file_modes_and_owners_are_kept(node: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    path.chmod(0o600)
    os.chown(path, 0, 4)
    assert apply(node).ok
    assert (path.stat().st_mode & 0o777, path.stat().st_gid) == (0o600, 4)
    assert (node / DROP_IN).stat().st_mode & 0o777 == 0o600  # it copies the CRI table, credentials included


def test_a_write_that_fails_midway_restores_what_was_written(node: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2)
    (node / "etc/containerd/conf.d").write_text("not a directory")
    message = failed(apply(node))
    assert "containerd: cannot write" in message
    assert "the previous files are restored" in message and path.read_text() == CONTAINERD_V2


def test_docker_odd_json_is_a_clear_error_and_our_default_is_undone(node: Path) -> None:
    daemon = node / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{"features": ["cdi"]}')
    assert "/etc/docker/daemon.json: features: expected an object" in failed(apply(node))
    daemon.write_text("{}")
    apply(node, {"toolkit": {"set_as_default": True}})
    assert json.loads(daemon.read_text())["default-runtime"] == "nvidia"
    apply(node, {"toolkit": {"set_as_default": False}})
    assert "default-runtime" not in json.loads(daemon.read_text())


# What containerd v2.4.2 answers for a version 2 file (seen in tests/e2e/cluster, Debian 13's root config with
# the agent's drop-in): `config dump` migrates it and prints its own layout, version 4, the runtimes under the
# CRI's runtime plugin, runc's default options spelled out and the nvidia runtime's as the drop-in wrote them.
CONTAINERD_2_4_DUMP = """\
version = 4
imports = ['/etc/containerd/conf.d/*.toml']

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']

    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]
          runtime_type = 'io.containerd.runc.v2'

          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]
            BinaryName = '/usr/bin/nvidia-container-runtime'

        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'

          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            BinaryName = ''
            SystemdCgroup = false
"""


def test_containerd_2_reads_a_version_2_file_and_dumps_its_own_layout(node: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of the result reads the dump in the layout containerd printed, not the file's; an option
    the nvidia runtime does not name (SystemdCgroup) is its default, as runc's false."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dump.toml").write_text(CONTAINERD_2_4_DUMP)
    fake = bin_dir / "containerd"
    fake.write_text('#!/bin/sh\ncase "$*" in *--version*) echo "containerd github.com/containerd/containerd/v2 '
                    f'v2.4.2 ";; *"config dump"*) cat {bin_dir / "dump.toml"};; *) exit 1;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    debian = CONTAINERD_V2.replace("SystemdCgroup = true", "SystemdCgroup = false")
    containerd_config(node, debian)
    done = apply(node)
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    assert changes(done)[:3] == CONTAINERD_TRANSACTION
    # The same dump without the nvidia runtime: the check still finds what is missing.
    (bin_dir / "dump.toml").write_text(CONTAINERD_2_4_DUMP.replace("'/usr/bin/nvidia-container-runtime'", "''"))
    containerd_config(node, debian)
    (node / DROP_IN).unlink()
    assert "containerd's effective config has no nvidia runtime running" in failed(apply(node))


# --- drop-in versions and imports (issue 36: containerd drop-ins that break the runtime) ------------------


def test_the_drop_in_takes_the_root_configs_version_whichever_way_it_changes(node: Path) -> None:
    """Never newer than the root (containerd 1.x refuses 3, 2.0 to 2.2 refuse 4), and regenerated when the root
    moves either way."""
    for root_version, text in ((3, CONTAINERD_V3), (2, CONTAINERD_V2), (3, CONTAINERD_V3)):
        containerd_config(node, text)
        done = apply(node)
        assert done.ok, failed(done)
        assert tomlkit.parse((node / DROP_IN).read_text())["version"] == root_version


def test_an_imported_file_newer_than_the_root_is_refused_naming_it(node: Path) -> None:
    path = containerd_config(node, CONTAINERD_V2.replace("version = 2\n", 'version = 2\nimports = '
                                                         '["/etc/containerd/conf.d/*.toml"]\n'))
    site = node / "etc/containerd/conf.d/10-site.toml"
    site.parent.mkdir(parents=True)
    site.write_text('version = 3\n[plugins."io.containerd.cri.v1.images"]\n  snapshotter = "overlayfs"\n')
    message = failed(apply(node))
    assert message.startswith("/etc/containerd/conf.d/10-site.toml:1: version: version 3 is newer than the root "
                              "config's /etc/containerd/config.toml (version 2)") and "nothing was changed" in message
    assert not (node / DROP_IN).exists() and "imports" in path.read_text() and restarts(node) == 0
    site.write_text("version = 2\n")
    assert apply(node).ok


def test_a_drop_in_nvidia_ctk_wrote_newer_than_the_root_is_replaced_in_the_roots_version(node: Path) -> None:
    """nvidia-ctk's drop-in has the agent's name: it is rewritten in the root's version, its original kept."""
    containerd_config(node, CONTAINERD_V2.replace("version = 2\n", 'version = 2\nimports = '
                                                  '["/etc/containerd/conf.d/*.toml"]\n'))
    theirs = 'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]\n  runtime_type = "x"\n'
    (node / DROP_IN).parent.mkdir(parents=True)
    (node / DROP_IN).write_text(theirs)
    assert apply(node).ok
    assert tomlkit.parse((node / DROP_IN).read_text())["version"] == 2
    assert SimNode(node, "dgx-h100").uninstall().ok and (node / DROP_IN).read_text() == theirs


def test_imports_are_kept_globs_and_relative_paths_included(node: Path) -> None:
    root_text = CONTAINERD_V2.replace("version = 2\n", 'version = 2\nimports = ["/etc/containerd/certs.d/*.toml", '
                                      '"site.toml"]\n')
    path = containerd_config(node, root_text)
    (node / "etc/containerd/certs.d").mkdir()
    (node / "etc/containerd/certs.d/a.toml").write_text("version = 2\n")
    (node / "etc/containerd/site.toml").write_text("version = 2\n")
    assert apply(node).ok
    document = tomlkit.parse(path.read_text())
    assert document["imports"] == ["/etc/containerd/certs.d/*.toml", "site.toml", "/etc/containerd/conf.d/*.toml"]
    assert path.read_text().replace(', "/etc/containerd/conf.d/*.toml"', "") == root_text
    other = node / "etc/containerd/conf.d/50-other.toml"  # another tool's drop-in, beside the agent's
    other.write_text("version = 2\n")
    assert apply(node).ok and other.read_text() == "version = 2\n"
    assert tomlkit.parse(path.read_text())["imports"] == document["imports"]


@pytest.mark.parametrize("written", ['"/etc/containerd/conf.d/*"', '"conf.d/99-nvidia.toml"'])
def test_an_import_that_already_leads_to_the_drop_in_leaves_the_root_as_it_is(node: Path, written: str) -> None:
    root_text = CONTAINERD_V2.replace("version = 2\n", f"version = 2\nimports = [{written}]\n")
    path = containerd_config(node, root_text)
    done = apply(node)
    assert done.ok, failed(done)
    assert path.read_text() == root_text and (node / DROP_IN).exists()
    assert ("WriteFile", "/etc/containerd/config.toml") not in changes(done)


# --- a drop-in nvidia-ctk wrote at the agent's path (nvidia-ctk runtime configure, 1.18+: cmd/nvidia-ctk/runtime/
# configure/configure.go at v1.20.0, f0c382c8, writes /etc/containerd/conf.d/99-nvidia.toml and
# /etc/crio/crio.conf.d/99-nvidia.toml) ----------------------------------------------------------------------


def as_nvidia_ctk(ours: str, binary: str = BINARY) -> str:
    """The agent's drop-in as nvidia-ctk would write it: no header, an extra key of its own in the runtime."""
    from gpu_agent.toolkit.containerd import HEADER

    document = tomlkit.parse(ours.replace(HEADER, ""))
    runtime = document["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    runtime["privileged_without_host_devices"] = False
    runtime["options"]["BinaryName"] = binary
    return tomlkit.dumps(document)


def test_a_sufficient_nvidia_ctk_drop_in_is_recognised_and_never_rewritten(node: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    assert apply(node).ok
    theirs = as_nvidia_ctk((node / DROP_IN).read_text())
    (node / DROP_IN).write_text(theirs)  # nvidia-ctk runtime configure, run after the agent
    for _ in range(2):  # no turn taking: the agent leaves it, pass after pass
        done = apply(node)
        assert done.ok and ("WriteFile", "/" + DROP_IN) not in changes(done)
        assert (node / DROP_IN).read_text() == theirs
    assert restarts(node) == 1
    gone = SimNode(node, "dgx-h100").uninstall()
    message = gone.stage("owned-files").message
    assert "changed since gpu-agent wrote them: /etc/containerd/conf.d/99-nvidia.toml" in message
    assert (node / DROP_IN).read_text() == theirs


def test_an_nvidia_ctk_drop_in_running_another_binary_is_replaced_and_put_back(node: Path, tmp_path: Path) -> None:
    containerd_config(node, CONTAINERD_V2)
    assert apply(node).ok
    ours = (node / DROP_IN).read_text()
    (node / "var/lib/gpu-agent/ledger.json").unlink()  # as if nvidia-ctk's came first
    shutil.rmtree(node / "var/lib/gpu-agent/originals")
    theirs = as_nvidia_ctk(ours, "/usr/local/nvidia/toolkit/nvidia-container-runtime")
    (node / DROP_IN).write_text(theirs)
    done = apply(node)
    assert done.ok and ("WriteFile", "/" + DROP_IN) in changes(done) and (node / DROP_IN).read_text() == ours
    assert SimNode(node, "dgx-h100").uninstall().ok and (node / DROP_IN).read_text() == theirs


CRIO_NVIDIA_CTK = '[crio.runtime.runtimes.nvidia]\nruntime_path = "{binary}"\nruntime_type = "oci"\n'


def test_crio_gets_no_drop_in_of_the_agents_where_nvidia_ctks_gives_the_runtime(node: Path) -> None:
    (node / "etc/crio/crio.conf.d").mkdir(parents=True)
    (node / "etc/crio/crio.conf").write_text('[crio.runtime]\ndefault_runtime = "crun"\n')
    done = apply(node, {"toolkit": {"runtimes": ["crio"]}})
    assert done.ok and (node / "etc/crio/crio.conf.d/99-nvidia.conf").exists()
    theirs = node / "etc/crio/crio.conf.d/99-nvidia.toml"
    theirs.write_text(CRIO_NVIDIA_CTK.format(binary=BINARY))
    done = apply(node, {"toolkit": {"runtimes": ["crio"]}})
    assert done.ok, [(run.stage, run.message) for run in done.runs]
    assert ("RemoveFile", "/etc/crio/crio.conf.d/99-nvidia.conf") in changes(done, "owned-files")
    assert not (node / "etc/crio/crio.conf.d/99-nvidia.conf").exists()
    again = apply(node, {"toolkit": {"runtimes": ["crio"]}})
    assert again.ok and not any(run.planned for run in again.runs)


def test_crio_names_an_nvidia_ctk_drop_in_that_would_override_the_agents(node: Path) -> None:
    (node / "etc/crio/crio.conf.d").mkdir(parents=True)
    theirs = node / "etc/crio/crio.conf.d/99-nvidia.toml"
    theirs.write_text(CRIO_NVIDIA_CTK.format(binary="/usr/local/nvidia/toolkit/nvidia-container-runtime"))
    message = failed(apply(node, {"toolkit": {"runtimes": ["crio"]}}))
    assert ("/etc/crio/crio.conf.d/99-nvidia.toml (nvidia-ctk runtime configure writes one there) is read after "
            "gpu-agent's /etc/crio/crio.conf.d/99-nvidia.conf and sets the nvidia runtime's runtime_path "
            "otherwise") in message
    assert not (node / "etc/crio/crio.conf.d/99-nvidia.conf").exists()
