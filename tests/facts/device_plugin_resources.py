"""Which MIG profile goes to which resource in NVIDIA's device plugin v0.20, as our own data
(github.com/NVIDIA/k8s-device-plugin, tag v0.20.0, api/config/v1/resources_test.go, TestResourcePatternMatches;
the fix is #1807, "anchor MIG resource pattern matching"). Under mig.strategy mixed the plugin makes one
resource per profile, `mig-<profile>`, and a MIG device goes to the resource whose pattern matches its
profile; patterns matched anywhere in the name before v0.20, so `1g.24gb` took the `1g.24gb-me`,
`1g.24gb+me.all` and `1g.24gb+gfx` devices. Now each profile with a suffix is its own resource.

Each case: a resource's profile (upstream's pattern), a device's profile, and whether the device goes to
that resource. The table's wildcard patterns (`*`, `1g.*`, `*gb`) are left out: they come from the
`resources` section of NVIDIA's config file, which the agent does not read (docs/device-plugin.md).
"""
from __future__ import annotations

COMMIT = "1b826acc6af3079d8923bac395c3124b8861a9a6"  # v0.20.0
SOURCE = "api/config/v1/resources_test.go"
TEST = "TestResourcePatternMatches"

# (description, the resource's profile, the device's profile, the device goes to that resource)
PROFILE_CASES: list[tuple[str, str, str, bool]] = [
    ("exact match", "1g.24gb", "1g.24gb", True),
    ("no match on different string", "1g.24gb", "2g.48gb", False),
    ("does not substring match with suffix", "1g.24gb", "1g.24gb-me", False),
    ("does not substring match with plus suffix", "1g.24gb", "1g.24gb+me.all", False),
    ("does not substring match with prefix", "1g.24gb", "x1g.24gb", False),
    ("dash-me suffix matches its own pattern", "1g.24gb-me", "1g.24gb-me", True),
    ("plus-me.all suffix matches its own pattern", "1g.24gb+me.all", "1g.24gb+me.all", True),
    ("gfx suffix matches its own pattern", "1g.24gb+gfx", "1g.24gb+gfx", True),
    ("base pattern does not match +gfx suffix", "1g.24gb", "1g.24gb+gfx", False),
    ("gfx pattern does not match base", "1g.24gb+gfx", "1g.24gb", False),
    ("gfx pattern does not match -me suffix", "1g.24gb+gfx", "1g.24gb-me", False),
    ("2g gfx suffix matches its own pattern", "2g.48gb+gfx", "2g.48gb+gfx", True),
    ("2g base does not match +gfx suffix", "2g.48gb", "2g.48gb+gfx", False),
]
WILDCARD_CASES_LEFT_OUT = 5
