"""Issue 33 ("Across time"): a driver reload whose next step follows its record and what the node shows now.
Each of the issue's reproductions on the simulator, in this process: a failed reload the operator ended with a
reboot, or a package rollback; a second upgrade while one is unfinished; what a failed reload keeps away while
it retries, and `--abort`; a module option the stage and the command disagreed on; the command's passes; the
framebuffer console. Then a reboot, and a new target, at each step."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import SimModprobe, loaded_version
from gpu_agent.sim.services import SimUnits
from gpu_agent.stages.driver_reload import ORDER
from harness import Pass, SimNode, run_cli
from kube_emulator import KubeEmulator
from test_driver_reload import (  # noqa: F401 (kube_api: the fixture `api`)
    NEW,
    NODE,
    PERSISTENCED,
    STATE,
    a_minute_later,
    killed_at,
    kube_api,
    label_history,
    settings,
    unit_state,
    upgraded,
)

OLD = "550.90.07"
NEWER = "575.51.03"
_SAME = re.compile(r"loaded (\S+), installed \1\b")


def contradictions(run: Pass) -> list[str]:
    """Messages that contradict themselves ("reload required: loaded 550.90.07, installed 550.90.07")."""
    return [f"{r.stage}: {r.message}" for r in run.runs if _SAME.search(r.message)]


def record(node: SimNode) -> dict[str, Any]:
    entry = Ledger(Root(node.root)).driver_reload()
    assert entry is not None
    return entry


@pytest.fixture
def unloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every rmmod the agent runs, in order."""
    calls: list[str] = []
    unload = SimModprobe.unload

    def counted(self: SimModprobe, module: str) -> None:
        calls.append(module)
        unload(self, module)

    monkeypatch.setattr(SimModprobe, "unload", counted)
    return calls


def a_gpu_opened_as_the_units_stop(monkeypatch: pytest.MonkeyPatch, node: SimNode) -> None:
    """A process opens GPU 0 after the GPUs were seen idle, as the agent stops its units (the issue's "one
    process opened a GPU before the first pass")."""
    call = SimUnits.__call__

    def stop_then_open(self: SimUnits, verb: str, unit: str) -> None:
        call(self, verb, unit)
        if verb == "stop":
            node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")

    monkeypatch.setattr(SimUnits, "__call__", stop_then_open)


def upgraded_under_a_job(node: SimNode) -> None:
    """Driver NEW installed while a GPU process runs (pid 4242 on GPU 0), a minute after the last pass."""
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("install-driver", NEW)
    a_minute_later(node)


def cordoned(api: KubeEmulator) -> bool:
    return bool(api.get_node(NODE)["spec"].get("unschedulable"))


def assert_done(run: Pass, node: SimNode, api: KubeEmulator, version: str = NEW) -> None:
    """The pass ended the reload: `version` loaded, the units running, the node uncordoned, upgrade-done."""
    assert run.stage("driver").state == "ok", run.stage("driver").message
    assert run.stage("driver-upgrade").state == "ok", run.stage("driver-upgrade").message
    assert loaded_version(node.machine.read(), "nvidia") == version
    assert {"nvidia", "nvidia_uvm"} <= set(node.loaded_modules())
    assert unit_state(node, PERSISTENCED) == "active"
    assert not cordoned(api) and api.labels()[STATE] == "upgrade-done"
    assert record(node)["step"] == "upgrade-done" and not record(node)["plugin_stopped"]
    assert not contradictions(run), contradictions(run)


def failed_at_pod_restart(node: SimNode, api: KubeEmulator, config: dict[str, Any],
                          monkeypatch: pytest.MonkeyPatch, new: str = NEW) -> Pass:
    """The issue's first reproduction up to the failure: `new` installed, the GPUs idle, the reload begun, a
    GPU opened as the units stop: `a GPU is in use again`."""
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", new)
    with monkeypatch.context() as patch:
        a_gpu_opened_as_the_units_stop(patch, node)
        a_minute_later(node)
        failed = node.apply(config)
    assert "failed at pod-restart-required: a GPU is in use again: process 4242 (train.py)" in \
        failed.stage("driver").message, failed.stage("driver").message
    assert record(node)["step"] == "upgrade-failed" and cordoned(api)
    # What it took away is back while it is tried again: the unit runs, no module was unloaded.
    assert unit_state(node, PERSISTENCED) == "active" and record(node)["stopped_units"] == []
    assert loaded_version(node.machine.read(), "nvidia") == OLD and not contradictions(failed)
    return failed


@pytest.mark.parametrize("profile, new", [
    ("t4", NEW),
    pytest.param("a30", NEWER, marks=pytest.mark.slow),
    pytest.param("t4", "535.183.01", marks=pytest.mark.slow),  # a "newer" package that is an older driver
])
def test_a_reload_failed_at_pod_restart_then_a_reboot_ends_without_unloading_the_driver(
        tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, unloads: list[str], profile: str,
        new: str) -> None:
    """The reboot loaded the installed driver: the agent unloads nothing, starts nothing it did not stop, and
    ends the reload (validated, uncordoned, upgrade-done). Before: it stopped the units, unloaded the healthy
    driver, and with the GPU in use failed so forever."""
    node = SimNode(tmp_path / "root", profile)
    config = {**settings(api, node), "mig": {}}
    failed_at_pod_restart(node, api, config, monkeypatch, new)
    boot = node.kernel("/proc/sys/kernel/random/boot_id").read_text()
    node.sim("reboot")
    assert node.kernel("/proc/sys/kernel/random/boot_id").read_text() != boot
    assert loaded_version(node.machine.read(), "nvidia") == new
    node.sim("add-process", "--gpu", "0", "--pid", "4343", "--name", "train.py")  # a GPU used at once
    unloads.clear()
    a_minute_later(node)
    after = node.apply(config)
    assert_done(after, node, api, new)
    assert unloads == [] and node.machine.read()["services"][PERSISTENCED]["calls"] == ["stop", "start"]
    assert f"{new} is loaded (by a reboot, or by hand)" in record(node)["notes"]
    assert any(note.startswith("a reboot (boot id ") for note in record(node)["notes"])


def test_a_package_rollback_after_a_failed_reload_ends_it_without_unloading(
        tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, unloads: list[str]) -> None:
    """The package rolled back to the loaded driver: nothing to reload. Put back, uncordoned, the label
    upgrade-done, the record upgrade-abandoned by gpu-agent saying why."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    failed_at_pod_restart(node, api, config, monkeypatch)
    node.sim("install-driver", OLD)
    unloads.clear()
    a_minute_later(node)
    after = node.apply(config)
    assert after.stage("driver").state == "ok" and after.stage("driver-upgrade").state == "ok", after.runs
    assert unloads == [] and unit_state(node, PERSISTENCED) == "active"
    assert not cordoned(api) and api.labels()[STATE] == "upgrade-done"
    ended = record(node)
    assert (ended["step"], ended["ended_by"]) == ("upgrade-abandoned", "gpu-agent")
    assert ended["ended_why"] == f"nothing to reload: the installed driver is {OLD} again, the one loaded"
    assert "abandoned by gpu-agent" in after.stage("driver-upgrade").message
    assert not contradictions(after)


def test_a_second_upgrade_while_waiting_keeps_the_cordon_and_ends_uncordoned(
        tmp_path: Path, api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    upgraded_under_a_job(node)
    waiting = node.apply(config)
    assert "wait-for-jobs-required" in waiting.stage("driver").message and cordoned(api)
    node.sim("install-driver", NEWER)
    a_minute_later(node)
    still = node.apply(config)
    assert f"reload required: loaded {OLD}, installed {NEWER}" in still.stage("driver").message
    assert record(node)["cordoned"] and record(node)["target"] == NEWER
    node.sim("clear")
    a_minute_later(node)
    assert_done(node.apply(config), node, api, NEWER)
    assert f"the installed driver became {NEWER} (was {NEW}) at wait-for-jobs-required" in record(node)["notes"]
    history = label_history(api)
    assert history[-1] == "upgrade-done" and "cordon-required" in history


def test_a_second_upgrade_after_the_unload_starts_the_stopped_units_and_uncordons(
        tmp_path: Path, api: KubeEmulator) -> None:
    """The first target's load fails (Secure Boot): every module unloaded, the unit stopped. Another driver is
    installed; the same reload loads it, starts the unit it stopped and uncordons."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "key-rejected")
    a_minute_later(node)
    failed = node.apply(config)
    assert "could not load nvidia" in failed.stage("driver").message
    assert record(node)["stopped_units"] == [PERSISTENCED] and unit_state(node, PERSISTENCED) == "inactive"
    node.sim("clear")
    node.sim("install-driver", NEWER)
    a_minute_later(node)
    assert_done(node.apply(config), node, api, NEWER)


def abort(node: SimNode, config: Path) -> Any:
    return run_cli("--simulate", node.simulate, "driver", "reload", "--abort", "--json", root=node.root, config=config)


def test_abort_puts_back_what_can_be_uncordons_and_records_who_and_when(
        tmp_path: Path, api: KubeEmulator) -> None:
    """A reload failing at the unload of nvidia (nvidia_uvm already unloaded, and not loadable beside the old
    nvidia: its module on disk is the new one's). While it retries the unit runs again and the failure says what
    stays unloaded; `--abort` ends it: uncordoned, upgrade-abandoned with who and when in the record, the label
    and /status; when-idle does not start it again, `gpu-agent driver reload` does."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    node.sim("fail", "rmmod", "--module", "nvidia")
    a_minute_later(node)
    failed = node.apply(config)
    message = failed.stage("driver").message
    assert "could not unload nvidia" in message and "nvidia_uvm stay unloaded: their modules on disk are " \
        f"{NEW}'s and the loaded nvidia is {OLD}" in message, message
    assert unit_state(node, PERSISTENCED) == "active" and "nvidia_uvm" not in node.loaded_modules()
    assert record(node)["plugin_stopped"]  # a module missing: the plugin stays off
    written = tmp_path / "command.yaml"
    written.write_text(json.dumps({"version": "v1", **config}))
    plan = run_cli("--simulate", "t4", "driver", "reload", "--abort", "--dry-run", root=node.root, config=written)
    assert plan.stdout.startswith(f"would abort the driver reload of {OLD} to {NEW} at pod-restart-required\n"
                                  "    would: driver reload [pod-restart-required]: end the reload: load back"), \
        plan.stdout
    assert record(node)["step"] == "upgrade-failed"  # the dry run changed nothing
    both = run_cli("--simulate", "t4", "driver", "reload", "--abort", "--force", root=node.root, config=written)
    assert both.returncode != 0 and "not allowed with argument" in both.stderr
    a_minute_later(node)
    aborted = abort(node, written)
    outcome = json.loads(aborted.stdout)
    assert aborted.returncode == 0 and outcome["reload"]["step"] == "upgrade-abandoned", aborted.stdout
    ended = outcome["reload"]
    assert "--abort" in ended["ended_by"] and ended["ended_why"] == "aborted at pod-restart-required"
    assert ended["ended_at"] and not ended["cordoned"] and not ended["plugin_stopped"]
    assert outcome["message"].startswith(f"driver reload of {OLD} to {NEW} abandoned by ")
    assert not cordoned(api) and api.labels()[STATE] == "upgrade-abandoned"
    assert unit_state(node, PERSISTENCED) == "active" and loaded_version(node.machine.read(), "nvidia") == OLD
    node.sim("clear")
    a_minute_later(node)
    report = node.apply(config)  # when-idle: reported, not started again
    assert "abandoned by" in report.stage("driver").message and "`gpu-agent driver reload` starts it again" in \
        report.stage("driver").message, report.stage("driver").message
    assert "abandoned by" in report.stage("driver-upgrade").message and not cordoned(api)
    assert api.labels()[STATE] == "upgrade-abandoned" and record(node)["step"] == "upgrade-abandoned"
    again = run_cli("--simulate", "t4", "driver", "reload", root=node.root, config=written)
    assert again.returncode == 0 and again.stdout.startswith(f"driver reloaded {OLD} -> {NEW}"), again.stderr
    assert abort(node, written).stdout.count("no driver reload is under way: nothing to abort") == 1


def test_a_failed_forced_reload_loads_back_what_it_unloaded_while_it_retries(tmp_path: Path) -> None:
    """`--force` on a driver that needs nothing (the same version on disk): nvidia_uvm unloaded, then nvidia
    refuses. The failure loads nvidia_uvm back, starts the unit, lets the plugin serve."""
    node = SimNode(tmp_path / "root", "t4")
    config = tmp_path / "command.yaml"
    config.write_text("version: v1\ntoolkit: {enabled: false}\n")
    assert node.apply({"toolkit": {"enabled": False}}).stage("driver").state == "ok"
    node.sim("fail", "rmmod", "--module", "nvidia")
    forced = run_cli("--simulate", "t4", "driver", "reload", "--force", "--json", root=node.root, config=config)
    outcome = json.loads(forced.stdout)
    assert forced.returncode == 1 and "could not unload nvidia" in outcome["message"], forced.stdout
    assert outcome["reload"]["reason"] == "forced" and outcome["reload"]["unloaded"] == []
    assert {"nvidia", "nvidia_uvm"} <= set(node.loaded_modules()) and unit_state(node, PERSISTENCED) == "active"
    assert not outcome["reload"]["plugin_stopped"]
    node.sim("clear")
    done = run_cli("--simulate", "t4", "driver", "reload", "--force", root=node.root, config=config)
    assert done.returncode == 0 and done.stdout.startswith(f"driver reloaded {OLD} -> {OLD}"), done.stderr


def test_a_changed_module_option_the_stage_and_the_command_agree_and_the_command_applies_it(tmp_path: Path) -> None:
    """The stage says the option needs a reload and `gpu-agent driver reload` applies it; driver.reload:
    when-idle never reloads a driver for an option alone. Before: the command said "nothing to reload"."""
    node = SimNode(tmp_path / "root", "t4")
    settings_ = {"toolkit": {"enabled": False}, "driver": {"reload": "when-idle",
                                                          "parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}}
    assert node.apply(settings_).ok
    settings_["driver"]["parameters"]["nvidia"]["NVreg_EnableGpuFirmware"] = 1  # type: ignore[index]
    stage = node.apply(settings_).stage("driver")
    wanted = "nvidia NVreg_EnableGpuFirmware is 0, configured 1"
    assert f"reload required to apply the configured options: {wanted}" in stage.message
    assert node.apply(settings_).changes("driver") == []  # when-idle: reported, not applied
    config = tmp_path / "command.yaml"
    config.write_text(json.dumps({"version": "v1", **settings_}))
    plan = run_cli("--simulate", "t4", "driver", "reload", "--dry-run", root=node.root, config=config)
    assert plan.returncode == 0 and plan.stdout.startswith(f"reload required to apply the configured options: {wanted}")
    assert f"unload the {OLD} modules in dependency order" in plan.stdout
    done = run_cli("--simulate", "t4", "driver", "reload", root=node.root, config=config)
    assert done.returncode == 0 and done.stdout.startswith(f"driver reloaded {OLD} -> {OLD}"), done.stderr
    nvidia = next(m for m in node.machine.read()["kernel"]["loaded"] if m["name"] == "nvidia")
    assert nvidia["params"]["NVreg_EnableGpuFirmware"] == "1"
    assert "reload required" not in node.apply(settings_).stage("driver").message
    nothing = run_cli("--simulate", "t4", "driver", "reload", "--dry-run", root=node.root, config=config)
    assert nothing.stdout.startswith("nothing to reload: driver 550.90.07")


def test_a_changed_module_option_is_said_by_the_stage_while_nvml_fails_as_by_the_command(tmp_path: Path) -> None:
    """NVML fails on every GPU and a module option changed: the stage's failure names the options a reload would
    apply, as `gpu-agent driver reload --dry-run` does. Before: the stage said only that NVML fails while the
    command said a reload was required (found by the property test over sequences)."""
    node = SimNode(tmp_path / "root", "t4")
    settings_ = {"toolkit": {"enabled": False}, "driver": {"reload": "when-idle",
                                                          "parameters": {"nvidia": {"NVreg_EnableGpuFirmware": 0}}}}
    assert node.apply(settings_).ok
    settings_["driver"]["parameters"]["nvidia"]["NVreg_EnableGpuFirmware"] = 1  # type: ignore[index]
    node.sim("fail", "nvmlDeviceGetHandleByIndex", "--error", "Unknown")
    stage = node.apply(settings_).stage("driver")
    wanted = "nvidia NVreg_EnableGpuFirmware is 0, configured 1"
    assert stage.state == "failed" and "is loaded but NVML fails" in stage.message, stage.message
    assert f"reload required to apply the configured options: {wanted}" in stage.message, stage.message
    config = tmp_path / "command.yaml"
    config.write_text(json.dumps({"version": "v1", **settings_}))
    plan = run_cli("--simulate", "t4", "driver", "reload", "--dry-run", "--json", root=node.root, config=config)
    assert json.loads(plan.stdout)["reload_required"] == wanted, plan.stdout


def test_the_command_in_process_forces_one_pass_then_follows_the_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the GPUs are busy, `gpu-agent driver reload` without a daemon runs a forced pass, then the passes
    the engine's backoff calls for. Before: a forced full pass every second, up to the wait."""
    from gpu_agent.daemon.engine import Engine

    node = SimNode(tmp_path / "root", "t4")
    config = tmp_path / "command.yaml"
    config.write_text("version: v1\ntoolkit: {enabled: false}\nreconcile: {backoff_initial_seconds: 0.2}\n")
    assert node.apply({"toolkit": {"enabled": False}}).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    forced: list[bool] = []
    reconcile = Engine.reconcile

    async def counted(self: Engine, force: bool = False, dry_run: bool = False) -> Any:
        forced.append(force)
        return await reconcile(self, force=force, dry_run=dry_run)

    monkeypatch.setattr(Engine, "reconcile", counted)
    busy = run_cli("--simulate", "t4", "driver", "reload", "--timeout", "0.3", root=node.root, config=config)
    assert busy.returncode == 1 and "still in use after 0.3 s: process 4242 (train.py)" in busy.stderr, busy.stderr
    assert forced[0] and not any(forced[1:]) and len(forced) >= 2, forced


def test_idle_gpus_end_the_commands_wait_with_a_forced_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the command waits for between passes: the engine's next retry, or the GPUs idle while it waits for
    them; nothing else makes a pass."""
    from gpu_agent.cli import driver as command

    class Clock:
        now = 1000.0

        def time(self) -> float:
            return self.now

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.now += seconds

    clock = Clock()
    monkeypatch.setattr(command, "time", clock)

    class Waiting:
        users = ["process 1"]

        def progress(self) -> Any:
            return type("Record", (), {"step": "wait-for-jobs-required"})()

        def consumers(self) -> list[str]:
            return self.users

    class Runtime:
        class engine:  # as the runtime names it
            retry: Any = 1030.0

            @classmethod
            def next_retry(cls) -> Any:
                return cls.retry

    reload = Waiting()
    assert command._until_next_pass(Runtime, reload, deadline=5000.0) is False and clock.now == 1030.0
    Runtime.engine.retry = None
    reload.users = []
    assert command._until_next_pass(Runtime, reload, deadline=5000.0) is True and clock.now == 1030.0
    reload.users = ["process 1"]
    assert command._until_next_pass(Runtime, reload, deadline=1040.0) is True and clock.now == 1040.0  # the end


FBDEV = "options nvidia-drm modeset=1 fbdev=1\n"  # what recent driver packages put in modprobe.d


def test_the_framebuffer_console_on_a_headless_server_is_unbound_for_the_reload_and_bound_again(
        tmp_path: Path, api: KubeEmulator) -> None:
    """nvidia_drm held by the framebuffer console (fbdev) is no display: the console is unbound for the unload
    and bound again to the new driver's framebuffer. Before: refused as "a display uses the GPU"."""
    node = SimNode(tmp_path / "root", "t4")
    node.sim("show")  # the machine made: its kernel's /etc/modprobe.d
    node.kernel("/etc/modprobe.d").mkdir(parents=True)
    node.kernel("/etc/modprobe.d/nvidia-graphics-drivers-kms.conf").write_text(FBDEV)
    config = {**settings(api, node), "mig": {}, "driver": {"reload": "when-idle", "modules": {"nvidia_drm": True}}}
    assert node.apply(config).stage("driver-features").state == "ok"
    console = node.kernel("/sys/class/vtconsole/vtcon1/bind")
    assert console.read_text() == "1\n" and "nvidia_drm 77824 1 - Live" in node.kernel("/proc/modules").read_text()
    node.sim("install-driver", NEW)
    a_minute_later(node)
    done = node.apply(config)
    assert_done(done, node, api)
    assert loaded_version(node.machine.read(), "nvidia_drm") == NEW and console.read_text() == "1\n"
    assert record(node)["consoles"] == []


def test_a_display_server_is_never_unloaded_from_under_and_nothing_is_taken(tmp_path: Path,
                                                                            api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("fail", "modprobe", "--error", "display")
    node.sim("install-driver", NEW)
    a_minute_later(node)
    refused = node.apply(config)
    message = refused.stage("driver").message
    assert "1400 (Xorg) has an NVIDIA DRM device open (a display)" in message and "never unloads" in message
    assert {"nvidia", "nvidia_uvm", "nvidia_drm"} <= set(node.loaded_modules())
    assert unit_state(node, PERSISTENCED) == "active" and not record(node)["plugin_stopped"]


# --- a reboot, and a new target, at each step ---------------------------------------------------------------------

STEPS = (*ORDER[1:-1], "unloaded")  # each step recorded, and every module unloaded


def each_step(fast: str) -> list[Any]:
    """Every step, all but `fast` marked slow."""
    return [step if step == fast else pytest.param(step, marks=pytest.mark.slow) for step in STEPS]


def interrupted(tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, point: str,
                *change: str) -> tuple[SimNode, dict[str, Any]]:
    """A reload killed right after recording `point` (or with every module unloaded), then `sim CHANGE`."""
    node, config = upgraded(tmp_path, api)
    killed_at(point, node, config, monkeypatch)
    node.sim(*change)
    a_minute_later(node)
    return node, config


@pytest.mark.parametrize("point", each_step("unloaded"))
def test_a_reboot_at_any_step_ends_the_reload_without_unloading_the_installed_driver(
        tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, unloads: list[str], point: str) -> None:
    """The installed driver loaded at boot is never unloaded; a unit the agent stopped that the boot did not
    start is started."""
    node, config = interrupted(tmp_path, api, monkeypatch, point, "reboot")
    stopped = record(node)["stopped_units"]
    for unit in stopped:
        SimUnits(node.machine)("stop", unit)  # not started at boot (a unit not enabled)
    unloads.clear()
    assert_done(node.apply(config), node, api)
    assert unloads == [] and (point != "unloaded" or stopped == [PERSISTENCED])


@pytest.mark.parametrize("point", each_step("wait-for-jobs-required"))
def test_a_new_target_at_any_step_is_reloaded_to_with_the_cordon_kept_and_lifted(
        tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    node, config = interrupted(tmp_path, api, monkeypatch, point, "install-driver", NEWER)
    assert_done(node.apply(config), node, api, NEWER)


# --- the cordon's promises, and the Node's say ---------------------------------------------------------------------


def test_a_node_someone_else_cordoned_stays_cordoned_through_a_new_target_an_abort_and_a_reload(
        tmp_path: Path, api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    written = tmp_path / "command.yaml"
    written.write_text(json.dumps({"version": "v1", **config}))
    assert node.apply(config).stage("driver").state == "ok"
    api.modify_node(NODE, lambda n: n["spec"].update(unschedulable=True))  # an administrator's cordon
    upgraded_under_a_job(node)
    node.apply(config)
    assert "the node was already cordoned: it is left cordoned" in record(node)["notes"]
    assert not record(node)["cordoned"]
    node.sim("install-driver", NEWER)
    a_minute_later(node)
    assert json.loads(abort(node, written).stdout)["reload"]["step"] == "upgrade-abandoned"
    assert cordoned(api) and api.labels()[STATE] == "upgrade-abandoned"
    node.sim("clear")
    a_minute_later(node)
    done = run_cli("--simulate", "t4", "driver", "reload", root=node.root, config=written)
    assert done.returncode == 0 and f"-> {NEWER}" in done.stdout, done.stderr
    assert cordoned(api) and api.labels()[STATE] == "upgrade-done"  # theirs to uncordon


def test_a_cordon_the_api_forbids_is_noted_and_the_reload_goes_on(tmp_path: Path, api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    api.fail_next(f"/api/v1/nodes/{NODE}", 403, count=None, method="PATCH", message="nodes is forbidden")
    a_minute_later(node)
    done = node.apply(config)  # the labels are refused too: warned, and the labels stage says so
    assert done.stage("driver-upgrade").state == "ok", done.stage("driver-upgrade").message
    assert any(note.startswith("not cordoned: the node's credentials may not") for note in record(node)["notes"])
    assert not cordoned(api) and loaded_version(node.machine.read(), "nvidia") == NEW
    api.clear_faults()
    a_minute_later(node)
    assert node.apply(config).ok and api.labels()[STATE] == "upgrade-done"


def test_an_uncordon_the_api_server_sheds_waits_at_uncordon_required_and_goes_on(tmp_path: Path,
                                                                               api: KubeEmulator) -> None:
    """The uncordon answered 429 (the API server shedding load; the agent's own request budget spent is the
    same case, which the real cluster's reload met): not a failed reload, which `gpu-agent driver reload` would
    report as such, but one that waits at uncordon-required for the API's schedule, then uncordons."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    upgraded_under_a_job(node)
    assert node.apply(config).stage("driver").state == "failed" and cordoned(api)  # waits for the process
    node.sim("clear")
    api.fail_next(f"/api/v1/nodes/{NODE}", 429, count=None, method="PATCH", retry_after=5)
    a_minute_later(node)
    shed = node.apply(config)
    assert loaded_version(node.machine.read(), "nvidia") == NEW
    assert record(node)["step"] == "uncordon-required" and cordoned(api), record(node)["failure"]
    upgrade = shed.stage("driver-upgrade")
    assert upgrade.state == "failed" and "uncordoning waits for the API server" in upgrade.message, upgrade.message
    api.clear_faults()
    a_minute_later(node)
    done = node.apply(config)
    assert done.stage("driver-upgrade").state == "ok" and record(node)["step"] == "upgrade-done"
    assert not cordoned(api) and api.labels()[STATE] == "upgrade-done"


@pytest.mark.parametrize("say", ["label skip", "annotation enabled=false"])
def test_the_nodes_say_keeps_a_reload_from_starting_not_from_finishing(tmp_path: Path, api: KubeEmulator,
                                                                       say: str) -> None:
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"

    def forbid() -> None:
        if say == "label skip":
            api.set_labels({"nvidia.com/gpu-driver-upgrade.skip": "true"}, NODE)
        else:
            api.set_annotations({"nvidia.com/gpu-driver-upgrade-enabled": "false"}, NODE)

    forbid()
    node.sim("install-driver", NEW)
    a_minute_later(node)
    report = node.apply(config)
    assert "says not to" in report.stage("driver").message and Ledger(Root(node.root)).driver_reload() is None
    assert not cordoned(api) and api.labels()[STATE] == "upgrade-required"
    api.set_labels({"nvidia.com/gpu-driver-upgrade.skip": None}, NODE)
    api.set_annotations({"nvidia.com/gpu-driver-upgrade-enabled": None}, NODE)
    node.sim("fail", "rmmod", "--module", "nvidia", "--times", "1")
    a_minute_later(node)
    assert "could not unload nvidia" in node.apply(config).stage("driver").message and cordoned(api)
    forbid()  # said once the reload began: it is finished all the same
    a_minute_later(node)
    assert_done(node.apply(config), node, api)


def test_abort_leaves_a_half_loaded_module_as_it_is_and_names_it(tmp_path: Path, api: KubeEmulator) -> None:
    """The new nvidia's init never returns (its modprobe killed at driver.modprobe_timeout_seconds): the module
    is listed Loading. `--abort` loads nothing beside it, names it and says a reboot clears it; the reboot does."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    config["driver"]["modprobe_timeout_seconds"] = 0.05
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "stuck")
    a_minute_later(node)
    failed = node.apply(config)
    assert "could not load nvidia: modprobe nvidia did not finish within 0.05 s and was killed" in \
        failed.stage("driver").message, failed.stage("driver").message
    written = tmp_path / "command.yaml"
    written.write_text(json.dumps({"version": "v1", **config}))
    a_minute_later(node)
    outcome = json.loads(abort(node, written).stdout)
    assert outcome["ok"] and "nvidia never finished loading or unloading (left as it is: a reboot clears it)" in \
        outcome["reload"]["notes"], outcome
    assert not cordoned(api) and " Loading " in node.kernel("/proc/modules").read_text()
    assert unit_state(node, PERSISTENCED) == "active"  # the units come back, the driver with the reboot
    node.sim("reboot")
    a_minute_later(node)
    after = node.apply(config)
    assert after.stage("driver").state == "ok" and loaded_version(node.machine.read(), "nvidia") == NEW
    assert api.labels()[STATE] == "upgrade-done"
