"""Which XIDs NVIDIA's device plugin v0.20 treats as critical, given its two environment variables, as our
own data (github.com/NVIDIA/k8s-device-plugin, tag v0.20.0, internal/rm/health_test.go,
TestGetDisabledHealthCheckXids). `DP_DISABLE_HEALTHCHECKS` names XIDs to ignore on top of the built-in
application XIDs (`all` or `xids`: every XID); `DP_ENABLE_HEALTHCHECKS` names XIDs that count whatever
the first says (`all`: every XID, the application ones too).

Each case: the two variables, whether XID checks are off altogether, and, per XID asked about, whether
the plugin ignores it. tests/test_plugin_upstream.py maps the variables to `health.ignored_xids` and
`health.extra_critical_xids` as docs/health.md says and replays the cases on the agent's health policy.
"""
from __future__ import annotations

from dataclasses import dataclass

COMMIT = "1b826acc6af3079d8923bac395c3124b8861a9a6"  # v0.20.0
SOURCE = "internal/rm/health_test.go"
TEST = "TestGetDisabledHealthCheckXids"
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)  # ignored unless enabled (health.go's built-in list)


@dataclass(frozen=True)
class XidCase:
    description: str
    disabled: str  # DP_DISABLE_HEALTHCHECKS
    enabled: str  # DP_ENABLE_HEALTHCHECKS
    all_disabled: bool  # no XID check at all
    ignored: dict[int, bool]  # XID: ignored?
    source: str = SOURCE
    test: str = TEST
    commit: str = COMMIT


def _each(value: bool, *xids: int) -> dict[int, bool]:
    return {xid: value for xid in xids}


XID_CASES = [
    XidCase("empty envvars are default disabled", "", "", False, _each(True, *APPLICATION_XIDS)),
    XidCase("disabled is all", "all", "", True, _each(True, *APPLICATION_XIDS, 555)),
    XidCase("disabled is xids", "xids", "", True, _each(True, *APPLICATION_XIDS, 555)),
    XidCase("enabled is all", "", "all", False, _each(False, *APPLICATION_XIDS, 555)),
    XidCase("enabled overrides disabled", "11", "11", False,
            {11: False, **_each(True, *APPLICATION_XIDS), 555: False}),
]
