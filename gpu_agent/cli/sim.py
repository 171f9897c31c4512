"""gpu-agent sim: look at a simulated node and rehearse failures on it; a running daemon sees them within a second."""
from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from gpu_agent.cli.common import root_of
from gpu_agent.errors import EXIT_OK, AgentError
from gpu_agent.printable import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="the simulated machine: GPUs, MIG, processes, faults")
    show.add_argument("--json", action="store_true")
    xid = actions.add_parser("inject-xid", help="raise an XID event on a GPU")
    xid.add_argument("--gpu", type=int, required=True, metavar="N")
    xid.add_argument("--xid", type=int, required=True, metavar="X")
    xid.add_argument("--gpu-instance", type=int, metavar="GI",
                     help="on a MIG device: the GPU instance id the event names (default: the whole GPU)")
    xid.add_argument("--compute-instance", type=int, metavar="CI",
                     help="with --gpu-instance: the compute instance id the event names")
    condition = actions.add_parser("set", help="what a GPU's health checks read: temperature, row remapping")
    condition.add_argument("--gpu", type=int, required=True, metavar="N")
    condition.add_argument("--temperature", type=int, metavar="C",
                           help="the GPU temperature NVML reports (default: from its load)")
    condition.add_argument("--pending-remaps", type=int, metavar="K",
                           help="rows (or pages) waiting for a remap at the next GPU reset")
    condition.add_argument("--remap-failure", type=int, choices=(0, 1), metavar="0|1",
                           help="1: a row remapping failed")
    fail = actions.add_parser(
        "fail", help="make an NVML call or modprobe fail like a real driver or kernel",
        description="CALL is an NVML function (nvmlDeviceGetTemperature, ..., and every MIG call: "
                    "nvmlDeviceSetMigMode, nvmlDeviceCreateGpuInstanceWithPlacement, nvmlGpuInstanceDestroy, ...) "
                    "or modprobe or rmmod. NVML calls raise "
                    "the named NVMLError (GpuIsLost, Unknown, Timeout, ...) or hang. modprobe fails with "
                    "not-found (no module for this kernel), key-rejected (Secure Boot) or hang (until `sim clear`, or "
                    "killed after driver.modprobe_timeout_seconds); --error nouveau loads "
                    "nouveau at once, --error version-mismatch leaves an older nvidia module behind the NVML "
                    "library (a half-finished upgrade whose new module was never built for this kernel: the one on "
                    "disk is old too; `sim install-driver` is the upgrade a reload fixes), --error display has a "
                    "display hold nvidia_drm. "
                    "--error stuck leaves the module Loading (its init never returns) and its modprobe killed after "
                    "the timeout, until a reboot. "
                    "rmmod fails with in-use (--module M: only that module). restart makes a container runtime's "
                    "restart fail "
                    "(--error failed), its socket never answer (--error not-ready), or systemctl hang until its "
                    "timeout (--error hangs); stop and start make `systemctl stop|start` of a unit fail (--error "
                    "failed; a start leaves it failed). install makes installing "
                    "the container toolkit fail as apt-get does without NVIDIA's repository.")
    fail.add_argument("call", metavar="CALL", help="NVML function name, modprobe, rmmod, restart (a runtime's unit), "
                                                   "stop or start (a unit), install, mps (the MPS control "
                                                   "daemons: --error die or hang), iommu (the kernel has no "
                                                   "IOMMU), unbind (a driver's unbind is busy) or bind (a "
                                                   "driver's bind is refused)")
    fail.add_argument("--gpu", type=int, metavar="N", help="NVML: only on this GPU (default: every GPU)")
    fail.add_argument("--module", metavar="M", help="modprobe, rmmod: only for this module (default: any)")
    fail.add_argument("--unit", metavar="U", help="restart, stop, start: only for this systemd unit (default: any)")
    fail.add_argument("--resource", metavar="R", help="mps: only this resource's daemon, e.g. nvidia.com/gpu "
                                                      "(default: every one)")
    fail.add_argument("--times", type=int, metavar="K", help="fail K times, then work again (default: until clear)")
    fail.add_argument("--error", default=None, metavar="NAME",
                      help="NVML: an NVMLError name or 'hang' (default Unknown); "
                           "modprobe: not-found, key-rejected, nouveau, version-mismatch (default not-found)")
    process = actions.add_parser("add-process", help="run a (pretend) compute process on a GPU")
    process.add_argument("--gpu", type=int, required=True, metavar="N")
    process.add_argument("--pid", type=int, required=True, metavar="P")
    process.add_argument("--name", required=True)
    process.add_argument("--memory-mib", type=int, default=1024, metavar="MIB")
    process.add_argument("--mps", metavar="RESOURCE",
                         help="a client of RESOURCE's MPS control daemon (e.g. nvidia.com/gpu): the daemon starts its "
                              "MPS server, which holds the GPUs open and stays after its last client ends")
    runtime = actions.add_parser(
        "install-runtime", help="install a container runtime, the kubelet or Podman at a version, as its Debian "
                                "package would: its binary and its record in the package database")
    runtime.add_argument("name", choices=("containerd", "docker", "crio", "kubelet", "podman"))
    runtime.add_argument("version", metavar="VERSION", help="e.g. 1.6.20 (Debian 12's containerd) or 1.7.24")
    actions.add_parser("clear", help="remove injected faults, XID events, processes and `sim set` conditions; "
                                     "put GPUs that fell off the bus (XID 79) back")
    actions.add_parser("reload-driver", help="unload the NVIDIA modules and load them again, the installed version: "
                                             "MIG instances are gone, Hopper and later lose MIG mode (Ampere keeps "
                                             "it), compute modes are DEFAULT")
    install = actions.add_parser(
        "install-driver", help="install another driver version as a package upgrade does: the libraries and the "
                               "modules on disk change, the loaded module stays (NVML then answers "
                               "Driver/library version mismatch)")
    install.add_argument("version", metavar="VERSION", help="e.g. 570.124.06")
    actions.add_parser("reboot", help="reboot the node: a new boot id, processes and MPS control daemons end, "
                                      "compute modes are DEFAULT, pending MIG modes take effect, the NVIDIA modules "
                                      "that were loaded load at their installed version, every unit runs again")


def main(args: argparse.Namespace) -> int:
    from gpu_agent.sim.machine import MachineState

    machine = MachineState(root_of(args))
    if args.simulate:
        machine.ensure(args.simulate)
    handler = {"show": _show, "inject-xid": _inject_xid, "fail": _fail, "add-process": _add_process,
               "clear": _clear, "set": _set, "reload-driver": _reload_driver, "reboot": _reboot,
               "install-driver": _install_driver,
               "install-runtime": _install_runtime}[args.sim_command]
    handler(machine, args)
    return EXIT_OK


def _gpu_index(state: dict[str, Any], index: int) -> int:
    count = len(state["gpus"])
    if not 0 <= index < count:
        raise AgentError(f"--gpu {index}: the simulated machine has {count} GPU(s) (0..{count - 1})")
    return index


def _show(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.pci import gpu_driver, iommu_groups, sysfs_address

    state = machine.read()
    groups = iommu_groups(state)
    if args.json:
        shown = dict(state, gpus=[dict(gpu, driver=gpu_driver(state, gpu),
                                       iommu_group=groups.get(sysfs_address(gpu["pci_bus_id"])))
                                  for gpu in state["gpus"]])
        print(json.dumps(shown, indent=2))
        return
    driver = state["driver_version"] or "none (no NVIDIA driver installed)"
    print(f"machine {state['machine']} ({state['source']}), driver {driver}")
    for index, gpu in enumerate(state["gpus"]):
        mig = gpu["mig"]
        instances = ", ".join(_gpu_instance_text(gi) for gi in mig["gpu_instances"]) or "none"
        mode = "on" if mig["current"] else "off"
        if mig["pending"] != mig["current"]:
            mode += f" (pending {'on' if mig['pending'] else 'off'} until a GPU reset)"
        lost = " OFF THE BUS (GPU_IS_LOST)" if index in state.get("lost_gpus", ()) else ""
        print(f"  GPU {index} {gpu['uuid']} {gpu['pci_bus_id']} {gpu['model']} driver={gpu_driver(state, gpu)} "
              f"mig={mode} instances={instances}{lost}")
        for p in gpu["processes"]:
            client = f" (MPS client of {p['mps']})" if p.get("mps") else ""
            print(f"    process {p['pid']} {p['name']} {p['used_mib']} MiB{client}")
    for resource, daemon in sorted(state.get("mps", {}).items()):
        if daemon["alive"]:
            servers = ", ".join(map(str, daemon["servers"])) or "none"
            quitting = " (quitting)" if daemon.get("quitting") else ""
            print(f"  MPS control daemon {daemon['pid']} for {resource}{quitting}: servers {servers}")
    loaded = ", ".join(m["name"] for m in state["kernel"]["loaded"]) or "nothing"
    print(f"  kernel {state['kernel']['release']}: loaded {loaded}")
    for fault in state["faults"]:
        if fault["call"] in ("modprobe", "rmmod"):
            scope = f"module {fault['module']}" if fault.get("module") else "any module"
        elif fault["call"] == "restart":
            scope = f"unit {fault['unit']}" if fault.get("unit") else "any unit"
        else:
            scope = f"GPU {fault['gpu']}" if fault.get("gpu") is not None else "every GPU"
        times = "until cleared" if fault.get("times") is None else f"{fault['times']} more call(s)"
        print(f"  fault: {fault['call']} on {scope} -> {fault['error']}, {times}")
    for xid in state["xids"]:
        print(f"  xid {xid['xid']} on GPU {xid['gpu']} at {time.strftime('%H:%M:%S', time.localtime(xid['at']))}")


def _gpu_instance_text(gi: dict[str, Any]) -> str:
    """gi2@0:4[ci0@0:4], as nvidia-smi writes placements (start:size)."""
    cis = ",".join(f"ci{ci['id']}@{ci['start']}:{ci['size']}" for ci in gi["compute_instances"])
    return f"gi{gi['id']}@{gi['start']}:{gi['size']}[{cis}]"


def _inject_xid(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.health.policy import LOST_XIDS

    if args.compute_instance is not None and args.gpu_instance is None:
        raise AgentError("--compute-instance needs --gpu-instance: a compute instance lives in a GPU instance")
    with machine.edit() as state:
        gpu = _gpu_index(state, args.gpu)
        event = {"seq": state["next_seq"], "gpu": gpu, "xid": args.xid, "at": time.time()}
        where = ""
        if args.gpu_instance is not None:
            event["gpu_instance_id"] = args.gpu_instance
            where = f" GPU instance {args.gpu_instance}"
        if args.compute_instance is not None:
            event["compute_instance_id"] = args.compute_instance
            where += f" compute instance {args.compute_instance}"
        state["xids"].append(event)
        state["next_seq"] += 1
        off_bus = args.xid in LOST_XIDS
        if off_bus:
            state["lost_gpus"] = sorted({*state.get("lost_gpus", ()), gpu})
    print(f"XID {args.xid} raised on GPU {args.gpu}{where}")
    if off_bus:
        print(f"GPU {args.gpu} has fallen off the bus: NVML answers GPU_IS_LOST for it until `sim clear` "
              "or `sim reboot` puts it back")


def _set(machine: Any, args: argparse.Namespace) -> None:
    with machine.edit() as state:
        gpu = state["gpus"][_gpu_index(state, args.gpu)]
        if args.temperature is not None:
            gpu["temperature_c"] = args.temperature
        rows = gpu.setdefault("remapped_rows", {})
        if args.pending_remaps is not None:
            rows["pending"] = args.pending_remaps
        if args.remap_failure is not None:
            rows["failure"] = args.remap_failure
    print(f"GPU {args.gpu}: temperature {gpu.get('temperature_c', 'from its load')}, "
          f"pending remaps {rows.get('pending', 0)}, remap failure {rows.get('failure', 0)}")


def _fail(machine: Any, args: argparse.Namespace) -> None:
    if args.call == "modprobe":
        _fail_modprobe(machine, args)
        return
    if args.call == "rmmod":
        from gpu_agent.sim.kernel import RMMOD_ERRORS

        error = _error(args, "rmmod", RMMOD_ERRORS)
        _add_fault(machine, args, {"call": "rmmod", "module": args.module, "error": error})
        print(f"rmmod {args.module or '(any module)'} will fail: in use")
        return
    if args.call == "install":
        _add_fault(machine, args, {"call": "install", "error": "not-found"})
        print("installing packages will fail: E: Unable to locate package")
        return
    if args.call == "mps":
        _fail_mps(machine, args)
        return
    if args.call in ("iommu", "bind", "unbind"):
        _fail_pci(machine, args)
        return
    if args.call in ("stop", "start"):
        from gpu_agent.sim.services import UNIT_ERRORS

        error = _error(args, args.call, UNIT_ERRORS)
        _add_fault(machine, args, {"call": args.call, "unit": args.unit, "error": error})
        print(f"systemctl {args.call} {args.unit or '(any unit)'} will fail")
        return
    if args.call == "restart":
        from gpu_agent.sim.services import RESTART_ERRORS

        error = _error(args, "restart", RESTART_ERRORS)
        _add_fault(machine, args, {"call": "restart", "unit": args.unit, "error": error})
        print(f"restarting {args.unit or '(any unit)'} will leave it {error}")
        return
    from gpu_agent.sim.fake import HANG, error_class, error_names
    from gpu_agent.sim.replay import simulated_calls

    error = args.error or "Unknown"
    simulated = simulated_calls(machine.read())
    if args.call not in simulated:
        raise AgentError(f"{args.call}: not modprobe nor an NVML call the simulator implements; one of: "
                         f"{', '.join(sorted(simulated))}")
    if error != HANG:
        try:
            error_class(error)
        except ValueError:
            raise AgentError(f"--error {error}: unknown; one of hang, {', '.join(error_names())}") from None
    _add_fault(machine, args, {"call": args.call, "gpu": args.gpu, "error": error}, gpu=args.gpu)
    print(f"{args.call} will fail with {error}")


def _error(args: argparse.Namespace, call: str, known: tuple[str, ...]) -> str:
    """--error, else the first (the usual) of `call`'s errors; an AgentError for one it does not know."""
    error = args.error or known[0]
    if error not in known:
        raise AgentError(f"--error {error}: unknown for {call}; one of {', '.join(known)}")
    return error


def _fail_pci(machine: Any, args: argparse.Namespace) -> None:
    """iommu: the kernel runs without an IOMMU (no groups, vfio-pci binds nothing); unbind: a driver's unbind is
    refused, busy; bind: a driver's bind is refused (its probe fails). --gpu N: that GPU's functions only."""
    from gpu_agent.sim.pci import FAULTS

    error = _error(args, args.call, FAULTS[args.call])
    _add_fault(machine, args, {"call": args.call, "gpu": args.gpu, "error": error}, gpu=args.gpu)
    print({"iommu": "the kernel now runs without an IOMMU: no IOMMU groups, no /dev/vfio/<group>",
           "unbind": "unbinding a PCI function from its driver will fail: Device or resource busy",
           "bind": "binding a PCI function to a driver will fail: No such device"}[args.call])


def _fail_mps(machine: Any, args: argparse.Namespace) -> None:
    """die: the MPS control daemons (of --resource, or all) exit now, as after kill -9; hang: they stop
    answering on their control pipe until `sim clear`."""
    from gpu_agent.sim.mps import FAULTS, kill

    error = _error(args, "mps", FAULTS)
    if error == "hang":
        _add_fault(machine, args, {"call": "mps", "error": "hang"})
        print("the MPS control daemons will not answer on their control pipes")
        return
    killed = kill(machine, args.resource)
    print(f"MPS control daemon of {', '.join(killed)} killed" if killed else "no MPS control daemon runs")


def _fail_modprobe(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.kernel import KERNEL_STATE_ERRORS, MODPROBE_ERRORS

    error = _error(args, "modprobe", MODPROBE_ERRORS + KERNEL_STATE_ERRORS)
    if error in KERNEL_STATE_ERRORS:
        machine.break_kernel(error)
        print({"nouveau": "nouveau is loaded",
               "version-mismatch": "the nvidia modules, loaded and on disk, are now older than NVML",
               "display": "a display holds nvidia_drm"}[error])
        return
    _add_fault(machine, args, {"call": "modprobe", "module": args.module, "error": error})
    print(f"modprobe {args.module or '(any module)'} will fail with {error}")


def _add_fault(machine: Any, args: argparse.Namespace, fault: dict[str, Any], gpu: Any = None) -> None:
    if args.times is not None and args.times < 1:
        raise AgentError("--times must be at least 1")
    with machine.edit() as state:
        if gpu is not None:
            _gpu_index(state, gpu)
        fault_id = max((f["id"] for f in state["faults"]), default=0) + 1
        state["faults"].append({"id": fault_id, **fault, "times": args.times})


def _add_process(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.mps import connect

    server = None
    with machine.edit() as state:
        gpu = _gpu_index(state, args.gpu)
        process = {"pid": args.pid, "name": args.name, "used_mib": args.memory_mib}
        if args.mps:
            server = connect(state, args.mps, gpu)
            process["mps"] = args.mps
        state["gpus"][gpu]["processes"].append(process)
    print(f"process {args.pid} ({args.name}) running on GPU {args.gpu}"
          + (f", a client of the MPS server {server} of {args.mps}" if server else ""))


def _install_runtime(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.packages import install_runtime

    if not re.fullmatch(r"\d+\.\d+(\.\d+)?[0-9A-Za-z.~+]*", args.version):
        raise AgentError(f"{printable(args.version)} is not a version such as 1.6.20")
    print(install_runtime(machine.root, args.name, args.version))


def _clear(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.mps import clients_ended, servers

    with machine.edit() as state:
        for gpu in state["gpus"]:
            gpu["processes"] = []
            gpu.pop("temperature_c", None)
            gpu.pop("remapped_rows", None)
        state["faults"], state["xids"] = [], []
        back = state.pop("lost_gpus", [])
        quit_now = clients_ended(state)
        left = servers(state)
    print("faults, XID events, processes and `sim set` conditions cleared")
    if quit_now:
        print(f"the MPS control daemon of {', '.join(quit_now)}, told to quit, ended with its last client")
    if left:
        print(f"MPS server {', '.join(str(pid) for pid, _, _ in left)} still runs (an MPS server stays after its "
              "last client): its control daemon's quit ends it")
    if back:
        print(f"GPU {', '.join(map(str, back))} back on the bus at the same PCI bus id (as after a reset): the agent "
              "sees it answer again and counts it healthy")
    print("a GPU made unhealthy by another critical XID is the agent's to forgive: healthy again after "
          "health.recover_after_seconds without one")


def _reload_driver(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.kernel import loaded_version, reload_modules
    from gpu_agent.sim.mig import reload_driver

    from gpu_agent.sim.mps import SERVER, servers

    with machine.edit() as state:
        busy = [f"{p['pid']} ({p['name']}) on GPU {index}" for index, gpu in enumerate(state["gpus"])
                for p in gpu["processes"]]
        busy += [f"{pid} ({SERVER})" for pid, _, _ in servers(state)]
        if busy:
            raise AgentError(f"rmmod: ERROR: Module nvidia is in use by {', '.join(busy)}; end them first "
                             "(sim clear) or use sim reboot")
        before = loaded_version(state, "nvidia")
        if before is None:
            raise AgentError("no nvidia module is loaded: nothing to reload (the agent's driver stage loads it)")
        error = reload_modules(state, _modprobe(machine))
        if error:
            raise AgentError(error)
        for gpu in state["gpus"]:
            reload_driver(gpu, _model_of(state, gpu))
        lost = state.get("lost_gpus", [])
        after = loaded_version(state, "nvidia")
    print(f"nvidia driver reloaded: {before} -> {after}; MIG instances gone; Hopper and later GPUs lost MIG mode; "
          "compute modes DEFAULT")
    if lost:
        print(f"GPU {', '.join(map(str, lost))} still off the bus: a driver reload does not bring a GPU back; "
              "`sim clear` (a reset) or `sim reboot` does")


_DRIVER_VERSION = re.compile(r"[0-9]{2,4}\.[0-9]{1,4}(\.[0-9]{1,4})?")


def _install_driver(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim.kernel import loaded_version

    if not _DRIVER_VERSION.fullmatch(args.version):
        raise AgentError(f"install-driver {args.version!r}: not a driver version such as 570.124.06")
    files = machine.install_driver(args.version)
    loaded = loaded_version(machine.read(), "nvidia")
    print(f"driver {args.version} installed ({'libraries, ' if files else 'simulated NVML, '}modules on disk); loaded "
          f"nvidia module: {loaded or 'none'}")
    if not files:
        print("over the real root the host's libraries stay as they are: the simulated NVML answers as "
              f"{args.version} and the simulated kernel's modules on disk are {args.version}'s")


def _reboot(machine: Any, args: argparse.Namespace) -> None:
    from gpu_agent.sim import mps
    from gpu_agent.sim.kernel import boot, loaded_version
    from gpu_agent.sim.mig import reboot
    from gpu_agent.sim.services import boot_services

    with machine.edit() as state:
        for gpu in state["gpus"]:
            reboot(gpu, _model_of(state, gpu))
        mps.reboot(state)
        state.pop("lost_gpus", None)
        failed = [] if state.get("capture") else boot(state, _modprobe(machine))
        boot_services(machine.root, state)
        version = loaded_version(state, "nvidia") if not state.get("capture") else None
        boot_id = state.get("kernel", {}).get("boot_id")
    driver = f"driver {version} loaded" if version else "no nvidia module loaded"
    print(f"rebooted (boot id {boot_id}): processes and MPS daemons ended, compute modes DEFAULT, GPUs back on the "
          f"bus, pending MIG modes applied, units running, {driver}")
    for error in failed:
        print(f"at boot: {error}")


def _modprobe(machine: Any) -> Any:
    """modprobe as the agent runs it on this machine: /etc/modprobe.d is the simulated kernel's."""
    from gpu_agent.sim.kernel import SimModprobe

    return SimModprobe(machine, machine.root.with_kernel(machine.kernel_dir))


def _model_of(state: dict[str, Any], gpu: dict[str, Any]) -> Any:
    from pathlib import Path

    from gpu_agent.sim.profiles import MODELS
    from gpu_agent.sim.replay import Capture

    if "capture_index" in gpu:
        return Capture.load(Path(state["capture"])).model(gpu["capture_index"])
    return MODELS[gpu["model"]]
