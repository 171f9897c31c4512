"""NVIDIA's device plugin v0.20 test tables, replayed on the agent: the shared-devices allocation policy
(tests/facts/device_plugin_allocation.py), on upstream's own device ids and over gRPC on a simulated
dgx-h100 with 7 replicas per GPU; Allocate's request check and how failRequestsGreaterThanOne loads
(device_plugin_requests.py); MIG profiles with suffixes as their own resources (device_plugin_resources.py);
and the XID health-check lists (device_plugin_health.py). Each case names upstream's file, test and commit."""
from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from facts import device_plugin_allocation as allocation
from facts import device_plugin_health as health_facts
from facts import device_plugin_requests as requests
from facts import device_plugin_resources as resources
from gpu_agent.config.loader import parse_config, validated
from gpu_agent.config.plugin import PluginConfig
from gpu_agent.config.schema import HealthConfig
from gpu_agent.errors import ConfigError
from gpu_agent.health.policy import is_critical
from gpu_agent.host.paths import Root
from gpu_agent.host.sockets import socket_address
from gpu_agent.nvml.model import ComputeInstance, Gpu, GpuInstance, Inventory, MigState
from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import GPU_RESOURCE, PluginDevice, Resource, advertised
from gpu_agent.plugin.preferred import preferred
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.plugin.shared_policy import NotEnoughDevices, preferred_allocation
from harness import SimNode
from kubelet_api import deviceplugin_pb2 as api
from kubelet_api.deviceplugin_grpc import DevicePluginStub


# --- the shared-devices allocation policy ---------------------------------------------------------------

def upstream_resource(case: allocation.Case) -> Resource:
    """The case's devices as upstream names them (`gpu0::1`), each GPU's index its place in the case."""
    devices = tuple(PluginDevice(f"{gpu}::{n}", gpu, gpu, index, None, True)
                    for index, (gpu, count) in enumerate(case.replicas) for n in range(count))
    return Resource(GPU_RESOURCE, devices, max(count for _, count in case.replicas))


def check(case: allocation.Case, answer: list[str], gpu_of: dict[str, str]) -> None:
    """What upstream's test checks of an answer; `gpu_of` maps a device's GPU to upstream's name for it."""
    counts = Counter(gpu_of[device.split("::")[0]] for device in answer)
    assert len(answer) == case.size and len(set(answer)) == case.size, answer
    if case.per_gpu is not None:
        assert dict(counts) == dict(case.per_gpu), answer
    if case.shape is not None:
        assert tuple(sorted(counts.values(), reverse=True)) == case.shape, answer


def ids_of(case: allocation.Case, resource: Resource) -> tuple[list[str], list[str]]:
    every = [device.id for device in resource.devices]
    return (list(case.available) if case.available is not None else every), list(case.required)


@pytest.mark.parametrize("case", allocation.CASES, ids=lambda case: case.name)
def test_upstream_allocation_cases_on_upstream_ids(case: allocation.Case) -> None:
    resource = upstream_resource(case)
    available, required = ids_of(case, resource)
    repeats = allocation.DEFAULT_REPEATS if case.test == "TestDistributedAllocIsDefault" else 1
    policy = PluginConfig().shared_devices_allocation_policy if repeats > 1 else case.policy
    for order in (available, available[::-1]) * repeats:  # upstream's ids come in Go's map order: any order
        if case.error:
            with pytest.raises(NotEnoughDevices):
                preferred_allocation(resource, order, required, case.size, policy, None)
            continue
        check(case, preferred_allocation(resource, order, required, case.size, policy, None),
              {gpu: gpu for gpu, _ in case.replicas})


def test_the_default_policy_is_distributed_and_an_unknown_one_is_refused_naming_the_key() -> None:
    assert PluginConfig().shared_devices_allocation_policy == allocation.DEFAULT_POLICY
    assert validated(PluginConfig, {"shared_devices_allocation_policy": "packed"}).shared_devices_allocation_policy \
        == "packed"
    with pytest.raises(ConfigError, match=r"^c.yaml:3: plugin\.shared_devices_allocation_policy: Input should be "
                                          r"'distributed' or 'packed'$"):
        parse_config(f"version: v1\nplugin:\n  shared_devices_allocation_policy: {allocation.UNKNOWN_POLICY}\n",
                     "c.yaml")


def test_full_gpus_take_the_aligned_path_whatever_the_policy() -> None:
    """TestFullGPUNodeIgnoresAllocationPolicy: full GPUs offered without replicas are placed as the
    topology policy places them under both policies; MIG devices and replicas never are."""
    gpus = allocation.FULL_GPUS
    full = Resource(GPU_RESOURCE, tuple(PluginDevice(u, u, u, n, None, True) for n, u in enumerate(gpus)))
    for policy in ("distributed", "packed"):
        for size in range(len(gpus) + 2):
            assert preferred_allocation(full, list(gpus), [], size, policy, None) == preferred(gpus, [], size, None)
    mig = Resource("nvidia.com/mig-1g.10gb", (PluginDevice("MIG-aaa", "MIG-aaa", "GPU-aaa", 0, None, True),))
    with pytest.raises(NotEnoughDevices):  # the shared path: the aligned one answers [] instead
        preferred_allocation(mig, ["MIG-aaa"], [], 2, "packed", None)
    shared = Resource(GPU_RESOURCE, tuple(PluginDevice(f"gpu0::{n}", "gpu0", "gpu0", 0, None, True) for n in range(4)),
                      4)
    with pytest.raises(NotEnoughDevices):
        preferred_allocation(shared, ["gpu0::0"], [], 2, "distributed", None)


async def _preferred(directory: Path, available: list[str], required: list[str], size: int) -> list[str]:
    address, descriptor = socket_address(directory / "nvidia-gpu.sock")
    channel = Channel(path=address)
    try:
        response = await DevicePluginStub(channel).GetPreferredAllocation(api.PreferredAllocationRequest(
            container_requests=[api.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=required, allocation_size=size)]))
        return list(response.container_responses[0].deviceIDs)
    finally:
        channel.close()
        if descriptor is not None:
            os.close(descriptor)


@pytest.mark.parametrize("policy", ["distributed", "packed"])
def test_upstream_allocation_cases_on_a_simulated_dgx_h100_with_7_replicas_per_gpu(tmp_path: Path,
                                                                                  policy: str) -> None:
    """The agent's own plugin endpoint, over gRPC. A case's GPU k is the node's GPU k; its replicas are
    replicas 0..n-1 of the 7 there, the others allocated (not offered), as on the other GPUs: every GPU
    of a case has as many allocated, so upstream's expectations stand."""
    root = tmp_path / "r"
    state = SimNode(root, "dgx-h100").apply({
        "toolkit": {"enabled": False},
        "plugin": {"enabled": True, "shared_devices_allocation_policy": policy,
                   "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 7}]}}}}).state
    directory = root / "var/lib/kubelet/device-plugins"
    directory.mkdir(parents=True)
    assert state.inventory is not None
    uuids = [gpu.uuid for gpu in state.inventory.gpus]
    cases = [case for case in allocation.CASES if case.policy == policy]

    def on_node(case: allocation.Case, device: str) -> str:
        gpu, replica = device.split("::")
        return f"{uuids[[name for name, _ in case.replicas].index(gpu)]}::{replica}"

    async def scenario() -> list[Any]:
        manager = DevicePluginManager(Root(root), state)
        answers: list[Any] = []
        try:
            await manager.sync()
            assert manager.endpoints[GPU_RESOURCE].feed.resource.replicas == 7
            assert len(manager.endpoints[GPU_RESOURCE].feed.resource.devices) == 8 * 7
            for case in cases:
                offered = case.available if case.available is not None else tuple(
                    f"{gpu}::{n}" for gpu, count in case.replicas for n in range(count))
                try:
                    answers.append(await _preferred(directory, [on_node(case, d) for d in offered],
                                                    [on_node(case, d) for d in case.required], case.size))
                except GRPCError as exc:
                    answers.append(exc)
        finally:
            await manager.stop_all()
        return answers

    for case, answer in zip(cases, asyncio.run(scenario())):
        if case.error:
            assert isinstance(answer, GRPCError) and answer.status is Status.INVALID_ARGUMENT, (case.name, answer)
            assert "not enough available devices to satisfy allocation" in str(answer.message)
            continue
        assert isinstance(answer, list), (case.name, answer)
        check(case, answer, {uuids[n]: gpu for n, (gpu, _) in enumerate(case.replicas)})


# --- Allocate's request check and failRequestsGreaterThanOne ------------------------------------------------

def request_resource(case: requests.RequestCase) -> Resource:
    devices = tuple(PluginDevice(device, device.split("::")[0], device.split("::")[0], 0, None, True)
                    for device in case.devices)
    shared = any("::" in device for device in case.devices)
    strategy = {"none": "none", "timeSlicing": "time-slicing", "mps": "mps"}[case.strategy]
    return Resource(GPU_RESOURCE, devices, 2 if shared else 1, strategy)


@pytest.mark.parametrize("case", requests.REQUEST_CASES, ids=lambda case: case.description)
def test_upstream_request_cases(case: requests.RequestCase) -> None:
    resource = request_resource(case)
    if not case.refused:
        assert allocate(resource, list(case.requested), "envvar", bool(case.fail)).envs
        return
    with pytest.raises(AllocationError) as refused:
        allocate(resource, list(case.requested), "envvar", bool(case.fail))
    message = str(refused.value)
    if case.fail:
        assert message == (f'invalid allocation request for "{GPU_RESOURCE}": invalid request: '
                           + requests.MESSAGE.format(count=len(case.requested)))
    else:
        assert message.startswith("unknown device 'device2' for nvidia.com/gpu")


@pytest.mark.parametrize("case", requests.LOAD_CASES, ids=lambda case: case.test)
def test_upstream_fail_requests_greater_than_one_as_loaded(case: requests.LoadCase) -> None:
    settings = validated(PluginConfig, {"sharing": case.sharing})
    assert settings.sharing.fail_requests_greater_than_one is case.loaded


def test_under_mps_the_loaded_setting_decides_a_request_for_two_replicas() -> None:
    """The two tables together, as a node runs them: an MPS config that leaves the setting unset refuses
    two replicas; one that sets it false gives them."""
    resource = request_resource(requests.REQUEST_CASES[-1])
    for case in requests.LOAD_CASES:
        fail = validated(PluginConfig, {"sharing": case.sharing}).sharing.fail_requests_greater_than_one
        if case.loaded:
            with pytest.raises(AllocationError, match="maximum request size for shared resources is 1; found 2"):
                allocate(resource, list(requests.TWO), "envvar", fail)
        else:
            assert allocate(resource, list(requests.TWO), "envvar", fail).envs["NVIDIA_VISIBLE_DEVICES"] == \
                "device0,device1"


# --- MIG profiles with suffixes -----------------------------------------------------------------------------

def mig_gpu(index: int, profile: str) -> Gpu:
    instance = GpuInstance(1, 0, profile, 1, (0, 1), 24064,
                           (ComputeInstance(0, 0, profile, 1, (0, 1), 46, f"MIG-{index:08d}-0000-0000-0000-0000", 0),))
    return Gpu(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", f"00000000:{0x18 + index:02X}:00.0",
               "a MIG GPU", 97887, (12, 0), index, MigState(True, True, True, (instance,)))


@pytest.mark.parametrize("description, resource_profile, device_profile, matches", resources.PROFILE_CASES,
                         ids=[case[0] for case in resources.PROFILE_CASES])
def test_upstream_mig_profile_cases(description: str, resource_profile: str, device_profile: str,
                                    matches: bool) -> None:
    """A GPU with a MIG device of the resource's profile beside one with a device of the other profile,
    under mig.strategy mixed: the two share a resource exactly when upstream matches them."""
    node = Inventory("580.95.05", "13.0", (mig_gpu(0, resource_profile), mig_gpu(1, device_profile)))
    result = advertised(node, {}, "mixed", PluginConfig())
    holding = {name for name, resource in result.resources.items()
               if any(device.gpu_index == 1 for device in resource.devices)}
    assert len(holding) == 1
    assert (f"nvidia.com/mig-{resource_profile.replace('+', '.')}" in holding) is matches
    assert len(result.resources) == (1 if matches else 2)


# --- the XID health-check lists -----------------------------------------------------------------------------

def health_settings(disabled: str, enabled: str) -> HealthConfig:
    """DP_DISABLE_HEALTHCHECKS and DP_ENABLE_HEALTHCHECKS as docs/health.md maps them: `all` (or `xids`) to
    ignored_xids: all, other XIDs added to the default ignored_xids; the enable list to extra_critical_xids."""
    default = HealthConfig().ignored_xids
    assert isinstance(default, list)

    def xids(value: str) -> Optional[list[int]]:
        words = [word.strip() for word in value.lower().split(",") if word.strip()]
        return None if {"all", "xids"} & set(words) else [int(word) for word in words]

    ignored, extra = xids(disabled), xids(enabled)
    return validated(HealthConfig, {"ignored_xids": "all" if ignored is None else default + ignored,
                                    "extra_critical_xids": "all" if extra is None else extra})


@pytest.mark.parametrize("case", health_facts.XID_CASES, ids=lambda case: case.description)
def test_upstream_xid_cases(case: health_facts.XidCase) -> None:
    settings = health_settings(case.disabled, case.enabled)
    assert {xid: not is_critical(xid, settings) for xid in case.ignored} == case.ignored
    every_xid = range(1, 200)
    assert (not any(is_critical(xid, settings) for xid in every_xid)) is case.all_disabled


def test_xids_enabled_while_all_are_disabled_still_count() -> None:
    """DP_DISABLE_HEALTHCHECKS=all with DP_ENABLE_HEALTHCHECKS=48: upstream's comment says XID 48 still
    counts, but its checker stops before looking (IsAllDisabled); the agent does what the comment says."""
    settings = health_settings("all", "48")
    assert is_critical(48, settings) and not is_critical(79, settings) and not is_critical(13, settings)
