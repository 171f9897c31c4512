"""Issue 26 with the daemon as a process: the acceptance case on a simulated DGX H100 with MIG and the device
plugin (the kubelet sees the plugin register again after the reload), and a real kill -9 in the middle of a
reload, then a fresh daemon that reports and finishes. Slow: each runs daemons for several passes."""
from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from grpclib.server import Server

from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.host.sockets import socket_address
from gpu_agent.sim.kernel import loaded_version
from gpu_agent.stages.driver_reload import ORDER
from harness import SimNode
from kube_emulator import KubeEmulator
from test_driver_reload import (  # noqa: F401 (kube_api: the fixture `api`)
    NEW,
    NODE,
    PLUGIN_DIR,
    STATE,
    Kubelet,
    kube_api,
    label_history,
    list_devices,
    settings,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


class KubeletThread:
    """The kubelet's Registration service on its own event loop and thread, beside a daemon process."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.kubelet = Kubelet()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kubelet", daemon=True)
        self.thread.start()
        self.server: Optional[Server] = None
        self.call(self._serve())

    async def _serve(self) -> None:
        self.server = Server([self.kubelet])
        address, fd = socket_address(self.directory / "kubelet.sock")
        try:
            await self.server.start(path=address)
        finally:
            if fd is not None:
                os.close(fd)

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(20)

    def registrations(self, resource: str) -> int:
        return self.kubelet.registered.count(resource)

    def devices(self, socket: Path) -> list[str]:
        return self.call(list_devices(socket))

    def close(self) -> None:
        async def stop() -> None:
            if self.server is not None:
                self.server.close()
                await self.server.wait_closed()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def kubelet(root: Path) -> Iterator[KubeletThread]:
    standin = KubeletThread(root / PLUGIN_DIR)
    yield standin
    standin.close()


def a_minute_later(root: Path) -> None:
    """The node's API request budget (12 a minute) as a minute later: the daemon's passes come back to back."""
    budget = root / "var/lib/gpu-agent/kube-requests.json"
    budget.parent.mkdir(parents=True, exist_ok=True)
    temporary = budget.with_name("kube-requests.json.test")
    temporary.write_text(json.dumps({"sent": []}))
    os.replace(temporary, budget)


def wait_for(root: Path, condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """wait_until, with the API budget renewed at each look."""
    def renewed() -> Any:
        a_minute_later(root)
        return condition()

    return wait_until(renewed, what, timeout)


def plugin_socket(daemon: Any, root: Path, resource: str) -> Optional[Path]:
    """Where /status says `resource` is served, once registered; None until then."""
    status, body = daemon.get("/status")
    plugin = json.loads(body).get("plugin") or {} if status == 200 else {}
    served = [r for r in plugin.get("resources", []) if r["name"] == resource and r["registered"] and r["socket"]]
    return root / served[0]["socket"].lstrip("/") if served else None


def test_dgx_h100_with_mig_and_the_plugin_reloads_when_idle_and_the_plugin_registers_again(
        agent: Any, root: Path, api: KubeEmulator, kubelet: KubeletThread) -> None:
    node = SimNode(root, "dgx-h100")
    config = settings(api, node)
    config["mig"]["strategy"] = "mixed"
    config["reconcile"] = {"backoff_initial_seconds": 0.5}
    resource = "nvidia.com/mig-1g.10gb"
    daemon = agent(simulate="dgx-h100", settings=config)
    daemon.wait_ready()
    socket = wait_for(root, lambda: plugin_socket(daemon, root, resource), f"{resource} registered")
    before = kubelet.devices(socket)
    assert len(before) == 16 and kubelet.registrations(resource) == 1  # two 1g.10gb on each of 8 GPUs
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("install-driver", NEW)
    wait_for(root, lambda: api.labels().get(STATE) == "wait-for-jobs-required", "waiting for the GPU process")
    assert api.get_node(NODE)["spec"].get("unschedulable") is True
    daemon.wait_http("/readyz", lambda status, body: status == 503 and "4242" in body)  # the pass's end published
    node.sim("clear")  # the process ends
    wait_for(root, lambda: api.labels().get(STATE) == "upgrade-done", "the reload done")
    assert not api.get_node(NODE)["spec"].get("unschedulable")
    assert loaded_version(node.machine.read(), "nvidia") == NEW
    wait_for(root, lambda: kubelet.registrations(resource) == 2, f"{resource} registered again")
    socket = wait_for(root, lambda: plugin_socket(daemon, root, resource), f"{resource} served again")
    after = kubelet.devices(socket)
    assert len(after) == len(before) and not set(before) & set(after)  # the MIG devices made again
    history = label_history(api)
    assert history == [s for s in ORDER if s in history] and history[-1] == "upgrade-done", history
    assert {"cordon-required", "wait-for-jobs-required", "pod-restart-required", "validation-required"} <= set(history)


def test_kill_9_with_every_module_unloaded_then_a_fresh_daemon_reports_and_finishes(
        agent: Any, root: Path, api: KubeEmulator, kubelet: KubeletThread) -> None:
    """The daemon is SIGKILLed while it loads the new driver (modprobe hangs there): every NVIDIA module
    unloaded, the plugin stopped, the node cordoned. A fresh daemon keeps the plugin off and, while the load
    still fails, says why in /status and the node's condition; once it loads, it finishes and uncordons."""
    node = SimNode(root, "t4")
    config = {**settings(api, node), "mig": {}, "reconcile": {"backoff_initial_seconds": 0.5}}
    resource = "nvidia.com/gpu"
    first = agent(simulate="t4", settings=config)
    first.wait_ready()
    wait_for(root, lambda: plugin_socket(first, root, resource), f"{resource} registered")
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "hang")
    node.sim("install-driver", NEW)

    def loading() -> bool:
        record = Ledger(Root(root)).driver_reload() or {}
        return (record.get("step") == "pod-restart-required" and record.get("plugin_stopped") is True
                and "nvidia" not in node.loaded_modules())

    wait_for(root, loading, "the reload blocked loading the new modules")
    assert first.proc is not None
    first.proc.kill()
    first.proc.wait(10)
    stored = api.get_node(NODE)
    assert stored["spec"].get("unschedulable") is True and stored["metadata"]["labels"][STATE] == "pod-restart-required"

    node.sim("clear")
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "key-rejected")  # the next agent's load fails too
    second = agent(simulate="t4", settings=config)
    second.wait_ready()
    failing = f"driver reload of 550.90.07 to {NEW} failed at pod-restart-required: could not load nvidia"
    status = wait_for(root, lambda: (document := json.loads(second.get("/status")[1])).get("plugin") and document,
                      "/status with the plugin's section")
    upgrade = next(stage for stage in status["stages"] if stage["name"] == "driver-upgrade")
    assert upgrade["state"] == "failed" and failing in upgrade["message"] and "cordoned" in upgrade["message"], upgrade
    assert status["plugin"]["resources"] == [] and "driver reload" in status["plugin"]["reason"], status["plugin"]
    wait_for(root, lambda: (c := api.condition("GPUAgentReady")) and c["status"] == "False" and failing in c["message"],
             "the condition naming the failure")
    assert api.get_node(NODE)["spec"].get("unschedulable") is True and api.labels()[STATE] == "upgrade-failed"
    assert kubelet.registrations(resource) == 1  # the plugin stayed off from the new daemon's first pass

    node.sim("clear")
    wait_for(root, lambda: api.labels().get(STATE) == "upgrade-done", "the reload finished")
    assert not api.get_node(NODE)["spec"].get("unschedulable") and loaded_version(node.machine.read(), "nvidia") == NEW
    wait_for(root, lambda: kubelet.registrations(resource) == 2, f"{resource} registered again")
    wait_for(root, lambda: (api.condition("GPUAgentReady") or {}).get("status") == "True", "the condition true again")
