"""The driver stage on simulated kernels, in-process: load, verify, repair, and a distinct diagnosis per failure."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from gpu_agent.plan import CreateDeviceNode, CreateLink, LoadModule, SetPersistenceMode, WriteFile
from harness import SimNode


@pytest.fixture
def node(tmp_path: Path) -> Callable[[str], SimNode]:
    def make(simulate: str) -> SimNode:
        (tmp_path / "root").mkdir(exist_ok=True)
        return SimNode(tmp_path / "root", simulate)
    return make


def device(sim: SimNode, path: str) -> os.stat_result:
    return os.lstat(sim.kernel(path))


def test_cold_dgx_a100_is_loaded_in_order_with_device_nodes(node: Callable[[str], SimNode]) -> None:
    sim = node("dgx-a100")
    result = sim.apply()
    assert result.ok and result.state.readiness(one_shot=True)[0]
    # Mellanox NICs are present, so nvidia_peermem (auto) is loaded too, after ib_core was already there;
    # nvidia_modeset (auto) only comes with nvidia_drm, which is off.
    assert sim.loaded_modules() == ["ib_core", "mlx5_ib", "nvidia", "nvidia_uvm", "nvidia_peermem"]
    assert result.changes("driver")[:2] == [LoadModule("nvidia"), LoadModule("nvidia_uvm")]
    assert result.changes("driver-features") == [LoadModule("nvidia_peermem")]
    assert not sim.kernel("/dev/nvidia-modeset").exists()
    for path, major, minor in (("/dev/nvidiactl", 195, 255), ("/dev/nvidia0", 195, 0), ("/dev/nvidia7", 195, 7),
                               ("/dev/nvidia-uvm", 510, 0), ("/dev/nvidia-uvm-tools", 510, 1),
                               ("/dev/nvidia-caps/nvidia-cap1", 237, 1)):
        st = device(sim, path)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), path
        link = sim.kernel(f"/dev/char/{major}:{minor}")
        assert os.path.realpath(link) == os.path.realpath(sim.kernel(path)), link
    assert stat.S_IMODE(device(sim, "/dev/nvidia0").st_mode) == 0o666
    assert stat.S_IMODE(device(sim, "/dev/nvidia-caps/nvidia-cap1").st_mode) == 0o400
    status = result.state.to_json()
    driver = status["stages"][0]
    assert driver["name"] == "driver" and "6 NVSwitches (fabric manager needed)" in driver["message"]
    assert driver["facts"]["loaded_by"] == "gpu-agent" and status["driver"]["loaded_by"] == "gpu-agent"
    assert {"kind": "LoadModule", "module": "nvidia"} in driver["last_plan"]
    assert status["stages"][1]["message"] == "nvidia_peermem loaded"


def test_second_pass_runs_no_modprobe_and_no_mknod(node: Callable[[str], SimNode]) -> None:
    sim = node("dgx-h100")
    first = sim.apply()
    assert LoadModule("nvidia") in first.changes("driver")
    assert any(isinstance(c, CreateDeviceNode) and c.path == "/dev/nvidia0" for c in first.changes("driver"))
    inode = device(sim, "/dev/nvidia0").st_ino
    second = sim.apply()
    assert second.ok and not any(run.planned for run in second.runs)
    assert device(sim, "/dev/nvidia0").st_ino == inode


def test_check_reports_what_apply_would_do_and_changes_nothing(node: Callable[[str], SimNode]) -> None:
    sim = node("dgx-h100")
    check = sim.check()
    assert check.stage("driver").state == "pending"
    assert check.changes("driver") == [LoadModule("nvidia"), LoadModule("nvidia_uvm")]
    assert check.stage("driver-features").message == "waiting for driver"
    assert "nvidia" not in sim.loaded_modules()
    assert not sim.kernel("/dev").exists()


def test_nouveau_blocks_loading_with_a_clear_reason(node: Callable[[str], SimNode]) -> None:
    sim = node("dgx-a100")
    sim.sim("fail", "modprobe", "--error", "nouveau")
    result = sim.apply()
    driver = result.stage("driver")
    assert driver.state == "failed" and "the nouveau driver is loaded and holds the GPUs" in driver.message
    assert "driver.blacklist_nouveau: true" in driver.message
    ready, failing = result.state.readiness(one_shot=True)
    assert not ready and failing is not None and failing.name == "driver"
    assert not any(name.startswith("nvidia") for name in sim.loaded_modules())


def test_blacklisting_nouveau_writes_the_file_and_asks_for_a_reboot(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("fail", "modprobe", "--error", "nouveau")
    result = sim.apply({"driver": {"blacklist_nouveau": True}})
    assert "blacklist-nouveau.conf is written: reboot" in result.stage("driver").message
    # /etc/modprobe.d configures the (simulated) kernel, so it is simulated too
    assert "blacklist nouveau\n" in sim.kernel("/etc/modprobe.d/blacklist-nouveau.conf").read_text()
    assert not (sim.root / "etc/modprobe.d").exists()


@pytest.mark.parametrize("error, words", [
    ("not-found", "no nvidia module for the running kernel: install the NVIDIA driver for this kernel"),
    ("key-rejected", "Secure Boot rejected the unsigned nvidia module: sign it and enroll the key"),
])
def test_modprobe_failures_are_diagnosed(node: Callable[[str], SimNode], error: str, words: str) -> None:
    sim = node("t4")
    sim.sim("fail", "modprobe", "--module", "nvidia", "--error", error)
    result = sim.apply()
    assert result.stage("driver").state == "failed" and result.stage("driver").message.startswith(words)
    assert result.state.stages["driver"].last_error.startswith(words)


def test_a_missing_feature_module_is_named_and_only_degrades(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    result = sim.apply({"driver": {"modules": {"nvidia_fs": True}}})
    features = result.stage("driver-features")
    assert features.state == "failed" and "no nvidia_fs module for the running kernel" in features.message
    assert "Module nvidia_fs not found in directory /lib/modules/" in features.message
    assert result.state.readiness(one_shot=True)[0] and result.state.degraded


def test_a_version_pin_that_differs_names_both_versions(node: Callable[[str], SimNode]) -> None:
    result = node("t4").apply({"driver": {"version": "535.183.01"}})
    assert "driver version pin (driver.version) is 535.183.01 but the loaded kernel module is 550.90.07" \
        in result.stage("driver").message


def test_a_half_finished_upgrade_is_named(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    assert sim.apply().ok
    sim.sim("fail", "modprobe", "--error", "version-mismatch")  # the new module was never built: no reload helps
    message = sim.check().stage("driver").message
    assert "kernel module 550.54.15 is loaded but NVML fails" in message and "reload required" not in message
    assert ("the NVML library on disk is 550.90.07 but the nvidia module for this kernel is 550.54.15 "
            "(/lib/modules/6.1.0-18-amd64/updates/dkms/nvidia.ko)") in message
    assert sim.check({"driver": {"reload": "when-idle"}}).changes("driver") == []


def test_a_removed_or_wrong_device_node_is_repaired(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.apply()
    sim.kernel("/dev/nvidia0").unlink()
    sim.kernel("/dev/char/195:255").unlink()
    planned = sim.check().changes("driver")
    assert CreateDeviceNode("/dev/nvidia0", 195, 0, 0o666, 0, 0, "/dev/nvidia0 is missing") in planned
    assert CreateLink("/dev/char/195:255", "/dev/nvidiactl", "/dev/char/195:255 does not point to /dev/nvidiactl") \
        in planned
    ctl = device(sim, "/dev/nvidiactl").st_ino
    assert sim.apply().ok and stat.S_ISCHR(device(sim, "/dev/nvidia0").st_mode)
    assert device(sim, "/dev/nvidiactl").st_ino == ctl  # only its link was wrong: the node is kept
    os.chmod(sim.kernel("/dev/nvidia0"), 0o600)
    os.chown(sim.kernel("/dev/nvidia0"), 1000, 1000)
    assert "/dev/nvidia0 is 0600 1000:1000, the driver says 0666 0:0" in sim.check().stage("driver").message
    assert sim.apply().ok
    st = device(sim, "/dev/nvidia0")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o666, 0, 0)


def test_module_options_are_written_and_a_change_on_a_loaded_module_asks_for_a_reload(
        node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    assert sim.apply({"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}}).ok
    conf = sim.kernel("/etc/modprobe.d/gpu-agent-nvidia.conf").read_text()
    assert "options nvidia NVreg_EnableGpuFirmware=0\n" in conf
    loaded = sim.machine.read()["kernel"]["loaded"]
    assert next(m for m in loaded if m["name"] == "nvidia")["params"] == {"NVreg_EnableGpuFirmware": "0"}

    second = sim.apply({"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 1}}}})
    written = second.changes("driver")
    assert [c.path for c in written if isinstance(c, WriteFile)] == ["/etc/modprobe.d/gpu-agent-nvidia.conf"]
    message = second.stage("driver").message
    assert "reload required to apply the configured options: nvidia NVreg_EnableGpuFirmware is 0, configured 1" \
        in message, message
    assert "`gpu-agent driver reload` applies them" in message and "never reloads a driver for its options" in message


def test_persistence_mode_is_turned_on_when_required(node: Callable[[str], SimNode]) -> None:
    sim = node("a30")
    result = sim.apply({"driver": {"persistence": True}})
    assert result.ok and SetPersistenceMode(0, True) in result.changes("driver")
    assert sim.apply({"driver": {"persistence": True}}).changes("driver") == []


def test_dry_run_plans_the_modprobe_d_file_and_writes_nothing(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    check = sim.check({"driver": {"blacklist_nouveau": True}})
    action = next(a for a in check.stage("driver").planned if isinstance(a.changes[0], WriteFile))
    assert action.changes[0].path == "/etc/modprobe.d/blacklist-nouveau.conf" and action.changes[0].replaces is None
    assert "+++ /etc/modprobe.d/blacklist-nouveau.conf" in action.diff and "+blacklist nouveau" in action.diff
    assert not (sim.root / "etc/modprobe.d").exists() and not sim.kernel("/etc/modprobe.d").exists()


FAKE_LIBCUDA = r"""
#include <stdlib.h>
typedef int CUresult;
static const char *names[] = {"CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY"};
static int env(const char *k, int d) { const char *v = getenv(k); return v ? atoi(v) : d; }
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDeviceGetCount(int *n) { *n = env("FAKE_CUDA_DEVICES", 1); return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return 0; }
CUresult cuCtxCreate_v2(void **c, unsigned f, int d) { *c = (void *)1; return 0; }
CUresult cuMemAlloc_v2(unsigned long long *p, size_t n) { *p = 4096; return env("FAKE_CUDA_ALLOC_ERROR", 0); }
CUresult cuMemFree_v2(unsigned long long p) { return 0; }
CUresult cuCtxDestroy_v2(void *c) { return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { *s = names[r < 3 ? r : 1]; return 0; }
"""


def test_cuda_validation_fails_clearly_without_libcuda(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("show")  # the simulated driver's userspace is installed
    for library in (sim.root / "usr/lib/x86_64-linux-gnu").glob("libcuda.so*"):
        library.unlink()
    assert "leads to no libcuda.so.1" in sim.apply({"driver": {"validate_cuda": True}}).stage("driver").message


@pytest.mark.subprocess  # the CUDA check runs in a child process, against a libcuda built here
def test_cuda_validation_runs_through_libcuda(node: Callable[[str], SimNode], tmp_path: Path) -> None:
    sim = node("t4")
    sim.sim("show")
    source = tmp_path / "libcuda.c"
    source.write_text(FAKE_LIBCUDA)
    target = sim.root / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    target.unlink()  # the simulator's placeholder, which like any non-library fails to load
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True, timeout=60)
    settings = {"driver": {"validate_cuda": True}}
    assert "CUDA validated on 1 device" in sim.apply(settings).stage("driver").message
    failing = sim.apply(settings, env={"FAKE_CUDA_ALLOC_ERROR": "2"}).stage("driver")
    assert failing.state == "failed"
    assert "CUDA validation failed: cuMemAlloc on device 0 returned CUDA_ERROR_OUT_OF_MEMORY (2)" in failing.message
    none = sim.apply(settings, env={"FAKE_CUDA_DEVICES": "0"}).stage("driver")
    assert "CUDA sees 0 devices, 1 GPUs are present" in none.message


def test_nvidia_persistenced_counts_as_persistence(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("add-process", "--gpu", "0", "--pid", "900", "--name", "nvidia-persistenced")
    result = sim.apply({"driver": {"persistence": True}})
    assert result.ok and not any(isinstance(c, SetPersistenceMode) for c in result.changes("driver"))


def test_a_persistence_failure_is_a_clear_stage_error(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("fail", "nvmlDeviceSetPersistenceMode", "--error", "NoPermission")
    driver = sim.apply({"driver": {"persistence": True}}).stage("driver")
    assert driver.state == "failed"
    assert "cannot enable persistence mode on GPU 0: nvmlDeviceSetPersistenceMode: Insufficient Permissions" \
        in driver.message


def test_check_shows_the_nouveau_finding_even_with_a_file_to_write(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("fail", "modprobe", "--error", "nouveau")
    check = sim.check({"driver": {"blacklist_nouveau": True}})
    assert [c.path for c in check.changes("driver")] == ["/etc/modprobe.d/blacklist-nouveau.conf"]
    assert "now: the nouveau driver is loaded and holds the GPUs" in check.stage("driver").message


def test_nouveau_loaded_after_nvidia_holds_the_gpus_is_harmless(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    assert sim.apply().ok
    sim.sim("fail", "modprobe", "--error", "nouveau")
    assert sim.check().ok


@pytest.mark.subprocess
def test_check_json_prints_the_typed_plan(tmp_path: Path) -> None:
    """The CLI contract: `check --json` prints the same typed changes the engine plans."""
    import json

    from conftest import cli

    (tmp_path / "root").mkdir()
    result = cli("--simulate", "t4", "check", "--json", root=tmp_path / "root")
    assert result.returncode == 2
    driver = json.loads(result.stdout)["stages"][0]
    assert driver["changes"] == [{"kind": "LoadModule", "module": "nvidia"},
                                 {"kind": "LoadModule", "module": "nvidia_uvm"}]


@pytest.mark.subprocess  # the CUDA check's child process
def test_a_libcuda_that_does_not_load_is_named_not_a_traceback(node: Callable[[str], SimNode]) -> None:
    sim = node("t4")
    sim.sim("show")  # the simulator's placeholder libcuda.so.1 is no ELF library
    message = sim.apply({"driver": {"validate_cuda": True}}).stage("driver").message
    assert "CUDA validation failed: cannot load " in message and "libcuda.so.550.90.07: file too short" in message
    assert "Traceback" not in message
