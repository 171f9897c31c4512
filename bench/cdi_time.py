"""Time CDI spec generation (the cdi stage's observe: discover driver files, build the spec, render YAML) on a
simulated node an agent has already converged under ROOT. Prints JSON.

    python bench/cdi_time.py ROOT RUNS
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.replay import simulated_nvml
from gpu_agent.toolkit import cdi


def main() -> None:
    root, runs = Root(Path(sys.argv[1])), int(sys.argv[2])
    machine = MachineState(root)
    root = root.with_kernel(machine.kernel_dir)
    nvml = Nvml(simulated_nvml(machine), 10.0)
    inventory = nvml.inventory.read()
    times, spec = [], ""
    for _ in range(runs):
        started = time.perf_counter()
        files = cdi.discover(root, inventory.driver_version)
        spec = cdi.render(cdi.build_spec(inventory, root, files))
        times.append((time.perf_counter() - started) * 1000)
    nvml.close()
    migs = sum(len(gpu.mig.devices) for gpu in inventory.gpus)
    print(json.dumps({"times_ms": times, "spec_bytes": len(spec.encode()), "gpus": len(inventory.gpus),
                      "mig_devices": migs, "cdi_devices": len(cdi.build_spec(inventory, root, files)["devices"])}))


if __name__ == "__main__":
    main()
