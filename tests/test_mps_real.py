"""The simulated nvidia-cuda-mps-control against a real one (issue 25, point 6): the control pipe transcript
of an H200 node with driver 580.159.04 (tests/data/mps/h200-580-vm/, made by bench/mps_transcript.py) is
sent, command by command, to the simulator, which must answer each exactly as the real daemon did; and the
agent refuses a daemon that does not show the limits it set."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.mps.control import DaemonSpec, pinned_mib, shown_limit
from gpu_agent.mps.layout import SHM_DIR
from gpu_agent.plugin.devices import GPU_RESOURCE
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mps import SimMpsControl
from tests.test_mps import SimDgx

TRANSCRIPT = Path(__file__).parent / "data/mps/h200-580-vm/control-pipe.json"
NOT_MODELLED = ("get_device_client_list",)  # the simulator has no clients: their list is not replayed


def _said(step: dict[str, Any]) -> str:
    return str(step["stdout"] or step["stderr"]).strip()


def test_the_simulator_answers_the_control_pipe_as_the_real_daemon_did(tmp_path: Path) -> None:
    from gpu_agent.host.paths import Root

    real = json.loads(TRANSCRIPT.read_text())
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h200")
    (tmp_path / SHM_DIR.lstrip("/")).mkdir(parents=True)
    control = SimMpsControl(machine, 1.0)
    control.mount_shm("nosuid,nodev,noexec,mode=1777")
    spec = DaemonSpec(GPU_RESOURCE, ("GPU-0",), (0,), (143771,), 4)
    compared = 0
    for step in real["steps"]:
        if step["argv"] == ["-d"]:
            if step["rc"] == 0:
                control.start(spec)
            else:
                with pytest.raises(AgentError) as error:
                    control.start(spec)
                assert str(error.value).endswith(f"failed (exit {step['rc']}): {_said(step)}")
            compared += 1
            continue
        command = step["stdin"].strip()
        if command.startswith(NOT_MODELLED):
            continue
        servers = [int(pid) for pid in step["stdout"].split()] if command == "get_server_list" else None
        if servers:  # a client connected on the real node (the simulator has none): its server is there too
            with machine.edit() as state:
                state["mps"][GPU_RESOURCE]["servers"] = servers
        assert step["rc"] == 0
        assert control.send(spec, command) == step["stdout"], command
        compared += 1
    after = real["after_quit"]
    with pytest.raises(AgentError, match=f"failed \\(exit {after['rc']}\\): {_said(after)}"):
        control.send(spec, "get_server_list")
    assert compared == len(real["steps"]) - 1  # everything but the client list


@pytest.mark.parametrize("limit, shown", [("512M", "512M"), ("1023M", "1023M"), ("1024M", "1G"), ("1536M", "1G"),
                                          ("20000M", "19G"), ("35942M", "35G"), ("2G", "2G")])
def test_pinned_limits_are_shown_as_the_real_daemon_showed_them(limit: str, shown: str) -> None:
    assert shown_limit(limit) == shown and pinned_mib("lots") == -1


class _ForgetfulControl(SimMpsControl):
    """A control daemon that takes the commands but keeps no pinned memory limit."""

    def send(self, spec: DaemonSpec, command: str) -> str:
        answer = super().send(spec, command)
        return "" if command.startswith("get_default_device_pinned_mem_limit") else answer


def test_a_daemon_that_does_not_show_the_limit_set_is_kept_down_naming_why(tmp_path: Path) -> None:
    from gpu_agent.mps.daemons import MpsManager
    from tests.test_mps import FAST

    dgx = SimDgx.make(tmp_path)
    try:
        state = dgx.state()
        manager = MpsManager(dgx.root, state, _ForgetfulControl(dgx.machine, 0.2), dgx.nvml.inventory, lambda: None,
                             FAST)
        asyncio.run(manager.sync())
        assert state.mps is not None
        assert state.mps["daemons"][0]["error"] == (
            f"the MPS control daemon for {GPU_RESOURCE} shows the pinned memory limit of its device 0 as none, not "
            "19G (20389M): its clients would not be limited as asked")
        assert state.mps["daemons"][0]["state"] == "down" and GPU_RESOURCE not in state.mps_running
        assert GPU_RESOURCE in state.mps_down
    finally:
        dgx.nvml.close()
