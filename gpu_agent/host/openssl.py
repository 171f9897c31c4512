"""OpenSSL out of the daemon until it needs TLS. libcrypto and libssl hold about 4.5 MiB of an idle
agent's resident set, and only the Kubernetes API client's HTTPS uses them; yet two standard modules load
them at import whatever they are used for: hashlib (through _hashlib; pydantic imports it through secrets
and hmac) and asyncio (ssl, for TLS transports the agent never makes: the kube client's sockets are its
own). Imported here first with both hidden, hashlib takes CPython's own digests (the same digests) and
asyncio has no TLS; a later `import ssl` loads OpenSSL as ever.

Not on a FIPS host (/proc/sys/crypto/fips_enabled under --root says 1): there hashlib must be OpenSSL's,
whose FIPS provider refuses what FIPS does not approve, and CPython's own digests would quietly take
its place; docs/systemd.md says what the trick turns off."""
from __future__ import annotations

import importlib.util
import sys
from typing import Union

from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.host.paths import Root

FIPS_ENABLED = "/proc/sys/crypto/fips_enabled"

# hashlib without _hashlib builds every guaranteed algorithm from these at import; a build that lacks one
# (a FIPS build may) keeps OpenSSL's rather than log an error for each.
_BUILTIN_DIGESTS = (("_md5",), ("_sha1",), ("_sha2", "_sha256"), ("_sha2", "_sha512"), ("_blake2",), ("_sha3",))


def _builtin_digests() -> bool:
    return all(any(importlib.util.find_spec(name) is not None for name in names) for names in _BUILTIN_DIGESTS)


def fips_enabled(root: Root) -> bool:
    """Whether the kernel under `root` runs in FIPS mode; an unreadable flag is taken as not."""
    try:
        return (read_head(root(FIPS_ENABLED), 8) or b"").strip() == b"1"
    except (OSError, NotRegular):
        return False


def import_without_openssl(root: Union[Root, str] = "/") -> bool:
    """Import hashlib, hmac and asyncio without OpenSSL where none of them is imported yet, unless the
    host is in FIPS mode (then nothing is imported here). Whether it did."""
    if fips_enabled(root if isinstance(root, Root) else Root(root)):
        return False
    hidden = []
    if not {"_hashlib", "hashlib", "hmac"} & sys.modules.keys() and _builtin_digests():
        hidden.append("_hashlib")
    if not {"ssl", "asyncio"} & sys.modules.keys():
        hidden.append("ssl")
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import asyncio  # noqa: F401
        import hashlib  # noqa: F401
        import hmac  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return True
