"""What the Node last said of this node's runtime and kubelet, kept across restarts.

The device-path decision reads the Node's status.nodeInfo (containerRuntimeVersion, kubeletVersion)
before its own guesses from package records. A restarted agent whose first read of the Node fails (the
API server down, a budget spent) would decide from its guesses and then, once the Node answers, flip:
rewriting runtime configs and restarting runtimes twice. So the two versions the Node last gave are
kept in the agent's state directory and stand in until it answers again.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root

log = logging.getLogger(__name__)

PATH = "/var/lib/gpu-agent/node-info.json"  # under --root
KEYS = ("containerRuntimeVersion", "kubeletVersion")
_MOST_CHARS = 100  # a version the Node reports; longer is not one (stages/devicepath.py cuts there too)
_MOST_BYTES = 4096


class KeptNodeInfo:
    def __init__(self, root: Root) -> None:
        self.path = root(PATH)
        self._kept: Optional[dict[str, str]] = None  # as on file, once read or written

    def keep(self, info: dict[str, Any]) -> None:
        """Keep the versions of `info` (the Node's status.nodeInfo); nothing is written when the file has them."""
        wanted = _versions(info)
        if not wanted or wanted == self.read():
            return
        try:
            atomic_write(self.path, json.dumps(wanted, sort_keys=True) + "\n", mode=0o600)
            self._kept = wanted
        except OSError as exc:  # the decision still has the Node's answer in this process
            log.warning("cannot keep the Node's runtime and kubelet versions in %s: %s", PATH, exc.strerror or exc)

    def read(self) -> Optional[dict[str, str]]:
        """The versions last kept; None without a file, or with one that is not what keep() writes."""
        if self._kept is None:
            try:
                data = read_bounded(self.path, _MOST_BYTES, follow=False)
                self._kept = _versions(json.loads(data)) if data is not None else None
            except (OSError, NotRegular, TooLarge, ValueError) as exc:
                log.warning("%s is not what gpu-agent keeps there (%s); ignoring it", PATH, exc)
                self._kept = None
        return dict(self._kept) if self._kept else None


def _versions(info: Any) -> dict[str, str]:
    if not isinstance(info, dict):
        return {}
    return {key: info[key] for key in KEYS
            if isinstance(info.get(key), str) and 0 < len(info[key]) <= _MOST_CHARS}
