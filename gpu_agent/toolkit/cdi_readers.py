"""Which CDI readers on the node accept a spec of cdiVersion 0.7.0, the first with `additionalGids`.

A CDI reader (a runtime applying CDI devices, or Podman) parses specs with the CDI Go library it vendors,
and that library refuses a spec whose cdiVersion it does not know (pkg/cdi/version.go: validSpecVersions,
isValidVersion; container-device-interface v0.6.2 knows 0.3.0 to 0.6.0). 0.7.0 came with library v0.7.0
(tag v0.7.0, commit 780f60f5): a spec with additionalGids needs it (requiresV070), and one reader with an
older library rejects the whole file, every device in it.

The first release of each reader whose go.mod (Docker: vendor.mod) requires the library at v0.7.0 or later,
read at the release tags:

| reader | first release reading 0.7.0 | its library | the release before |
|---|---|---|---|
| containerd | v1.7.16 (83031836); every 2.x (v2.0.0: v0.8.0) | v0.7.2 | v1.7.15 (926c9586): v0.6.2 |
| CRI-O | v1.30.0 (d5194479) | v0.7.2 | v1.29.x (v1.29.0, d59bbdc2): v0.6.2 |
| Podman | v5.1.0 (4e9486db) | v0.7.2 | v5.0.3 (v5.0.0, e71ec6f1): v0.6.2 |
| Docker | v26.1.0 (c8af8ebe); v25.0.17 (35c78414) on 25.0 | v0.7.1; v0.8.1 | v26.0.2 (7cef0d9c): v0.6.2 |

Docker's 25.0 line before v25.0.17 (v25.0.16: 6fdf0a66) has v0.6.2. k3s and RKE2 (k3s-io's containerd) and
microk8s follow their containerd's version. nerdctl is not in the table: it is taken as not known to read 0.7.0.
"""
from __future__ import annotations

from typing import Optional

from gpu_agent.numbers import version_numbers
from gpu_agent.toolkit.devicepath import Found

# engine: ((first version on a line, the line's end exclusive), ...): a version reads 0.7.0 when it lies in a range
READS_070: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = {
    "containerd": (((1, 7, 16), (1, 8)), ((2, 0, 0), (1000,))),
    "crio": (((1, 30, 0), (1000,)),),
    "podman": (((5, 1, 0), (1000,)),),
    "docker": (((25, 0, 17), (26,)), ((26, 1, 0), (1000,))),
}


def reads_070(reader: Found) -> Optional[bool]:
    """Whether `reader` accepts a cdiVersion 0.7.0 spec; None when its version is unknown."""
    ranges = READS_070.get(reader.engine)
    if ranges is None:
        return False
    version = version_numbers(reader.version)
    if version is None:
        return None
    return any(first <= version < end for first, end in ranges)


def first_070(reader: Found) -> str:
    """The release from which `reader`'s engine reads 0.7.0, for messages."""
    ranges = READS_070.get(reader.engine)
    if not ranges:
        return "none known"
    return ", ".join(".".join(map(str, first)) for first, _ in ranges)


def refusing_070(readers: tuple[Found, ...]) -> list[str]:
    """Why a 0.7.0 spec would not do here: each reader that refuses it, or is not known to accept it."""
    found = []
    for reader in readers:
        verdict = reads_070(reader)
        if verdict is None:
            found.append(f"{reader.describe()}: version unknown")
        elif not verdict:
            found.append(f"{reader.describe()} (from {first_070(reader)})")
    return found
