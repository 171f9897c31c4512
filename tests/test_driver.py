"""The driver stage on simulated kernels: load, verify, repair, and a distinct diagnosis per failure."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import cli

KERNEL = "var/lib/gpu-agent/sim/kernel"


def modules(root: Path) -> list[str]:
    return json.loads(cli("sim", "show", "--json", root=root).stdout)["kernel"]["loaded"]


def loaded_names(root: Path) -> list[str]:
    return [module["name"] for module in modules(root)]


def node(root: Path, path: str) -> os.stat_result:
    return os.lstat(root / KERNEL / path.lstrip("/"))


def test_cold_dgx_a100_is_loaded_in_order_with_device_nodes(agent, root: Path) -> None:
    daemon = agent("dgx-a100")
    assert "STATUS=ready: 8x A100-SXM4-40GB, driver 550.90.07" in daemon.wait_ready()
    assert daemon.get("/readyz")[0] == 200
    # Mellanox NICs are present, so nvidia_peermem (auto) is loaded too, after ib_core was already there;
    # nvidia_modeset (auto) only comes with nvidia_drm, which is off.
    assert loaded_names(root) == ["ib_core", "mlx5_ib", "nvidia", "nvidia_uvm", "nvidia_peermem"]
    assert not (root / KERNEL / "dev/nvidia-modeset").exists()
    for path, major, minor in (("/dev/nvidiactl", 195, 255), ("/dev/nvidia0", 195, 0), ("/dev/nvidia7", 195, 7),
                               ("/dev/nvidia-uvm", 510, 0),
                               ("/dev/nvidia-uvm-tools", 510, 1), ("/dev/nvidia-caps/nvidia-cap1", 237, 1)):
        st = node(root, path)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), path
        link = root / KERNEL / f"dev/char/{major}:{minor}"
        assert os.path.realpath(link) == os.path.realpath(root / KERNEL / path.lstrip("/")), link
    assert stat.S_IMODE(node(root, "/dev/nvidia0").st_mode) == 0o666
    assert stat.S_IMODE(node(root, "/dev/nvidia-caps/nvidia-cap1").st_mode) == 0o400
    status = json.loads(daemon.get("/status")[1])
    stage, features = status["stages"][:2]
    assert stage["name"] == "driver" and stage["state"] == "ok"
    assert "6 NVSwitches (fabric manager needed)" in stage["message"]
    assert stage["facts"]["loaded_by"] == "gpu-agent" and status["driver"]["loaded_by"] == "gpu-agent"
    assert features == {**features, "name": "driver-features", "state": "ok", "message": "nvidia_peermem loaded"}


def test_second_pass_runs_no_modprobe_and_no_mknod(root: Path) -> None:
    first = cli("--simulate", "dgx-h100", "apply", "--once", root=root)
    assert "did: modprobe nvidia\n" in first.stdout and "did: mknod /dev/nvidia0 (195:0, 0666, 0:0)" in first.stdout
    inode = node(root, "/dev/nvidia0").st_ino
    second = cli("--simulate", "dgx-h100", "apply", "--once", root=root)
    assert second.returncode == 0 and "did:" not in second.stdout, second.stdout
    assert node(root, "/dev/nvidia0").st_ino == inode


def test_check_reports_what_apply_would_do_and_changes_nothing(root: Path) -> None:
    result = cli("--simulate", "dgx-h100", "check", root=root)
    assert result.returncode == 2
    assert "    needs: modprobe nvidia\n    needs: modprobe nvidia_uvm\n" in result.stdout
    assert "[-] driver-features: waiting for driver" in result.stdout
    assert "nvidia" not in loaded_names(root)
    assert not (root / KERNEL / "dev").exists()


def test_nouveau_blocks_loading_with_a_clear_reason(agent, root: Path) -> None:
    cli("--simulate", "dgx-a100", "sim", "fail", "modprobe", "--error", "nouveau", root=root)
    daemon = agent("dgx-a100")
    daemon.wait_ready()
    status, body = daemon.get("/readyz?verbose")
    assert status == 503
    assert "[-]driver failed: the nouveau driver is loaded and holds the GPUs" in body
    assert "driver.blacklist_nouveau: true" in body
    assert not any(name.startswith("nvidia") for name in loaded_names(root))


def test_blacklisting_nouveau_writes_the_file_and_asks_for_a_reboot(root: Path, write_config) -> None:
    cli("--simulate", "t4", "sim", "fail", "modprobe", "--error", "nouveau", root=root)
    config = write_config({"driver": {"blacklist_nouveau": True}})
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 2
    assert "blacklist-nouveau.conf is written: reboot" in result.stdout
    # /etc/modprobe.d configures the (simulated) kernel, so it is simulated too
    assert "blacklist nouveau\n" in (root / KERNEL / "etc/modprobe.d/blacklist-nouveau.conf").read_text()
    assert not (root / "etc/modprobe.d").exists()


@pytest.mark.parametrize("error, words", [
    ("not-found", "no nvidia module for the running kernel: install the NVIDIA driver for this kernel"),
    ("key-rejected", "Secure Boot rejected the unsigned nvidia module: sign it and enroll the key"),
])
def test_modprobe_failures_are_diagnosed(agent, root: Path, error: str, words: str) -> None:
    cli("--simulate", "t4", "sim", "fail", "modprobe", "--module", "nvidia", "--error", error, root=root)
    daemon = agent("t4")
    daemon.wait_ready()
    status, body = daemon.get("/readyz?verbose")
    assert status == 503 and f"[-]driver failed: {words}" in body
    assert json.loads(daemon.get("/status")[1])["stages"][0]["last_error"].startswith(words)


def test_a_missing_optional_module_is_named(root: Path, write_config) -> None:
    config = write_config({"driver": {"modules": {"nvidia_fs": True}}})
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 2
    assert "no nvidia_fs module for the running kernel" in result.stdout
    assert "Module nvidia_fs not found in directory /lib/modules/" in result.stdout


def test_a_version_pin_that_differs_names_both_versions(root: Path, write_config) -> None:
    config = write_config({"driver": {"version": "535.183.01"}})
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 2
    assert "driver version pin (driver.version) is 535.183.01 but the loaded kernel module is 550.90.07" \
        in result.stdout


def test_a_half_finished_upgrade_is_named(root: Path) -> None:
    assert cli("--simulate", "t4", "apply", "--once", root=root).returncode == 0
    cli("sim", "fail", "modprobe", "--error", "version-mismatch", root=root)
    result = cli("--simulate", "t4", "check", root=root)
    assert result.returncode == 2
    assert "kernel module 550.54.15 is loaded but NVML fails: NVML library and kernel module versions differ" \
        in result.stdout
    assert "the NVML library on disk is 550.90.07" in result.stdout


def test_a_removed_or_wrong_device_node_is_repaired(root: Path) -> None:
    cli("--simulate", "t4", "apply", "--once", root=root)
    (root / KERNEL / "dev/nvidia0").unlink()
    (root / KERNEL / "dev/char/195:255").unlink()
    check = cli("--simulate", "t4", "check", root=root)
    assert "needs: mknod /dev/nvidia0 (195:0, 0666, 0:0): /dev/nvidia0 is missing" in check.stdout
    assert "needs: link /dev/char/195:255 -> /dev/nvidiactl: /dev/char/195:255 does not point to /dev/nvidiactl" \
        in check.stdout
    ctl = node(root, "/dev/nvidiactl").st_ino
    result = cli("--simulate", "t4", "apply", "--once", root=root)
    assert result.returncode == 0 and stat.S_ISCHR(node(root, "/dev/nvidia0").st_mode)
    assert node(root, "/dev/nvidiactl").st_ino == ctl  # only its link was wrong: the node is kept
    os.chmod(root / KERNEL / "dev/nvidia0", 0o600)
    os.chown(root / KERNEL / "dev/nvidia0", 1000, 1000)
    check = cli("--simulate", "t4", "check", root=root)
    assert "/dev/nvidia0 is 0600 1000:1000, the driver says 0666 0:0" in check.stdout
    assert cli("--simulate", "t4", "apply", "--once", root=root).returncode == 0
    st = node(root, "/dev/nvidia0")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o666, 0, 0)


def test_module_options_are_written_and_a_change_on_a_loaded_module_asks_for_a_reload(root: Path, write_config) -> None:
    config = write_config({"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}})
    first = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert first.returncode == 0
    conf = (root / KERNEL / "etc/modprobe.d/gpu-agent-nvidia.conf").read_text()
    assert "options nvidia NVreg_EnableGpuFirmware=0\n" in conf
    assert next(m for m in modules(root) if m["name"] == "nvidia")["params"] == {"NVreg_EnableGpuFirmware": "0"}

    config = write_config({"driver": {"parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 1}}}})
    second = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert "did: write /etc/modprobe.d/gpu-agent-nvidia.conf" in second.stdout
    assert "reload required: nvidia NVreg_EnableGpuFirmware is 0, configured 1" in second.stdout
    assert "the agent never unloads a module" in second.stdout


def test_persistence_mode_is_turned_on_when_required(root: Path, write_config) -> None:
    config = write_config({"driver": {"persistence": True}})
    result = cli("--simulate", "a30", "apply", "--once", root=root, config=config)
    assert result.returncode == 0 and "did: enable persistence mode on GPU 0" in result.stdout
    again = cli("--simulate", "a30", "apply", "--once", root=root, config=config)
    assert "did:" not in again.stdout


def test_dry_run_prints_the_modprobe_d_diff(root: Path, write_config) -> None:
    config = write_config({"driver": {"blacklist_nouveau": True}})
    result = cli("--simulate", "t4", "apply", "--once", "--dry-run", root=root, config=config)
    assert "    +++ /etc/modprobe.d/blacklist-nouveau.conf" in result.stdout and "    +blacklist nouveau" in result.stdout
    assert not (root / "etc/modprobe.d").exists() and not (root / KERNEL / "etc/modprobe.d").exists()


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


@pytest.fixture
def libcuda(root: Path, tmp_path: Path) -> Path:
    """A stand-in libcuda.so.1 built from C, so the real ctypes code path runs without a GPU; it
    replaces the simulator's placeholder (which, like any non-library, fails to load)."""
    cli("--simulate", "t4", "sim", "show", root=root)  # the simulated driver's userspace is installed
    source = tmp_path / "libcuda.c"
    source.write_text(FAKE_LIBCUDA)
    target = root / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    target.unlink()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True, timeout=60)
    return target


def test_cuda_validation_fails_clearly_without_libcuda(root: Path, write_config) -> None:
    cli("--simulate", "t4", "sim", "show", root=root)
    for library in (root / "usr/lib/x86_64-linux-gnu").glob("libcuda.so*"):
        library.unlink()
    config = write_config({"driver": {"validate_cuda": True}})
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 2 and "leads to no libcuda.so.1" in result.stdout


def test_cuda_validation_runs_through_libcuda(root: Path, write_config, libcuda: Path) -> None:
    config = write_config({"driver": {"validate_cuda": True}})
    ok = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert ok.returncode == 0 and "CUDA validated on 1 device" in ok.stdout
    failing = cli("--simulate", "t4", "apply", "--once", root=root, config=config, env={"FAKE_CUDA_ALLOC_ERROR": "2"})
    assert failing.returncode == 2
    assert "CUDA validation failed: cuMemAlloc on device 0 returned CUDA_ERROR_OUT_OF_MEMORY (2)" in failing.stdout
    none = cli("--simulate", "t4", "apply", "--once", root=root, config=config, env={"FAKE_CUDA_DEVICES": "0"})
    assert "CUDA sees 0 devices, 1 GPUs are present" in none.stdout


def test_nvidia_persistenced_counts_as_persistence(root: Path, write_config) -> None:
    config = write_config({"driver": {"persistence": True}})
    cli("--simulate", "t4", "sim", "add-process", "--gpu", "0", "--pid", "900", "--name", "nvidia-persistenced",
        root=root)
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 0 and "did: enable persistence" not in result.stdout


def test_a_persistence_failure_is_a_clear_stage_error(root: Path, write_config) -> None:
    config = write_config({"driver": {"persistence": True}})
    cli("--simulate", "t4", "sim", "fail", "nvmlDeviceSetPersistenceMode", "--error", "NoPermission", root=root)
    result = cli("--simulate", "t4", "apply", "--once", root=root, config=config)
    assert result.returncode == 2
    assert "cannot enable persistence mode on GPU 0: nvmlDeviceSetPersistenceMode: Insufficient Permissions" \
        in result.stdout


def test_check_shows_the_nouveau_finding_even_with_a_file_to_write(root: Path, write_config) -> None:
    cli("--simulate", "t4", "sim", "fail", "modprobe", "--error", "nouveau", root=root)
    config = write_config({"driver": {"blacklist_nouveau": True}})
    result = cli("--simulate", "t4", "check", root=root, config=config)
    assert "needs: write /etc/modprobe.d/blacklist-nouveau.conf" in result.stdout
    planned = json.loads(cli("--simulate", "t4", "check", "--json", root=root, config=config).stdout)["stages"][0]
    assert planned["changes"][0]["kind"] == "WriteFile" and planned["changes"][0]["replaces"] is None
    assert planned["changes"][0]["path"] == "/etc/modprobe.d/blacklist-nouveau.conf"
    assert "now: the nouveau driver is loaded and holds the GPUs" in result.stdout


def test_nouveau_loaded_after_nvidia_holds_the_gpus_is_harmless(root: Path) -> None:
    assert cli("--simulate", "t4", "apply", "--once", root=root).returncode == 0
    cli("sim", "fail", "modprobe", "--error", "nouveau", root=root)
    assert cli("--simulate", "t4", "check", root=root).returncode == 0
