"""The pods bound to this node, as the Kubernetes API has them: their UIDs (metrics.pod_uid, and the
per-process series of metrics.virtual_gpus) and their labels (metrics.pod_kubernetes_labels).

dcgm-exporter keeps an informer on the pods of its node (internal/pkg/transformation/kubernetes.go at
691c927); the agent lists them instead, with the node's own credentials (kubernetes.kubeconfig), and
keeps the answer: it lists again only when a pod holding a GPU is not in what it kept (at most once
every MIN_RELIST_SECONDS), or when what it kept is MAX_AGE_SECONDS old (a pod's labels may change).
So a scrape never causes a request, and a node whose pods do not change costs one request every
MAX_AGE_SECONDS. A failed list keeps the pods last read; the reason is published for /status.

A label is kept when one of metrics.pod_label_allowlist_regex matches its key anywhere (Go's
MatchString; every label when the list is empty), under its key with each character other than
[a-zA-Z0-9_] replaced by `_` (dcgm-exporter's SanitizeLabelName). Differences, each because the result
would not be a valid exposition: a key that would then start with a digit is left out, and of two
keys that become the same name the first in sorted order is kept (dcgm-exporter keeps either).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

MIN_RELIST_SECONDS = 30.0
MAX_AGE_SECONDS = 300.0
MAX_PODS = 1000  # per list: far more than a node runs (the kubelet's default is 110)
MAX_LABELS = 64  # per pod, kept as series labels
MAX_VALUE_CHARS = 63  # a Kubernetes label value has at most 63 characters
_INVALID = re.compile(r"[^a-zA-Z0-9_]")

PodKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class PodMeta:
    uid: str
    labels: tuple[tuple[str, str], ...]  # as the API has them, sorted by key


def sanitized(key: str) -> str:
    return _INVALID.sub("_", key)


def kept_labels(labels: Sequence[tuple[str, str]], allowlist: Sequence[str]) -> dict[str, str]:
    """The series labels a pod's labels give, under metrics.pod_label_allowlist_regex."""
    patterns = [re.compile(pattern) for pattern in allowlist]
    kept: dict[str, str] = {}
    for key, value in sorted(labels):
        if patterns and not any(pattern.search(key) for pattern in patterns):
            continue
        name = sanitized(key)
        if name[:1].isdigit() or name in kept:
            continue
        kept[name] = value
        if len(kept) >= MAX_LABELS:
            break
    return kept


def pods_of(document: dict[str, Any]) -> dict[PodKey, PodMeta]:
    """A PodList's pods by (namespace, name); an item without them is skipped."""
    found: dict[PodKey, PodMeta] = {}
    items = document.get("items")
    for item in items if isinstance(items, list) else ():
        metadata = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(metadata, dict):
            continue
        name, namespace, uid = metadata.get("name"), metadata.get("namespace"), metadata.get("uid")
        if not (isinstance(name, str) and isinstance(namespace, str)):
            continue
        labels = metadata.get("labels")
        pairs = tuple(sorted((k, v[:MAX_VALUE_CHARS]) for k, v in (labels.items() if isinstance(labels, dict) else ())
                             if isinstance(k, str) and isinstance(v, str)))
        found[(namespace, name)] = PodMeta(uid if isinstance(uid, str) else "", pairs)
        if len(found) >= MAX_PODS:
            break
    return found


class PodMetadata:
    """The node's pods from the API, kept and listed again only as the module says. `lister(limit)`
    answers the PodList (a KubeClient's list_pods for the node), or raises."""

    def __init__(self, lister: Callable[[int], dict[str, Any]], clock: Callable[[], float] = time.monotonic) -> None:
        self.lister = lister
        self.clock = clock
        self.pods: dict[PodKey, PodMeta] = {}
        self.listed_at: Optional[float] = None  # of the last list that answered
        self.tried_at: Optional[float] = None
        self.error: Optional[str] = None
        self.lists = 0  # requests sent

    def lookup(self, wanted: Collection[PodKey]) -> dict[PodKey, PodMeta]:
        """What is known of the pods `wanted`, listing again first when the module's rules say so. Blocking:
        run it on a worker thread."""
        if self._due(wanted):
            self._list()
        return {key: self.pods[key] for key in wanted if key in self.pods}

    def _due(self, wanted: Collection[PodKey]) -> bool:
        now = self.clock()
        if self.tried_at is None:
            return True
        since_try = now - self.tried_at
        if self.listed_at is None or any(key not in self.pods for key in wanted):
            return since_try >= MIN_RELIST_SECONDS
        return now - self.listed_at >= MAX_AGE_SECONDS and since_try >= MIN_RELIST_SECONDS

    def _list(self) -> None:
        self.tried_at = self.clock()
        self.lists += 1
        try:
            document = self.lister(MAX_PODS)
        except Exception as exc:  # an ApiError, a kubeconfig that cannot be read: a reason, never a failed scrape
            reason = f"listing this node's pods failed: {exc}"
            if reason != self.error:
                log.warning("pod metadata: %s; pod_uid and pod labels are left out where unknown", reason)
            self.error = reason
            return
        if self.error is not None:
            log.info("pod metadata: this node's pods are listed again")
        self.pods, self.listed_at, self.error = pods_of(document), self.tried_at, None
