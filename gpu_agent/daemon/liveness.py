"""Liveness means progress: the daemon is alive while its reconcile passes complete, not merely while the
task that runs them exists.

A pass blocked for good (a worker thread stuck opening a FIFO, a call without a timeout) leaves the loop
task waiting forever: before, /healthz stayed 200 and the watchdog kept pinging. Now the last completed
pass (or the daemon's start) must be at most `bound()` seconds old: the reconcile interval (the longest the
loop sleeps between passes), plus what one pass may spend waiting on the timeouts its stages set (each
wait as many times as one pass can meet it), plus GRACE_S for the work between the waits. Past that,
/healthz answers 500 naming the stage the pass is in, and the watchdog stops pinging.
"""
from __future__ import annotations

import time
from typing import Optional

from gpu_agent.config.driver import KNOWN_MODULES
from gpu_agent.config.schema import AgentConfig
from gpu_agent.stages import cuda_check
from gpu_agent.toolkit import packages, versions

GRACE_S = 60.0  # the work of a pass between its waits, on a loaded node
DEFAULT_GPUS = 8  # before discovery has counted them
_RUNTIMES = 3  # containerd, docker, cri-o: each may be restarted, and asked its version, in one pass
_API_REQUESTS = 4  # Kubernetes API requests one pass may make (the Node, its labels, its annotations)


def waits(config: AgentConfig, gpus: int = DEFAULT_GPUS, reloading: bool = False) -> list[tuple[str, float]]:
    """What one pass may spend waiting, by the setting (or fixed timeout) that bounds it. `reloading`: a
    driver reload was asked for (`gpu-agent driver reload`), whatever driver.reload says."""
    found: list[tuple[str, float]] = [
        # A hung call costs one timeout; the calls after it fail at once until it returns.
        ("nvml.call_timeout_seconds", 2 * config.nvml.call_timeout_seconds),
    ]
    driver = config.driver
    if driver.enabled:
        found.append(("driver.modprobe_timeout_seconds", len(KNOWN_MODULES) * driver.modprobe_timeout_seconds))
        if driver.validate_cuda:
            found.append(("CUDA validation", cuda_check.TIMEOUT_S))
        if driver.reload != "never" or reloading:  # its units stopped and started again, the modules unloaded
            found.append(("driver.reload_units", 2 * len(driver.reload_units) * config.toolkit.restart_timeout_seconds
                          + len(KNOWN_MODULES) * driver.modprobe_timeout_seconds))
    toolkit = config.toolkit
    found.append(("runtime --version", (_RUNTIMES + 1) * versions.TIMEOUT_S))
    if toolkit.enabled:
        found.append(("toolkit.restart_timeout_seconds", _RUNTIMES * toolkit.restart_timeout_seconds))
        if toolkit.install:
            found.append(("toolkit.install", 2 * packages.TIMEOUT_S))  # the package lists, then the install
    mig = config.mig
    if mig.config or mig.follow_node_label:
        found.append(("mig.reset_timeout_seconds", gpus * mig.reset_timeout_seconds))
        # Each unit stopped before the resets and started after them.
        found.append(("mig.stop_units", 2 * len(mig.stop_units) * toolkit.restart_timeout_seconds))
    if config.kubernetes.enabled is not False:
        found.append(("kubernetes.request_timeout_seconds", _API_REQUESTS * config.kubernetes.request_timeout_seconds))
    return found


def bound(config: AgentConfig, gpus: int = DEFAULT_GPUS, reloading: bool = False) -> float:
    """Seconds since the last completed pass after which the daemon is not live."""
    return config.reconcile.interval_seconds + sum(seconds for _, seconds in waits(config, gpus, reloading)) + GRACE_S


def stalled(config: AgentConfig, last_pass: float, running: Optional[tuple[str, float]],
            gpus: int = DEFAULT_GPUS, reloading: bool = False, now: Optional[float] = None) -> Optional[str]:
    """Why the daemon is not live, or None. `last_pass`: when the last pass completed (or the daemon
    started), `running`: the stage a pass is in and since when, both on the monotonic clock."""
    now = time.monotonic() if now is None else now
    limit = bound(config, gpus, reloading)
    if now - last_pass <= limit:
        return None
    where = "no pass is running"
    if running is not None:
        stage, since = running
        where = f"the pass in progress has been in stage {stage} for {now - since:.0f} s"
    return (f"no reconcile pass completed in {now - last_pass:.0f} s, more than the {limit:.0f} s a pass may "
            f"take (reconcile.interval_seconds and the stages' timeouts); {where}")
