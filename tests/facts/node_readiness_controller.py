"""What the Node Readiness Controller accepts and does, as our own data, for checking the example rule in
docs/examples/gpu-readiness-rule.yaml (github.com/kubernetes-sigs/node-readiness-controller, tag v0.5.0,
commit 704b65442f11cce0a4f629a48bb2305087906d44; nothing below changed up to e5ff8d10, which adds only
spec.conditionPolicy).

- CRD: config/crd/bases/readiness.node.x-k8s.io_nodereadinessrules.yaml (generated from
  api/v1alpha1/nodereadinessrule_types.go: its kubebuilder markers and CEL rules);
- admission: internal/webhook/nodereadinessgaterule_webhook.go, validateSpec;
- evaluation: internal/controller/nodereadinessrule_controller.go, evaluateRuleForNode (a condition found by
  type gives its status, a missing one the rule's defaultStatus, Unknown when unset; every condition must
  match its requiredStatus), and node_controller.go hasTaintBySpec (a taint is the rule's by key and effect).
"""
from __future__ import annotations

import re

COMMIT = "704b65442f11cce0a4f629a48bb2305087906d44"
API_VERSION = "readiness.node.x-k8s.io/v1alpha1"
KIND = "NodeReadinessRule"
SCOPE = "Cluster"  # metadata.namespace has no place

SPEC_FIELDS = {"conditions", "dryRun", "enforcementMode", "nodeSelector", "taint"}
SPEC_REQUIRED = {"conditions", "enforcementMode", "nodeSelector", "taint"}
STATUSES = ("True", "False", "Unknown")  # requiredStatus and defaultStatus
CONDITION_FIELDS = {"type", "requiredStatus", "defaultStatus"}
CONDITION_REQUIRED = {"type", "requiredStatus"}
CONDITIONS_ITEMS = (1, 32)  # minItems, maxItems; a list map keyed by type
CONDITION_TYPE_LENGTH = (1, 316)
ENFORCEMENT_MODES = ("bootstrap-only", "continuous")
TAINT_REQUIRED = {"key", "effect"}
TAINT_KEY_PREFIX = "readiness.k8s.io/"
TAINT_KEY_MAX = 253
TAINT_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")  # the part after the one '/'
TAINT_NAME_MAX = 63
TAINT_VALUE_MAX = 63
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
DEFAULT_STATUS = "Unknown"  # ConditionRequirement.GetDefaultStatus for an unset defaultStatus


def problems(rule: dict) -> list[str]:
    """Why the CRD's schema or the admission webhook would refuse `rule`; empty when neither would."""
    found = []
    if rule.get("apiVersion") != API_VERSION or rule.get("kind") != KIND:
        found.append("apiVersion/kind")
    if "namespace" in (rule.get("metadata") or {}):
        found.append(f"metadata.namespace: the resource is {SCOPE}-scoped")
    spec = rule.get("spec") or {}
    found += [f"spec.{key}: unknown" for key in sorted(set(spec) - SPEC_FIELDS)]
    found += [f"spec.{key}: required" for key in sorted(SPEC_REQUIRED - set(spec))]
    conditions = spec.get("conditions") or []
    if not CONDITIONS_ITEMS[0] <= len(conditions) <= CONDITIONS_ITEMS[1]:
        found.append("spec.conditions: 1 to 32")
    if len({c.get("type") for c in conditions}) != len(conditions):
        found.append("spec.conditions: a type twice")
    for index, condition in enumerate(conditions):
        where = f"spec.conditions[{index}]"
        found += [f"{where}.{key}: unknown" for key in sorted(set(condition) - CONDITION_FIELDS)]
        found += [f"{where}.{key}: required" for key in sorted(CONDITION_REQUIRED - set(condition))]
        if not CONDITION_TYPE_LENGTH[0] <= len(str(condition.get("type", ""))) <= CONDITION_TYPE_LENGTH[1]:
            found.append(f"{where}.type: length")
        for key in ("requiredStatus", "defaultStatus"):
            if key in condition and condition[key] not in STATUSES:
                found.append(f"{where}.{key}: not one of {STATUSES}")
        if "defaultStatus" in condition and spec.get("enforcementMode") == "bootstrap-only":
            found.append(f"{where}.defaultStatus: forbidden with bootstrap-only (webhook)")
    if spec.get("enforcementMode") not in ENFORCEMENT_MODES:
        found.append("spec.enforcementMode: not one of " + ", ".join(ENFORCEMENT_MODES))
    taint = spec.get("taint") or {}
    found += [f"spec.taint.{key}: required" for key in sorted(TAINT_REQUIRED - set(taint))]
    key = str(taint.get("key", ""))
    parts = key.split("/")
    if not key.startswith(TAINT_KEY_PREFIX) or len(key) > TAINT_KEY_MAX or len(parts) != 2:
        found.append(f"spec.taint.key: {TAINT_KEY_PREFIX}<name>, at most {TAINT_KEY_MAX} characters")
    elif not (0 < len(parts[1]) <= TAINT_NAME_MAX and TAINT_NAME.match(parts[1])):
        found.append("spec.taint.key: its name part")
    if len(str(taint.get("value", ""))) > TAINT_VALUE_MAX:
        found.append("spec.taint.value: at most 63 characters")
    if taint.get("effect") not in TAINT_EFFECTS:
        found.append("spec.taint.effect")
    selector = spec.get("nodeSelector") or {}
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        found.append("spec.nodeSelector: must not be empty (webhook)")
    return found


def removes_taint(rule: dict, node: dict) -> bool:
    """Whether the controller, evaluating `rule` on `node`, finds every condition as required (and so
    removes the rule's taint, or does not add it)."""
    conditions = {c.get("type"): c.get("status") for c in (node.get("status") or {}).get("conditions") or []}
    return all(conditions.get(c["type"], c.get("defaultStatus", DEFAULT_STATUS)) == c["requiredStatus"]
               for c in rule["spec"]["conditions"])


def has_taint(rule: dict, node: dict) -> bool:
    """Whether `node` carries the rule's taint: the same key and effect, whatever the value."""
    wanted = rule["spec"]["taint"]
    return any(t.get("key") == wanted["key"] and t.get("effect") == wanted["effect"]
               for t in (node.get("spec") or {}).get("taints") or [])
