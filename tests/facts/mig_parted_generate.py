"""What mig-parted v0.15's `generate-config` tests expect, as our own data (github.com/NVIDIA/mig-parted, tag
v0.15.0, commit e2d5ad1fc72b9d298ea6d04b885cf2d7dbe56941; the files below are the same at bd7160f4, the
commit ../shared/upstream holds). tests/test_mig_generate.py replays each case on gpu_agent.mig.generate.

- pkg/mig/builder/builder_test.go: the GPUs' profile tables (`gpuProfiles`), TestNormalizeProfileName and
  TestBuildMigConfigSpec;
- pkg/mig/builder/balanced_test.go: `expectedBalanced` and TestBuildAllBalancedConfig;
- pkg/mig/discovery/discovery_test.go: TestGetHardcodedA30Profiles.

A profile is (name, GPU instance slices, most instances); attributes are in the name (`+me`, `-me`).
"""
from __future__ import annotations

from typing import Optional, Union

COMMIT = "e2d5ad1fc72b9d298ea6d04b885cf2d7dbe56941"  # v0.15.0
BUILDER = "pkg/mig/builder/builder_test.go"
BALANCED = "pkg/mig/builder/balanced_test.go"
DISCOVERY = "pkg/mig/discovery/discovery_test.go"

# The test's device ids (several it marks as placeholders), as device-filter writes them.
A30 = "0x20B710DE"
A100_40GB = "0x20B010DE"
A100_80GB = "0x20B510DE"
H100_80GB = "0x233110DE"
OTHER = "0x20B210DE"  # "hypothetical second GPU"

Profile = tuple[str, int, int]

# builder_test.go gpuProfiles: GPU -> (device id, its profiles).
GPU_PROFILES: dict[str, tuple[str, tuple[Profile, ...]]] = {
    "A30-24GB": (A30, (("1g.6gb", 1, 4), ("1g.6gb+me", 1, 1), ("2g.12gb", 2, 2), ("2g.12gb+me", 2, 1),
                       ("4g.24gb", 4, 1))),
    "A100-40GB": (A100_40GB, (("1g.5gb", 1, 7), ("1g.5gb+me", 1, 1), ("1g.10gb", 1, 4), ("2g.10gb", 2, 3),
                              ("3g.20gb", 3, 2), ("4g.20gb", 4, 1), ("7g.40gb", 7, 1))),
    "A100-80GB": (A100_80GB, (("1g.10gb", 1, 7), ("1g.10gb+me", 1, 1), ("1g.20gb", 1, 4), ("2g.20gb", 2, 3),
                              ("3g.40gb", 3, 2), ("4g.40gb", 4, 1), ("7g.80gb", 7, 1))),
    "H100-80GB": (H100_80GB, (("1g.10gb", 1, 7), ("1g.10gb+me", 1, 1), ("1g.20gb", 1, 4), ("2g.20gb", 2, 3),
                              ("3g.40gb", 3, 2), ("4g.40gb", 4, 1), ("7g.80gb", 7, 1))),
    "H100-94GB": ("0x233210DE", (("1g.12gb", 1, 7), ("1g.12gb+me", 1, 1), ("1g.24gb", 1, 4), ("2g.24gb", 2, 3),
                                 ("3g.47gb", 3, 2), ("4g.47gb", 4, 1), ("7g.94gb", 7, 1))),
    "H100-96GB": ("0x233510DE", (("1g.12gb", 1, 7), ("1g.12gb+me", 1, 1), ("1g.24gb", 1, 4), ("2g.24gb", 2, 3),
                                 ("3g.48gb", 3, 2), ("4g.48gb", 4, 1), ("7g.96gb", 7, 1))),
    "H200-141GB": ("0x233310DE", (("1g.18gb", 1, 7), ("1g.18gb+me", 1, 1), ("1g.35gb", 1, 4), ("2g.35gb", 2, 3),
                                  ("3g.71gb", 3, 2), ("4g.71gb", 4, 1), ("7g.141gb", 7, 1))),
    "B200-180GB": ("0x233410DE", (("1g.23gb", 1, 7), ("1g.23gb+me", 1, 1), ("1g.45gb", 1, 4), ("2g.45gb", 2, 3),
                                  ("3g.90gb", 3, 2), ("4g.90gb", 4, 1), ("7g.180gb", 7, 1))),
    "RTX-PRO-5000": ("0x2BB410DE", (("1g.12gb", 1, 1), ("1g.12gb+me", 1, 1), ("1g.12gb+gfx", 1, 1),
                                    ("1g.12gb-me", 1, 3), ("2g.24gb-me", 2, 1), ("4g.48gb", 4, 1),
                                    ("4g.48gb+gfx", 4, 1))),
    "RTX-PRO-6000": ("0x2BB510DE", (("1g.24gb", 1, 4), ("1g.24gb+me", 1, 1), ("1g.24gb+gfx", 1, 4),
                                    ("1g.24gb+me.all", 1, 1), ("1g.24gb-me", 1, 4), ("2g.48gb", 2, 2),
                                    ("2g.48gb+gfx", 2, 2), ("2g.48gb+me.all", 2, 1), ("2g.48gb-me", 2, 2),
                                    ("4g.96gb", 4, 1), ("4g.96gb+gfx", 4, 1))),
}

# builder_test.go TestNormalizeProfileName: a profile and the config name's part after `all-`.
NORMALIZED = [("1g.10gb", "1g.10gb"), ("1g.10gb+me", "1g.10gb.me"), ("4g.96gb+gfx", "4g.96gb.gfx"),
              ("1g.24gb+me.all", "1g.24gb.me.all"), ("1g.24gb-me", "1g.24gb-me")]

# A wanted entry: (config, profile, count, device-filter or None: no filter).
Want = tuple[str, str, int, Optional[tuple[str, ...]]]
Gpus = list[Union[str, tuple[str, tuple[Profile, ...]]]]  # GPU_PROFILES names, or (device id, profiles)
_A100_80GB_CONFIGS = [("all-1g.10gb", "1g.10gb", 7), ("all-1g.10gb.me", "1g.10gb+me", 1), ("all-1g.20gb", "1g.20gb", 4),
                      ("all-2g.20gb", "2g.20gb", 3), ("all-3g.40gb", "3g.40gb", 2), ("all-4g.40gb", "4g.40gb", 1),
                      ("all-7g.80gb", "7g.80gb", 1)]
_A30_CONFIGS = [("all-1g.6gb", "1g.6gb", 4), ("all-1g.6gb.me", "1g.6gb+me", 1), ("all-2g.12gb", "2g.12gb", 2),
                ("all-2g.12gb.me", "2g.12gb+me", 1), ("all-4g.24gb", "4g.24gb", 1)]
_A100_80GB_BALANCED = [("all-balanced", "1g.10gb", 2), ("all-balanced", "2g.20gb", 1), ("all-balanced", "3g.40gb", 1)]
_A30_BALANCED = [("all-balanced", "1g.6gb", 2), ("all-balanced", "2g.12gb", 1)]


def _with(rows: list[tuple[str, str, int]], device_filter: Optional[tuple[str, ...]]) -> list[Want]:
    return [(config, profile, count, device_filter) for config, profile, count in rows]


# builder_test.go TestBuildMigConfigSpec: (case, GPUs by index as GPU_PROFILES names or own profiles, wanted).
# "same profile different max counts" gives its GPUs their own one-profile tables.
BUILD_CASES: list[tuple[str, Gpus, list[Want]]] = [
    ("A100-80GB", ["A100-80GB"], _with(_A100_80GB_BALANCED + _A100_80GB_CONFIGS, None)),
    ("A30-24GB (4-slot)", ["A30-24GB"], _with(_A30_BALANCED + _A30_CONFIGS, None)),
    ("heterogeneous A100 + H100 (same profiles, grouped)", ["A100-80GB", "H100-80GB"],
     _with(_A100_80GB_BALANCED, (A100_80GB,)) + _with(_A100_80GB_BALANCED, (H100_80GB,))
     + _with(_A100_80GB_CONFIGS, (A100_80GB, H100_80GB))),
    ("heterogeneous A100 + A30 (different profiles, separate entries)", ["A100-80GB", "A30-24GB"],
     _with(_A100_80GB_BALANCED, (A100_80GB,)) + _with(_A30_BALANCED, (A30,))
     + _with(_A100_80GB_CONFIGS, (A100_80GB,)) + _with(_A30_CONFIGS, (A30,))),
    ("RTX PRO 6000 (4-slot with new attributes)", ["RTX-PRO-6000"], _with([
        ("all-balanced", "1g.24gb", 2), ("all-balanced", "2g.48gb", 1),
        ("all-1g.24gb", "1g.24gb", 4), ("all-1g.24gb.me", "1g.24gb+me", 1), ("all-1g.24gb.gfx", "1g.24gb+gfx", 4),
        ("all-1g.24gb.me.all", "1g.24gb+me.all", 1), ("all-1g.24gb-me", "1g.24gb-me", 4),
        ("all-2g.48gb", "2g.48gb", 2), ("all-2g.48gb.gfx", "2g.48gb+gfx", 2),
        ("all-2g.48gb.me.all", "2g.48gb+me.all", 1), ("all-2g.48gb-me", "2g.48gb-me", 2),
        ("all-4g.96gb", "4g.96gb", 1), ("all-4g.96gb.gfx", "4g.96gb+gfx", 1)], None)),
    ("same profile different max counts creates multiple entries",
     [(A100_80GB, (("1g.10gb", 1, 7),)), (OTHER, (("1g.10gb", 1, 4),))],
     [("all-1g.10gb", "1g.10gb", 7, (A100_80GB,)), ("all-1g.10gb", "1g.10gb", 4, (OTHER,))]),
]

# balanced_test.go expectedBalanced: each GPU's all-balanced MIG devices (RTX-PRO-5000 has none: no 2g
# profile without attributes).
EXPECTED_BALANCED: dict[str, Optional[dict[str, int]]] = {
    "A30-24GB": {"1g.6gb": 2, "2g.12gb": 1},
    "A100-40GB": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
    "A100-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H100-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H100-94GB": {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1},
    "H100-96GB": {"1g.12gb": 2, "2g.24gb": 1, "3g.48gb": 1},
    "H200-141GB": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
    "B200-180GB": {"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1},
    "RTX-PRO-6000": {"1g.24gb": 2, "2g.48gb": 1},
    "RTX-PRO-5000": None,
}

# balanced_test.go TestBuildAllBalancedConfig: (case, GPUs, the all-balanced entries as (device filter or
# None, MIG devices)); an empty list: no all-balanced config at all.
BALANCED_CASES: list[tuple[str, Gpus, list[tuple[Optional[str], dict[str, int]]]]] = [
    ("7-slot GPU", ["A100-80GB"], [(None, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})]),
    ("4-slot GPU", ["A30-24GB"], [(None, {"1g.6gb": 2, "2g.12gb": 1})]),
    ("heterogeneous GPUs", ["A100-80GB", "A30-24GB"],
     [(A100_80GB, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}), (A30, {"1g.6gb": 2, "2g.12gb": 1})]),
    ("only attributed profiles - no balanced config",
     [(A100_80GB, (("1g.10gb+me", 1, 1), ("2g.20gb+me", 2, 1)))], []),
    ("missing 2g profile - no balanced config", [(A100_80GB, (("1g.10gb", 1, 7), ("3g.40gb", 3, 2)))], []),
    ("2-slot GPU - no balanced config", [("0x2BB610DE", (("1g.16gb", 1, 2), ("2g.32gb", 2, 1)))], []),
]

# discovery_test.go TestGetHardcodedA30Profiles (the table is discovery.go's getHardcodedA30Profiles): an
# A30's profiles whatever NVML says, and most instances of each.
A30_HARDCODED = {"1g.6gb": 4, "1g.6gb+me": 1, "2g.12gb": 2, "2g.12gb+me": 1, "4g.24gb": 1}
