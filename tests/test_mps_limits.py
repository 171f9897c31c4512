"""A control daemon's limits as asked for (a DRA claim's mpsConfig: its default active thread percentage and
each GPU's pinned memory limit) beside those derived from replicas (plugin.sharing.mps): what is set, what
the record keeps across restarts of the agent, and when a running daemon is one started as asked."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpu_agent.config.loader import load_config
from gpu_agent.host.paths import Root
from gpu_agent.mps import instance
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.daemons import describe, wanted_daemons, without
from gpu_agent.mps.lifecycle import Want
from gpu_agent.state import AgentState, ClaimMps

GPUS = ("GPU-a", "GPU-b")
SHARED = DaemonSpec("nvidia.com/gpu", GPUS, (0, 1), (81559, 81559), 4)
CLAIMED = DaemonSpec("k8s.gpu.nvidia.com/claim-uid-1", GPUS, (0, 1), (81559, 81559), 1, threads=30,
                     pinned_mib=(20480, 0))


def test_limits_asked_for_are_set_as_asked_and_replicas_derive_theirs() -> None:
    assert (SHARED.thread_percentage, SHARED.pinned_limits()) == (25, [(0, "20389M"), (1, "20389M")])
    assert (CLAIMED.thread_percentage, CLAIMED.pinned_limits()) == (30, [(0, "20480M")])  # 0: no limit there
    assert replace(CLAIMED, threads=0).thread_percentage == 0
    assert describe(SHARED) == "GPUs 0,1 with 4 replicas"
    assert describe(CLAIMED) == "GPUs 0,1 with 30 % of their threads and pinned memory 20480M"


def test_the_record_keeps_the_limits_and_reads_an_older_record_as_before() -> None:
    for spec in (SHARED, CLAIMED, replace(CLAIMED, pinned_mib=None), replace(CLAIMED, threads=None)):
        assert instance.parse(spec.resource, instance.render(spec)) == spec
    assert instance.THREADS not in instance.render(SHARED) and instance.PINNED not in instance.render(SHARED)
    text = instance.render(CLAIMED)
    for broken in (text.replace("=30", "=101"), text.replace("=30", "=x"), text.replace("20480,0", "20480"),
                   text.replace("20480,0", "20480,-1")):
        assert instance.parse(CLAIMED.resource, broken) is None, broken


def test_a_daemon_runs_as_asked_only_with_the_limits_asked_for() -> None:
    assert CLAIMED.runs_as(replace(CLAIMED, indices=(3, 4)))
    assert not CLAIMED.runs_as(replace(CLAIMED, threads=40))
    assert not CLAIMED.runs_as(replace(CLAIMED, pinned_mib=(20480, 1024)))
    assert not CLAIMED.runs_as(replace(CLAIMED, threads=None, pinned_mib=None))
    kept = without(CLAIMED, {"GPU-a"})
    assert (kept.gpus, kept.pinned_mib, kept.pinned_limits()) == (("GPU-b",), (0,), [])


def test_a_prepared_claims_mps_daemon_is_wanted_on_its_gpus_with_its_limits(tmp_path: Path) -> None:
    from test_dra import gpu, inventory

    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    state.inventory = inventory(gpu(0), gpu(1), gpu(2))
    b, a = state.inventory.gpus[2].uuid, state.inventory.gpus[0].uuid
    state.publish_claim_mps({"claims/uid-1": ClaimMps((b, a), 30, (2048, 1024))})
    wanted = wanted_daemons(Root(tmp_path), state)
    spec = wanted.specs["claims/uid-1"]
    assert (spec.gpus, spec.indices, spec.thread_percentage, spec.pinned_limits()) == (
        (a, b), (0, 2), 30, [(0, "1024M"), (1, "2048M")])  # in index order, each GPU with its own limit
    assert wanted.want("claims/uid-1") is Want.YES and "claims/uid-1" in wanted.named
    # a GPU of the claim NVML cannot read: undecided, its daemon left as it is
    state.inventory = replace(state.inventory, gpus=(state.inventory.gpus[0], state.inventory.gpus[1],
                                                     replace(state.inventory.gpus[2], unreadable="GPU is lost")))
    assert wanted_daemons(Root(tmp_path), state).want("claims/uid-1") is Want.UNDECIDED
    state.publish_claim_mps({})  # unprepared: no longer wanted
    assert wanted_daemons(Root(tmp_path), state).want("claims/uid-1") is Want.NO
