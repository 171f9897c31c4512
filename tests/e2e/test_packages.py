"""The .deb installed and run under a real, booted systemd; the .rpm checked with rpm itself."""
from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import Container, run

DROP_IN = "/etc/systemd/system/gpu-agent.service.d/simulate.conf"


PYTHONS = {"deb": "3.11", "deb13": "3.13", "rpm": "3.9"}
# What rpmlint still reports, each explained in packaging/README.md ("What the linters still say").
RPMLINT_EXPLAINED = {"no-signature", "invalid-url", "invalid-license", "manpage-not-compressed",
                     "no-manual-page-for-binary"}


@pytest.mark.parametrize("deb", ["deb", "deb13"])
def test_deb_is_lintian_clean(packages: dict[str, Path], deb: str) -> None:
    result = run(["lintian", "--tag-display-limit", "0", str(packages[deb])], check=False, timeout=600)
    tags = [line for line in result.stdout.splitlines() if line.startswith(("E:", "W:"))]
    assert tags == [], "\n".join(tags)


def test_rpm_has_only_the_rpmlint_findings_the_readme_explains(packages: dict[str, Path]) -> None:
    result = run(["rpmlint", str(packages["rpm"])], check=False, timeout=600)
    found = re.findall(r"^gpu-agent\.x86_64: [EW]: (\S+)", result.stdout, re.M)
    assert found and set(found) <= RPMLINT_EXPLAINED, result.stdout
    errors = re.findall(r"^gpu-agent\.x86_64: E: (\S+)", result.stdout, re.M)
    assert errors == ["no-signature"], result.stdout


def test_install_enables_per_preset_but_does_not_start(container: Container) -> None:
    container.exec("dpkg", "-i", "/root/gpu-agent.deb")
    assert container.exec("systemctl", "is-enabled", "gpu-agent").stdout.strip() == "enabled"
    assert container.exec("systemctl", "is-active", "gpu-agent", check=False).stdout.strip() == "inactive"
    assert container.exec("systemd-analyze", "verify", "gpu-agent.service").returncode == 0
    conffiles = container.exec("cat", "/var/lib/dpkg/info/gpu-agent.conffiles").stdout.split()
    assert conffiles == ["/etc/gpu-agent/config.yaml", "/etc/gpu-agent/mig.yaml"]
    # postinst compiled the bytecode for the installed python3 (3.11 on Debian 12), so the daemon starts from it
    assert container.exec("ls", "/usr/lib/gpu-agent").stdout.split() == ["gpu_agent", "site-cp311"]
    for directory in ("gpu_agent", "site-cp311"):
        found = container.sh(f"find /usr/lib/gpu-agent/{directory} -name '*.cpython-311.pyc' | head -1").stdout
        assert found.strip(), f"no bytecode under /usr/lib/gpu-agent/{directory}"


def test_without_a_gpu_the_unit_is_active_alive_and_not_ready(container: Container) -> None:
    container.exec("systemctl", "start", "gpu-agent")
    assert container.exec("systemctl", "is-active", "gpu-agent").stdout.strip() == "active"
    assert container.exec("curl", "-fsS", "127.0.0.1:9445/healthz").stdout == "ok\n"
    readyz = container.exec("curl", "-sS", "-w", "%{http_code}", "127.0.0.1:9445/readyz?verbose").stdout
    assert readyz.endswith("503")
    assert "[-]driver failed: no NVIDIA GPU was found on the PCI bus" in readyz
    status = container.exec("systemctl", "status", "gpu-agent", "--no-pager", check=False).stdout
    assert 'Status: "not ready: driver: no NVIDIA GPU was found on the PCI bus' in status


def test_with_simulated_gpus_it_is_ready_and_says_so(container: Container) -> None:
    container.sh(f"mkdir -p {Path(DROP_IN).parent} && "
                 f"printf '[Service]\\nEnvironment=GPU_AGENT_SIMULATE=dgx-h100\\n' > {DROP_IN}")
    container.exec("systemctl", "daemon-reload")
    container.exec("systemctl", "restart", "gpu-agent")
    assert container.exec("systemctl", "is-active", "gpu-agent").stdout.strip() == "active"
    status = container.exec("systemctl", "status", "gpu-agent", "--no-pager").stdout
    assert 'Status: "ready: 8x H100 80GB HBM3, driver 550.90.07"' in status
    assert container.exec("curl", "-fsS", "127.0.0.1:9445/readyz").stdout == "ok\n"
    cli = container.exec("gpu-agent", "status")
    assert "ready: 8x H100 80GB HBM3" in cli.stdout


def test_reload_keeps_it_active(container: Container) -> None:
    pid = container.exec("systemctl", "show", "-p", "MainPID", "--value", "gpu-agent").stdout.strip()
    container.exec("systemctl", "reload", "gpu-agent")
    # RELOADING=1 ... READY=1 around the reload's reconcile: "reloading" briefly, then active again.
    state = container.sh("for i in $(seq 50); do s=$(systemctl is-active gpu-agent); "
                         "[ \"$s\" = reloading ] || break; sleep 0.1; done; echo $s", check=False).stdout.strip()
    assert state == "active"
    assert container.exec("systemctl", "show", "-p", "MainPID", "--value", "gpu-agent").stdout.strip() == pid
    journal = container.exec("journalctl", "-u", "gpu-agent", "--no-pager", "-o", "cat").stdout
    assert "reloading configuration from /etc/gpu-agent/config.yaml" in journal


def test_a_kubelet_directory_made_after_start_restarts_the_agent_once_to_serve_there(container: Container) -> None:
    """GPU-first provisioning: the agent started with no /var/lib/kubelet, so ReadWritePaths=-... skipped its
    device-plugins directory; made now, it is read-only to the agent until systemd starts it again."""
    assert container.exec("test", "-e", "/var/lib/kubelet", check=False).returncode == 1
    restarts = int(container.exec("systemctl", "show", "-p", "NRestarts", "--value", "gpu-agent").stdout)
    container.exec("mkdir", "-p", "/var/lib/kubelet/device-plugins")
    socket = "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"
    served = container.sh(f"for i in $(seq 250); do [ -S {socket} ] && exit 0; sleep 0.1; done; exit 1", check=False)
    journal = container.exec("journalctl", "-u", "gpu-agent", "--no-pager", "-o", "cat").stdout
    assert served.returncode == 0, journal[-3000:]
    assert int(container.exec("systemctl", "show", "-p", "NRestarts", "--value", "gpu-agent").stdout) == restarts + 1
    assert journal.count("/var/lib/kubelet/device-plugins appeared after gpu-agent started and is read-only in its "
                         "sandbox (ProtectSystem=strict): restarting so that systemd makes it writable\n") == 1
    assert "status=75/TEMPFAIL" in journal
    # the restart helped: nothing kept that would stop the next one
    assert container.exec("test", "-e", "/run/gpu-agent/restarted-for", check=False).returncode == 1


def test_stop_is_clean_and_the_journal_has_the_start_line(container: Container) -> None:
    container.exec("systemctl", "stop", "gpu-agent")
    assert container.exec("systemctl", "is-active", "gpu-agent", check=False).stdout.strip() == "inactive"
    result = container.exec("systemctl", "show", "-p", "Result", "--value", "gpu-agent").stdout.strip()
    assert result == "success"
    journal = container.exec("journalctl", "-u", "gpu-agent", "--no-pager", "-o", "cat").stdout
    assert re.search(r"gpu-agent \S+ starting: root=/ config=/etc/gpu-agent/config.yaml", journal)
    assert "stopped" in journal


# nvidia-cuda-mps-control stood in for (no GPU here): `-d` leaves a daemon that writes its pid file and a
# mark in its /dev/shm and runs until its `quit`; it keeps and shows the settings it is given as the real one
# does (tests/data/mps/h200-580-vm: the thread percentage with one decimal, a limit from 1024M on in whole
# GiB), in files in its pipe directory; a command without a daemon fails as the real one does.
STAND_IN = """\
#!/bin/sh
pipe="$CUDA_MPS_PIPE_DIRECTORY"
pidfile="$pipe/nvidia-cuda-mps-control.pid"
case "$1" in
-d) echo 100.0 > "$pipe/stand-in-threads"; rm -f "$pipe"/stand-in-limit-*
    "$0" --serve </dev/null >/dev/null 2>&1 &
    echo $! > "$pidfile"; exit 0 ;;
--serve) echo shared > /dev/shm/stand-in-mark
    trap 'exit 0' TERM; while :; do sleep 0.2; done ;;
esac
pid=$(cat "$pidfile" 2>/dev/null) && kill -0 "$pid" 2>/dev/null ||
    { echo "Cannot find MPS control daemon process"; exit 1; }
read -r command first second
case "$command" in
quit) kill "$pid" ;;
set_default_active_thread_percentage) echo "$first.0" > "$pipe/stand-in-threads"; cat "$pipe/stand-in-threads" ;;
get_default_active_thread_percentage) cat "$pipe/stand-in-threads" ;;
set_default_device_pinned_mem_limit) echo "${second%M}" > "$pipe/stand-in-limit-$first" ;;
get_default_device_pinned_mem_limit)
    if m=$(cat "$pipe/stand-in-limit-$first" 2>/dev/null); then
        if [ "$m" -ge 1024 ]; then echo "$((m / 1024))G"; else echo "${m}M"; fi
    fi ;;
esac
"""
MPS_CONFIG = ("version: v1\nplugin:\n  sharing:\n    mps:\n      resources:\n      - name: nvidia.com/gpu\n"
              "        replicas: 4\n")
SIMULATED = ("env", "GPU_AGENT_SIMULATE=dgx-h100", "GPU_AGENT_MPS_CONTROL=host")
SHM = "/run/nvidia/mps/shm"
PIPE = "/run/nvidia/mps/nvidia.com/gpu/pipe"
UNIT = "gpu-agent-mps@nvidia.com-gpu.service"  # the packaged template's instance for nvidia.com/gpu
SHM_UNIT = "run-nvidia-mps-shm.mount"


def _daemon_pid(container: Container, other_than: str = "0") -> str:
    """The stand-in daemon's pid once it runs in its unit, and is not `other_than` (waited for, up to a deadline)."""
    return container.sh(f"for i in $(seq 150); do p=$(systemctl show -p MainPID --value {UNIT} 2>/dev/null); "
                        f"[ \"${{p:-0}}\" != 0 ] && [ \"$p\" != {other_than} ] && echo $p && exit 0; sleep 0.2; done; "
                        f"systemctl status {UNIT} --no-pager; journalctl -u gpu-agent --no-pager | tail -30; exit 1"
                        ).stdout.strip()


def _status_when(container: Container, holds: str) -> dict:
    """/status once the Python expression `holds` is true of it (`s`), waited for up to a deadline."""
    check = f"import json, sys; s = json.load(sys.stdin); sys.exit(not ({holds}))"
    script = ("for i in $(seq 150); do s=$(curl -fsS 127.0.0.1:9445/status 2>/dev/null) && echo \"$s\" | "
              f"python3 -c \"{check}\" 2>/dev/null && echo \"$s\" && exit 0; sleep 0.2; done; "
              "curl -sS 127.0.0.1:9445/status; journalctl -u gpu-agent --no-pager | tail -30; exit 1")
    return json.loads(container.sh(script).stdout)


def _mps_state(container: Container, expected: str) -> dict:
    """The daemon as /status shows it, once its state is `expected` (waited for, up to a deadline)."""
    return _status_when(container, f"s['mps']['daemons'][0]['state'] == '{expected}'")["mps"]["daemons"][0]


def _mount_device(container: Container, pid: str, point: str) -> list[str]:
    lines = container.exec("cat", f"/proc/{pid}/mountinfo").stdout.splitlines()
    return [line.split()[2] for line in lines if line.split()[4] == point]


def _mps_set_up(container: Container) -> None:
    """The package installed (the `-k mps` selection skips the install test), the stand-in binary, sharing.mps,
    simulated GPUs with this node's MPS control; the agent started on them."""
    container.sh("dpkg -s gpu-agent >/dev/null 2>&1 || dpkg -i /root/gpu-agent.deb")
    container.sh(f"cat > /usr/bin/nvidia-cuda-mps-control <<'EOF'\n{STAND_IN}EOF\n"
                 "chmod 755 /usr/bin/nvidia-cuda-mps-control && mkdir -p /var/lib/kubelet/device-plugins && "
                 f"mkdir -p {Path(DROP_IN).parent} && "
                 f"printf '{MPS_CONFIG}' > /etc/gpu-agent/config.yaml && "
                 "printf '[Service]\\nEnvironment=GPU_AGENT_SIMULATE=dgx-h100 GPU_AGENT_MPS_CONTROL=host\\n' > "
                 f"{DROP_IN}")
    container.exec("systemctl", "daemon-reload")
    container.exec("systemctl", "restart", "gpu-agent")


def _mps_torn_down(container: Container) -> None:
    """The agent stopped, `gpu-agent uninstall` (the daemons and the tmpfs gone), the stand-in and drop-in removed."""
    container.exec("systemctl", "stop", "gpu-agent")
    undone = container.exec(*SIMULATED, "gpu-agent", "uninstall")
    assert container.exec("systemctl", "is-active", UNIT, check=False).stdout.strip() == "inactive", undone.stdout
    container.exec("rm", "/usr/bin/nvidia-cuda-mps-control", DROP_IN)
    container.exec("systemctl", "daemon-reload")


def test_mps_under_the_packaged_unit(container: Container) -> None:
    """The packaged units with sharing.mps (simulated GPUs, this node's MPS control, a stand-in binary): the
    daemon is an instance of gpu-agent-mps@.service, given its GPUs by the record the agent wrote, the tmpfs
    (run-nvidia-mps-shm.mount) is in the host's mount namespace (PID 1's) and is the daemon's /dev/shm; the
    daemon outlives `systemctl restart gpu-agent` and is adopted with the settings it shows; a replicas change
    restarts it in place, its pipe directory kept; uninstall leaves nothing."""
    _mps_set_up(container)
    pid = _daemon_pid(container)
    fragment = container.exec("systemctl", "show", "-p", "FragmentPath", "--value", UNIT).stdout.strip()
    assert fragment.endswith("/lib/systemd/system/gpu-agent-mps@.service"), fragment  # /lib is /usr/lib's link
    shown = _mps_state(container, "running")
    assert shown["pid"] == int(pid) and shown["replicas"] == 4 and shown["active_thread_percentage"] == 25
    environ = container.exec("cat", f"/proc/{pid}/environ").stdout.split("\0")
    visible = [entry for entry in environ if entry.startswith("CUDA_VISIBLE_DEVICES=")]
    assert visible == [f"CUDA_VISIBLE_DEVICES={','.join(shown['uuids'])}"] and len(shown["uuids"]) == 8
    assert f"CUDA_MPS_PIPE_DIRECTORY={PIPE}" in environ  # the unit's, from its instance name
    assert container.exec("systemctl", "is-active", SHM_UNIT).stdout.strip() == "active"
    host = _mount_device(container, "1", SHM)  # PID 1's mount namespace: the host's, the runtimes'
    assert host and f" {SHM} " in container.sh("grep ' - tmpfs ' /proc/1/mountinfo").stdout
    assert _mount_device(container, pid, "/dev/shm")[-1:] == host[-1:], "the daemon's /dev/shm is not the tmpfs"
    assert container.exec("cat", f"{SHM}/stand-in-mark").stdout == "shared\n"
    agent = container.exec("systemctl", "show", "-p", "ControlGroup", "--value", "gpu-agent").stdout.strip()
    assert not container.exec("cat", f"/proc/{pid}/cgroup").stdout.strip().endswith(agent)

    container.exec("systemctl", "restart", "gpu-agent")
    assert container.exec("systemctl", "is-active", "gpu-agent").stdout.strip() == "active"
    assert _daemon_pid(container) == pid and _mps_state(container, "running")["pid"] == int(pid)  # adopted as it is

    inode = container.exec("stat", "-c", "%i", PIPE).stdout
    container.exec("sed", "-i", "s/replicas: 4/replicas: 2/", "/etc/gpu-agent/config.yaml")
    container.exec("systemctl", "reload", "gpu-agent")
    restarted = _daemon_pid(container, other_than=pid)
    # Running once its settings were read back: set after its unit started, which is when its pid shows.
    shown = _status_when(container, f"s['mps']['daemons'][0]['pid'] == {restarted} and "
                                    "s['mps']['daemons'][0]['state'] == 'running'")["mps"]["daemons"][0]
    assert shown["replicas"] == 2 and container.exec("cat", f"{PIPE}/stand-in-threads").stdout == "50.0\n"
    assert container.exec("stat", "-c", "%i", PIPE).stdout == inode, "the pods' pipe directory was replaced"

    container.exec("systemctl", "stop", "gpu-agent")
    assert container.exec("test", "-d", f"/proc/{restarted}", check=False).returncode == 0, "the agent's stop killed it"

    undone = container.exec(*SIMULATED, "gpu-agent", "uninstall")
    assert container.exec("test", "-d", f"/proc/{restarted}", check=False).returncode != 0, undone.stdout
    assert not _mount_device(container, "1", SHM), undone.stdout
    assert container.exec("ls", "-A", "/run/nvidia/mps").stdout == "", undone.stdout  # the package's, empty
    assert container.exec("systemctl", "is-active", UNIT, check=False).stdout.strip() == "inactive"
    assert container.exec("systemctl", "is-active", SHM_UNIT, check=False).stdout.strip() == "inactive"
    container.exec("rm", "/usr/bin/nvidia-cuda-mps-control", DROP_IN)
    container.exec("systemctl", "daemon-reload")


OLD_DRIVER, NEW_DRIVER = "550.90.07", "570.124.06"  # the simulated DGX H100's driver, and the upgrade


def test_an_mps_daemon_outlives_a_restart_with_nvml_failing_and_a_reload_with_mps_on_completes(
        container: Container) -> None:
    """Issue 33's acceptance. A driver package upgrade (`sim install-driver`: the simulated NVML and modules on
    disk, never this node's files) makes NVML fail with the version mismatch; `systemctl restart gpu-agent` then
    starts an agent without an inventory, which leaves the template unit's daemon running (unknown, not
    stopped). `gpu-agent driver reload` (handed to the running agent) quits the daemon for the unload, reloads,
    and once validated sets the GPUs to EXCLUSIVE_PROCESS and starts the daemon again through its unit, in its
    pipe directory: the reload completes, the daemon runs."""
    _mps_set_up(container)
    pid = _daemon_pid(container)
    assert _mps_state(container, "running")["pid"] == int(pid)
    inode = container.exec("stat", "-c", "%i", PIPE).stdout
    installed = container.exec(*SIMULATED, "gpu-agent", "sim", "install-driver", NEW_DRIVER)
    assert "the host's libraries stay as they are" in installed.stdout, installed.stdout

    container.exec("systemctl", "restart", "gpu-agent")
    mismatch = f"reload required: loaded {OLD_DRIVER}, installed {NEW_DRIVER}"
    status = _status_when(container, f"any('{mismatch}' in (x.get('message') or '') for x in s['stages']) "
                                     "and s['mps'] and s['mps']['daemons'][0]['state'] == 'unknown'")
    assert status["gpus"] == [] and status["mps"]["daemons"][0]["pid"] == int(pid)  # no inventory: left as it is
    assert _daemon_pid(container) == pid and container.exec("test", "-d", f"/proc/{pid}", check=False).returncode == 0
    this_run = container.sh("journalctl --no-pager -o cat "
                            "_SYSTEMD_INVOCATION_ID=$(systemctl show -p InvocationID --value gpu-agent)").stdout
    assert "NVML" in this_run and "sent quit" not in this_run, this_run[-3000:]

    reload = container.exec(*SIMULATED, "gpu-agent", "driver", "reload", check=False, timeout=600)
    journal = container.exec("journalctl", "-u", "gpu-agent", "--no-pager", "-o", "cat").stdout
    assert reload.returncode == 0, f"{reload.stdout}{reload.stderr}{journal[-4000:]}"
    assert reload.stdout.startswith(f"driver reloaded {OLD_DRIVER} -> {NEW_DRIVER}"), reload.stdout
    assert "driver reload: quitting the MPS control daemon for nvidia.com/gpu" in journal
    restarted = _daemon_pid(container, other_than=pid)  # started again through its unit, after validation
    shown = _status_when(container, f"s['mps']['daemons'][0]['pid'] == {restarted} and "
                                    "s['mps']['daemons'][0]['state'] == 'running'")["mps"]["daemons"][0]
    assert shown["compute_mode"] == "EXCLUSIVE_PROCESS" and shown["replicas"] == 4, shown
    machine = json.loads(container.exec(*SIMULATED, "gpu-agent", "sim", "show", "--json").stdout)
    assert [gpu.get("compute_mode") for gpu in machine["gpus"]] == [3] * 8  # EXCLUSIVE_PROCESS after the reload
    assert {m["version"] for m in machine["kernel"]["loaded"] if m["name"] == "nvidia"} == {NEW_DRIVER}
    assert container.exec("stat", "-c", "%i", PIPE).stdout == inode, "the pods' pipe directory was replaced"
    assert container.exec("cat", f"{PIPE}/stand-in-threads").stdout == "25.0\n"  # its limits set again
    _mps_torn_down(container)


# The toolkit package's CDI refresh units (nvidia-container-toolkit 1.18+, deployments/systemd/ at v1.20.0,
# commit f0c382c8), re-expressed as our own minimal units with the facts that matter here: both in
# /lib/systemd/system and wanted by multi-user.target (the package's preset enables them); the service a
# oneshot that stays active after it ran (RemainAfterExit), writing $NVIDIA_CTK_CDI_OUTPUT_FILE_PATH
# (/var/run/cdi/nvidia.yaml unless the env file says otherwise) with `nvidia-ctk cdi generate`; the path unit
# watching the running kernel's modules.dep.
REFRESH_UNITS = {
    "nvidia-cdi-refresh.path": "[Unit]\nDescription=stand-in: refresh the CDI spec on a driver change\n\n"
                               "[Path]\nPathChanged=/lib/modules/%v/modules.dep\n\n"
                               "[Install]\nWantedBy=multi-user.target\n",
    "nvidia-cdi-refresh.service": "[Unit]\nDescription=stand-in: refresh the NVIDIA CDI spec\n"
                                  "ConditionPathExists=/usr/bin/nvidia-ctk\n\n"
                                  "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
                                  "Environment=NVIDIA_CTK_CDI_OUTPUT_FILE_PATH=/var/run/cdi/nvidia.yaml\n"
                                  "EnvironmentFile=-/etc/nvidia-container-toolkit/nvidia-cdi-refresh.env\n"
                                  "ExecStart=/usr/bin/nvidia-ctk cdi generate\n\n"
                                  "[Install]\nWantedBy=multi-user.target\n",
}
CTK_SPEC = "/usr/local/share/nvidia-ctk-stand-in/nvidia.yaml"  # what the stand-in's `cdi generate` writes
CTK_RUNS = "/run/nvidia-ctk-stand-in.runs"
# `nvidia-ctk cdi generate` as a script: the spec made beforehand, written by rename as nvidia-ctk does.
CTK_STAND_IN = ('#!/bin/sh\nif [ "$1 $2" = "cdi generate" ]; then\n  out=${NVIDIA_CTK_CDI_OUTPUT_FILE_PATH}\n'
                f'  mkdir -p "$(dirname "$out")" && cp {CTK_SPEC} "$out.tmp" && mv "$out.tmp" "$out"\n'
                f'  echo generate >> {CTK_RUNS}\n  exit 0\nfi\n'
                "echo 'NVIDIA Container Toolkit CLI version 1.20.0 (stand-in)'\n")
TOOLKIT_STAND_INS = {"/usr/bin/nvidia-ctk": CTK_STAND_IN,
                     "/usr/bin/nvidia-container-runtime": '#!/bin/sh\nexec runc "$@"\n',
                     "/usr/bin/nvidia-container-runtime-hook": "#!/bin/sh\nexit 0\n",
                     "/usr/bin/nvidia-cdi-hook": "#!/bin/sh\nexit 0\n"}
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # where CDI readers look, in their order
# Simulated GPUs on the booted system bound again at /node (as the runtime matrix runs them), its units
# other than the runtimes this system's own (GPU_AGENT_UNITS=host, docs/configuration.md).
# A machine of its own (dgx-a100: the tests before leave the dgx-h100 under /node upgraded to a driver whose
# userspace is not in the ld.so cache, which the CDI stage rightly refuses).
ON_NODE = ("env", "GPU_AGENT_UNITS=host", "gpu-agent", "--config", "/root/cdi-refresh.yaml", "--root", "/node",
           "--simulate", "dgx-a100")


def _refresh_units(container: Container) -> dict[str, tuple[str, str]]:
    """Each refresh unit's (is-enabled, is-active), as the booted systemd answers."""
    return {unit: (container.exec("systemctl", "is-enabled", unit, check=False).stdout.strip(),
                   container.exec("systemctl", "is-active", unit, check=False).stdout.strip())
            for unit in REFRESH_UNITS}


def _definitions(container: Container) -> dict[str, list[str]]:
    """Every `kind=name` the spec files of SPEC_DIRS define, with the files defining it."""
    listing = container.sh("for f in " + " ".join(f"{d}/*.yaml {d}/*.json" for d in SPEC_DIRS) +
                           '; do [ -f "$f" ] && printf "%s\\0" "$f" && cat "$f" && printf "\\0"; done; true').stdout
    fields = listing.split("\0")
    found: dict[str, list[str]] = {}
    for path, text in zip(fields[0::2], fields[1::2]):
        spec = yaml.safe_load(text)
        for device in spec.get("devices", []):
            found.setdefault(f"{spec['kind']}={device['name']}", []).append(path)
    return found


def test_the_toolkits_cdi_refresh_units_are_taken_over_and_given_back(container: Container) -> None:
    """Issue 36: the toolkit package's nvidia-cdi-refresh units installed, enabled and started on the booted
    node (its generator a stand-in: the real one needs a GPU), then the agent's package on simulated GPUs.
    While the agent writes /var/run/cdi/nvidia.yaml both units are stopped and masked by the real systemd, a
    start is refused, and each device is defined once across /etc/cdi and /var/run/cdi; `gpu-agent
    uninstall` puts the spec back as the generator left it and the units back enabled and active."""
    container.sh("dpkg -s gpu-agent >/dev/null 2>&1 || dpkg -i /root/gpu-agent.deb")
    container.exec("systemctl", "stop", "gpu-agent")  # the one-shot passes below are the agent; one at a time
    container.sh("mkdir -p /node && mount --rbind / /node && mount --make-rslave /node")
    try:
        container.sh("printf 'version: v1\\n' > /root/cdi-refresh.yaml")
        machine = json.loads(container.exec(*ON_NODE, "sim", "show", "--json").stdout)
        uuids = [gpu["uuid"] for gpu in machine["gpus"]]
        names = [str(i) for i in range(len(uuids))] + uuids + ["all"]  # nvidia-ctk's index and uuid names, and all
        generated = "# stand-in for nvidia-ctk cdi generate\n" + yaml.safe_dump(
            {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
             "devices": [{"name": name, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
                         for name in names],
             "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]}}, sort_keys=False)
        root = container.directory
        for path, text in {**TOOLKIT_STAND_INS, CTK_SPEC: generated, "/etc/docker/daemon.json": "{}\n"}.items():
            (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / path.lstrip("/")).write_text(text)
            (root / path.lstrip("/")).chmod(0o755 if path.startswith("/usr/bin/") else 0o644)
        for unit, text in REFRESH_UNITS.items():
            (root / "lib/systemd/system" / unit).write_text(text)
        container.exec("systemctl", "daemon-reload")
        container.exec("systemctl", "enable", "--now", *REFRESH_UNITS)
        assert _refresh_units(container) == {unit: ("enabled", "active") for unit in REFRESH_UNITS}
        assert container.exec("cat", "/var/run/cdi/nvidia.yaml").stdout == generated
        assert container.exec("cat", CTK_RUNS).stdout == "generate\n"

        applied = container.exec(*ON_NODE, "apply", "--once", check=False, timeout=300)
        out = applied.stdout + applied.stderr
        assert applied.returncode == 0, out
        for unit in REFRESH_UNITS:
            assert f"did: take over {unit} (enabled, active): stop, disable, mask" in out, out
        assert "did: write /run/cdi/nvidia.yaml" in out, out  # Debian's /var/run is a link to /run
        assert _refresh_units(container) == {unit: ("masked", "inactive") for unit in REFRESH_UNITS}
        refused = container.exec("systemctl", "start", "nvidia-cdi-refresh.service", check=False)
        assert refused.returncode != 0 and "masked" in refused.stderr, refused.stderr
        written = container.exec("cat", "/var/run/cdi/nvidia.yaml").stdout
        assert written != generated and container.exec("cat", CTK_RUNS).stdout == "generate\n"  # the agent's spec
        definitions = _definitions(container)
        assert {f"nvidia.com/gpu={name}" for name in names} <= set(definitions), sorted(definitions)
        assert {device: files for device, files in definitions.items() if len(files) != 1} == {}
        checked = container.exec(*ON_NODE, "check", check=False, timeout=300).stdout
        assert ("taken over: nvidia-cdi-refresh.path, nvidia-cdi-refresh.service stopped, disabled and masked "
                "(put back at uninstall)") in " ".join(checked.split()), checked

        undone = container.exec(*ON_NODE, "uninstall", check=False, timeout=300)
        assert undone.returncode == 0, undone.stdout + undone.stderr
        assert _refresh_units(container) == {unit: ("enabled", "active") for unit in REFRESH_UNITS}, undone.stdout
        assert container.exec("cat", "/var/run/cdi/nvidia.yaml").stdout == generated
    finally:
        container.sh("systemctl disable --now nvidia-cdi-refresh.path nvidia-cdi-refresh.service; "
                     "umount -R /node; rm -f " + " ".join(f"/lib/systemd/system/{unit}" for unit in REFRESH_UNITS) +
                     " " + " ".join(TOOLKIT_STAND_INS) + f" {CTK_SPEC} {CTK_RUNS} /var/run/cdi/nvidia.yaml "
                     "/etc/docker/daemon.json /root/cdi-refresh.yaml; systemctl daemon-reload", check=False)


def test_purge_removes_the_unit_and_the_files(container: Container) -> None:
    purged = container.exec("dpkg", "--purge", "gpu-agent")
    assert "nothing of gpu-agent's is left to undo" in purged.stdout + purged.stderr  # prerm ran `uninstall`
    for path in ("/usr/lib/systemd/system/gpu-agent.service", "/usr/lib/systemd/system/gpu-agent-mps@.service",
                 "/usr/lib/systemd/system/run-nvidia-mps-shm.mount", "/usr/bin/gpu-agent", "/usr/lib/gpu-agent",
                 "/etc/gpu-agent", "/var/lib/gpu-agent", "/run/gpu-agent", "/run/nvidia/mps"):
        assert container.exec("test", "-e", path, check=False).returncode == 1, path
    assert "gpu-agent.service" not in container.exec("systemctl", "list-unit-files", "--no-pager").stdout


def test_rpm_lists_the_files_and_scriptlets(packages: dict[str, Path], tmp_path: Path) -> None:
    rpm = str(packages["rpm"])
    files = run(["rpm", "-qlp", rpm]).stdout.split()
    for path in ("/usr/bin/gpu-agent", "/usr/lib/systemd/system/gpu-agent.service",
                 "/usr/lib/systemd/system/gpu-agent-mps@.service", "/usr/lib/systemd/system/run-nvidia-mps-shm.mount",
                 "/usr/lib/systemd/system-preset/90-gpu-agent.preset", "/usr/lib/tmpfiles.d/gpu-agent.conf",
                 "/etc/gpu-agent/config.yaml", "/etc/gpu-agent/mig.yaml"):
        assert path in files
    assert {"/etc/gpu-agent/config.yaml", "/etc/gpu-agent/mig.yaml"} <= set(run(["rpm", "-qcp", rpm]).stdout.split())
    for tag in ("POSTIN", "PREUN", "POSTUN"):
        body = run(["rpm", "-qp", "--queryformat", f"%{{{tag}}}", rpm]).stdout
        assert "gpu-agent.service" in body, tag
        check = subprocess.run(["sh", "-n"], input=body, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, f"{tag}: {check.stderr}"

    root = tmp_path / "rpmroot"
    run(["rpm", "--root", str(root), "--initdb"])
    run(["rpm", "--root", str(root), "-i", "--nodeps", "--noscripts", rpm], timeout=300)
    launcher = root / "usr/bin/gpu-agent"
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o755
    assert launcher.read_text().startswith("#!/usr/bin/python3")
    assert stat.S_IMODE((root / "usr/lib/systemd/system/gpu-agent.service").stat().st_mode) == 0o644
    assert (root / "etc/gpu-agent/config.yaml").read_text().startswith("# gpu-agent configuration")
    assert sorted(p.name for p in (root / "usr/lib/gpu-agent").iterdir()) == ["gpu_agent", "site-cp39"]
    requires = run(["rpm", "-qp", "--requires", rpm]).stdout.splitlines()
    assert "python(abi) = 3.9" in requires


def unpacked(package: Path, root: Path) -> Path:
    if package.suffix == ".deb":
        run(["dpkg-deb", "-x", str(package), str(root)])
    else:
        run(["rpm", "--root", str(root), "--initdb"])
        run(["rpm", "--root", str(root), "-i", "--nodeps", "--noscripts", str(package)], timeout=300)
    return root


def pythons() -> dict[str, str]:
    """Every Python of 3.9-3.13 this machine has (the one running the tests at least)."""
    found = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    for abi in ("3.9", "3.10", "3.11", "3.12", "3.13"):
        # On PATH, or installed by pyenv (as on the CI machines) without being on PATH.
        pyenv = Path.home().glob(f".pyenv/versions/{abi}.*/bin/python{abi}")
        for candidate in filter(None, [shutil.which(f"python{abi}"), *map(str, pyenv)]):
            if subprocess.run([candidate, "-c", "pass"], capture_output=True, timeout=30).returncode == 0:
                found.setdefault(abi, candidate)
    return found


@pytest.mark.parametrize("kind", ["deb", "deb13", "rpm"])
def test_each_package_runs_on_its_python_and_refuses_another(
        packages: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """The launcher runs the agent on the python3 the package was built for, and on any other says which one
    that is, without a traceback."""
    root = unpacked(packages[kind], tmp_path / "root")
    launcher = (root / "usr/bin/gpu-agent").read_text().replace('LIB = "/usr/lib/gpu-agent"',
                                                                  f'LIB = "{root}/usr/lib/gpu-agent"')
    ran = []
    for abi, python in sorted(pythons().items()):
        sandbox = tmp_path / f"node-{abi}"
        sandbox.mkdir()
        result = subprocess.run([python, "-I", "-c", launcher, "--root", str(sandbox), "--simulate", "a30",
                                 "apply", "--once"],
                                capture_output=True, text=True, timeout=120)
        if abi == PYTHONS[kind]:
            assert result.returncode == 0, f"python {abi}: {result.stdout}{result.stderr}"
            assert "[+] discovery: ok: 1x A30, driver 550.90.07" in result.stdout, abi
        else:
            assert result.returncode == 1, f"python {abi}: {result.stdout}{result.stderr}"
            assert result.stderr == (f"gpu-agent: this package was built for Python {PYTHONS[kind]}, but {python} "
                                     f"is Python {abi}; its compiled dependencies load into that Python only. "
                                     "Install the gpu-agent package built for this distribution's python3.\n")
            assert not list(sandbox.iterdir()), "the refusal touched the host"
        ran.append(abi)
    print(f"{kind}: launcher tried on Python", ", ".join(ran))
