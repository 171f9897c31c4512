"""What NVIDIA's device plugin v0.20 accepts in Allocate (its request validation) and how it reads
`failRequestsGreaterThanOne`, as our own data, each case naming its file, Go test and commit
(github.com/NVIDIA/k8s-device-plugin, tag v0.20.0). tests/test_plugin_upstream.py replays them.

v0.20 changed the setting under MPS (commit f14d3d12dc5ec80998d0fd5fb4e06120f8a0709f, "honor
failRequestsGreaterThanOne"): MPS used to refuse a request for two replicas whatever the setting said;
now the setting decides under MPS as under time-slicing, and loading the config sets it to true under MPS
where the file leaves it unset. So the request check sees the setting as loaded: `fail` is None (unset,
the check lets the request through), True or False.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMMIT = "1b826acc6af3079d8923bac395c3124b8861a9a6"  # v0.20.0
RM_TEST = "internal/rm/rm_test.go"
CONFIG_TEST = "api/config/v1/config_test.go"
MESSAGE = "maximum request size for shared resources is 1; found {count}"  # after "invalid request: "


@dataclass(frozen=True)
class RequestCase:
    description: str  # TestValidateRequest's case
    strategy: str  # the sharing block: none, timeSlicing or mps
    fail: Optional[bool]  # failRequestsGreaterThanOne as the check sees it
    devices: tuple[str, ...]  # the resource's device ids
    requested: tuple[str, ...]
    refused: bool
    source: str = RM_TEST
    test: str = "TestValidateRequest"
    commit: str = COMMIT


PLAIN = ("device0", "device1")
REPLICAS = ("device0::0", "device0::1", "device1::0", "device1::1")  # two GPUs, 2 replicas each
ONE, TWO = ("device0::1",), ("device0::1", "device1::0")

REQUEST_CASES = [
    RequestCase("valid device IDs -- no sharing", "none", None, PLAIN, ("device1",), False),
    RequestCase("invalid device IDs -- no sharing", "none", None, PLAIN, ("device1", "device2"), True),
    RequestCase("timeslicing with single device", "timeSlicing", None, REPLICAS, ONE, False),
    RequestCase("timeslicing with two devices", "timeSlicing", None, REPLICAS, TWO, False),
    RequestCase("timeslicing with two devices -- failRequestsGreaterThanOne", "timeSlicing", True, REPLICAS, TWO,
                True),
    RequestCase("MPS with single device", "mps", None, REPLICAS, ONE, False),
    RequestCase("MPS with two devices", "mps", None, REPLICAS, TWO, False),
    RequestCase("MPS with two devices -- failRequestsGreaterThanOne", "mps", True, REPLICAS, TWO, True),
]


@dataclass(frozen=True)
class LoadCase:
    test: str  # the Go test in config_test.go
    sharing: dict[str, object]  # the config file's sharing block (one resource, 2 replicas)
    loaded: bool  # failRequestsGreaterThanOne once loaded
    source: str = CONFIG_TEST
    commit: str = COMMIT


_RESOURCE = {"name": "nvidia.com/gpu", "replicas": 2}
LOAD_CASES = [
    LoadCase("TestNewConfigDefaultsMPSFailRequestsGreaterThanOne", {"mps": {"resources": [_RESOURCE]}}, True),
    LoadCase("TestNewConfigHonorsExplicitMPSFailRequestsGreaterThanOneFalse",
             {"mps": {"failRequestsGreaterThanOne": False, "resources": [_RESOURCE]}}, False),
]
