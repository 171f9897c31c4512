"""Kubernetes object names the agent puts into API request paths: a Node's name.

Light on purpose (the config loader imports it): a regular expression and nothing else.
"""
from __future__ import annotations

import re
from typing import Optional

MAX_NODE_NAME = 253
# RFC 1123 DNS subdomain, as kube-apiserver validates a Node's metadata.name.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def node_name_problem(name: str) -> Optional[str]:
    """Why `name` cannot be a Node's name, or None when it can. The reason never quotes the name."""
    if not name:
        return "is empty"
    if len(name) > MAX_NODE_NAME:
        return f"is {len(name)} characters long; a Node's name has at most {MAX_NODE_NAME}"
    if _SUBDOMAIN.fullmatch(name):
        return None
    return ("is not a Kubernetes Node name: lower-case letters, digits, '-' and '.' only, each '.'-separated "
            "part starting and ending with a letter or digit (an RFC 1123 DNS subdomain)")


def object_name_problem(name: str) -> Optional[str]:
    """Why `name` cannot be the name of a namespace, ResourceSlice or ResourceClaim (a DNS subdomain; a
    namespace's is stricter, which the server checks), or None when it can. The reason never quotes it."""
    if not name:
        return "is empty"
    if len(name) > MAX_NODE_NAME or not _SUBDOMAIN.fullmatch(name):
        return (f"is not a Kubernetes object name: at most {MAX_NODE_NAME} lower-case letters, digits, '-' and "
                "'.' (an RFC 1123 DNS subdomain)")
    return None
