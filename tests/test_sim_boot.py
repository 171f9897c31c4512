"""Issue 33, the simulator: a reboot that loads the installed driver under a new boot id, `sim reload-driver` that
loads the installed version, service units that exist, stop, start and fail as systemd's, faults at every step of a
reload (a module whose init never returns), NVIDIA's modules that refuse an nvidia of another version, and the
framebuffer console on nvidia-drm's fbdev."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host import processes
from gpu_agent.host.display import drm_use, nvidia_consoles
from gpu_agent.host.modules import KernelModules, ModuleLoadError, ModuleUnloadError
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import SimConsole, SimModprobe, loaded_version
from gpu_agent.sim.services import SimServices, SimUnits, install_unit
from harness import SimNode

OLD, NEW = "550.90.07", "570.124.06"
PERSISTENCED = "nvidia-persistenced.service"


def said(node: SimNode, *argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        node.sim(*argv)
    return out.getvalue()


def loaded(node: SimNode) -> SimNode:
    """The node with its driver loaded (the simulated kernel starts cold)."""
    node.sim("show")
    for module in ("nvidia", "nvidia_uvm"):
        SimModprobe(node.machine, kernel_root(node)).load(module)
    return node


def kernel_root(node: SimNode) -> Root:
    return Root(node.root).with_kernel(node.machine.kernel_dir)


def test_a_reboot_after_an_install_loads_the_installed_driver_under_a_new_boot_id(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "t4"))
    boot_id = node.kernel("/proc/sys/kernel/random/boot_id").read_text()
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("install-driver", NEW)
    assert loaded_version(node.machine.read(), "nvidia") == OLD  # an install loads nothing
    SimUnits(node.machine)("stop", PERSISTENCED)
    text = said(node, "reboot")
    assert f"driver {NEW} loaded" in text and "units running" in text
    assert node.kernel("/proc/sys/kernel/random/boot_id").read_text() not in ("", boot_id)
    state = node.machine.read()
    assert {m["name"]: m["version"] for m in state["kernel"]["loaded"]} == {"nvidia": NEW, "nvidia_uvm": NEW}
    assert state["gpus"][0]["processes"] == [] and SimServices(node.machine, 5).state(PERSISTENCED).active == "active"


def test_a_cold_machine_boots_with_its_gpus_driver_and_a_fault_keeps_it_out(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "t4")
    node.sim("show")
    assert node.loaded_modules() == []
    node.sim("reboot")
    assert node.loaded_modules() == ["nvidia"]  # udev loads the GPUs' driver
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "key-rejected")
    assert "at boot: modprobe: ERROR: could not insert 'nvidia': Key was rejected by service" in said(node, "reboot")
    assert node.loaded_modules() == []


def test_reload_driver_loads_the_installed_version_and_says_so(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "t4"))
    node.sim("install-driver", NEW)
    assert f"nvidia driver reloaded: {OLD} -> {NEW}" in said(node, "reload-driver")
    assert {m["version"] for m in node.machine.read()["kernel"]["loaded"]} == {NEW}
    node.sim("fail", "modprobe", "--error", "display")  # a display server holds nvidia_drm
    with pytest.raises(AgentError, match="Module nvidia_drm is in use"):
        node.sim("reload-driver")


def test_nvidia_modules_refuse_an_nvidia_of_another_version(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "t4"))
    modprobe = SimModprobe(node.machine, kernel_root(node))
    modprobe.unload("nvidia_uvm")
    node.sim("install-driver", NEW)
    with pytest.raises(ModuleLoadError, match="could not insert 'nvidia_uvm': Invalid argument"):
        modprobe.load("nvidia_uvm")


def test_units_exist_by_their_unit_file_and_stop_start_and_fail_as_systemds(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "dgx-h100"))
    units, services = SimUnits(node.machine), SimServices(node.machine, 5)
    assert services.state(PERSISTENCED).active == "active"  # the driver packages' units, running from boot
    assert services.state("nvidia-fabricmanager.service").active == "active"  # NVSwitches: fabric manager
    units("stop", PERSISTENCED)
    assert services.state(PERSISTENCED).active == "inactive"  # what the agent reads: ActiveState
    units("start", PERSISTENCED)
    assert services.state(PERSISTENCED).active == "active"
    assert services.state("dcgm.service").load == "not-found"
    with pytest.raises(AgentError, match=r"systemctl stop dcgm.service failed: Failed to stop dcgm.service: Unit "
                                         r"dcgm.service not loaded\."):
        units("stop", "dcgm.service")
    with pytest.raises(AgentError, match="Unit dcgm.service not found"):
        units("start", "dcgm.service")
    install_unit(node.machine.root, "dcgm.service", "/usr/bin/nv-hostengine")
    node.sim("fail", "start", "--unit", "dcgm.service", "--times", "1")
    units("stop", "dcgm.service")
    with pytest.raises(AgentError, match="Job for dcgm.service failed"):
        units("start", "dcgm.service")
    assert services.state("dcgm.service").active == "failed"
    units("start", "dcgm.service")  # the fault used up
    assert services.state("dcgm.service").active == "active"
    node.sim("fail", "stop", "--unit", PERSISTENCED)
    with pytest.raises(AgentError, match=f"Job for {PERSISTENCED} failed"):
        units("stop", PERSISTENCED)
    assert services.state(PERSISTENCED).active == "active"
    node.sim("clear")
    units("stop", PERSISTENCED)
    node.sim("reboot")
    assert services.state(PERSISTENCED).active == "active"


def test_a_module_whose_init_never_returns_is_listed_loading_until_a_reboot(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "t4")
    node.sim("show")
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "stuck")
    modprobe = SimModprobe(node.machine, kernel_root(node), timeout=0.01)
    with pytest.raises(AgentError, match="modprobe nvidia did not finish within 0.01 s and was killed"):
        modprobe.load("nvidia")
    kernel = KernelModules(kernel_root(node))
    assert "nvidia " in node.kernel("/proc/modules").read_text() and " Loading " in node.kernel(
        "/proc/modules").read_text()
    assert kernel.stuck() == ["nvidia"] and "nvidia" not in kernel.loaded()
    assert node.kernel("/sys/module/nvidia/initstate").read_text() == "coming\n"
    with pytest.raises(ModuleUnloadError, match="Device or resource busy"):
        modprobe.unload("nvidia")
    node.sim("clear")  # the fault gone, the init still hangs
    with pytest.raises(ModuleLoadError, match="Device or resource busy"):
        modprobe.load("nvidia")
    node.sim("reboot")
    assert kernel.stuck() == [] and "nvidia" in kernel.loaded()


def test_the_framebuffer_console_holds_nvidia_drm_until_it_is_unbound(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "t4"))
    node.kernel("/etc/modprobe.d").mkdir(parents=True, exist_ok=True)
    node.kernel("/etc/modprobe.d/kms.conf").write_text("options nvidia-drm modeset=1 fbdev=1\n")
    modprobe, root = SimModprobe(node.machine, kernel_root(node)), kernel_root(node)
    modprobe.load("nvidia_drm")
    drm = KernelModules(root).loaded()["nvidia_drm"]
    assert drm.refcnt == 1 and node.kernel("/sys/class/graphics/fb0/name").read_text() == "nvidia-drmdrmfb\n"
    assert nvidia_consoles(root) == ("vtcon1",) and drm_use(root, drm).display is None  # no display: the console
    with pytest.raises(ModuleUnloadError, match="Module nvidia_drm is in use"):
        modprobe.unload("nvidia_drm")
    SimConsole(node.machine).bind("vtcon1", False)
    assert node.kernel("/sys/class/vtconsole/vtcon1/bind").read_text() == "0\n" and nvidia_consoles(root) == ()
    modprobe.unload("nvidia_drm")
    with pytest.raises(AgentError, match="vtcon1/bind: No such file"):
        SimConsole(node.machine).bind("vtcon1", True)  # no framebuffer to bind to
    modprobe.load("nvidia_drm")
    assert node.kernel("/sys/class/vtconsole/vtcon1/bind").read_text() == "0\n"  # unbound stays unbound
    SimConsole(node.machine).bind("vtcon1", True)
    assert KernelModules(root).loaded()["nvidia_drm"].refcnt == 1


def test_a_display_server_is_told_from_the_console(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "t4"))
    node.sim("fail", "modprobe", "--error", "display")
    root = kernel_root(node)
    use = drm_use(root, KernelModules(root).loaded()["nvidia_drm"])
    assert use.display == "1400 (Xorg) has an NVIDIA DRM device open (a display)" and use.consoles == ()


# --- MPS: a server that outlives its clients, compute modes a module reload resets -----------------------------

GPU_RESOURCE = "nvidia.com/gpu"


def mps_daemon(node: SimNode) -> Any:
    """nvidia.com/gpu's control daemon on every GPU, started as the agent starts it (its tmpfs first)."""
    from gpu_agent.mps.control import DaemonSpec
    from gpu_agent.sim.mps import SimMpsControl

    control = SimMpsControl(node.machine, 0.2)
    node.root.joinpath("run/nvidia/mps/shm").mkdir(parents=True)
    control.mount_shm("mode=1777")
    uuids = tuple(gpu["uuid"] for gpu in node.machine.read()["gpus"])
    spec = DaemonSpec(GPU_RESOURCE, uuids, tuple(range(len(uuids))), (16384,) * len(uuids), 4)
    control.start(spec)
    return control, spec


def test_an_mps_server_holds_the_gpus_after_its_last_client_until_its_daemon_quits(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "a30"))
    control, spec = mps_daemon(node)
    daemon = control.pid(spec)
    assert "MPS server" not in said(node, "add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("clear")
    with pytest.raises(AgentError, match="no MPS control daemon for nvidia.com/other takes clients"):
        node.sim("add-process", "--gpu", "0", "--pid", "4243", "--name", "x", "--mps", "nvidia.com/other")
    text = said(node, "add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py", "--mps", GPU_RESOURCE)
    server = node.machine.read()["mps"][GPU_RESOURCE]["servers"][0]
    assert f"a client of the MPS server {server} of {GPU_RESOURCE}" in text
    assert control.send(spec, "get_server_list") == f"{server}\n"
    assert f"MPS server {server} still runs" in said(node, "clear")  # the client ended: the server stays
    root = kernel_root(node)
    holders = processes.device_users(root)
    assert [(p.pid, p.name) for p in holders] == [(server, "nvidia-cuda-mps")]
    assert processes.parent(root, server) == daemon  # forked by its control daemon
    assert KernelModules(root).loaded()["nvidia"].refcnt >= 1
    with pytest.raises(AgentError, match=f"Module nvidia is in use by .*{server} \\(nvidia-cuda-mps-server\\)"):
        node.sim("reload-driver")
    with pytest.raises(ModuleUnloadError, match="Module nvidia_uvm is in use"):
        SimModprobe(node.machine, root).unload("nvidia_uvm")

    node.sim("add-process", "--gpu", "0", "--pid", "4244", "--name", "train.py", "--mps", GPU_RESOURCE)
    control.send(spec, "quit")  # waits for its client
    assert control.pid(spec) == daemon and "(quitting): servers" in said(node, "show")
    with pytest.raises(AgentError, match="takes clients"):
        node.sim("add-process", "--gpu", "0", "--pid", "4245", "--name", "late.py", "--mps", GPU_RESOURCE)
    assert "ended with its last client" in said(node, "clear")
    assert control.pid(spec) is None and processes.device_users(root) == []
    node.sim("reload-driver")


def test_a_module_reload_resets_compute_modes_and_a_reboot_ends_the_mps_daemons(tmp_path: Path) -> None:
    node = loaded(SimNode(tmp_path / "root", "a30"))
    control, spec = mps_daemon(node)
    with node.machine.edit() as state:
        state["gpus"][0]["compute_mode"] = 3  # EXCLUSIVE_PROCESS, as the agent sets it for MPS
    assert "compute modes DEFAULT" in said(node, "reload-driver")
    assert "compute_mode" not in node.machine.read()["gpus"][0] and control.pid(spec) is not None  # it holds none
    with node.machine.edit() as state:
        state["gpus"][0]["compute_mode"] = 3
    SimModprobe(node.machine, kernel_root(node)).unload("nvidia_uvm")
    assert node.machine.read()["gpus"][0]["compute_mode"] == 3  # only nvidia's unload resets it
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py", "--mps", GPU_RESOURCE)
    assert "processes and MPS daemons ended, compute modes DEFAULT" in said(node, "reboot")
    state = node.machine.read()
    assert control.pid(spec) is None and state["mps"][GPU_RESOURCE]["servers"] == [] and state["mounts"] == {}
    assert "compute_mode" not in state["gpus"][0] and processes.device_users(kernel_root(node)) == []


def test_install_driver_over_the_real_root_changes_only_the_simulated_driver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated GPUs over the real / (the packaged unit with GPU_AGENT_SIMULATE): the host's libraries are never
    written; NVML (simulated) and the simulated kernel's modules on disk become the new version's, so NVML fails
    with the mismatch a package upgrade leaves and the agent sees the installed driver to reload to."""
    from gpu_agent.host import driver_version

    node = loaded(SimNode(tmp_path / "root", "t4"))
    library = next(node.root.glob("usr/lib/*/libnvidia-ml.so.5*"))
    monkeypatch.setattr(Root, "is_running_system", property(lambda self: True))
    text = said(node, "install-driver", NEW)
    assert "the host's libraries stay as they are" in text and library.exists()  # the old version's, as it was
    assert not list(node.root.glob(f"usr/lib/*/libnvidia-ml.so.{NEW}"))
    monkeypatch.undo()
    assert driver_version.installed(kernel_root(node)).module == NEW
    assert node.machine.read()["driver_version"] == NEW and loaded_version(node.machine.read(), "nvidia") == OLD
