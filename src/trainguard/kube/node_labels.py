"""Node health on Kubernetes Nodes: HyperPod's two labels, the taint, and what a writer
may change. Pure: the operator (:mod:`trainguard.kube.node_health`) and the health agent
(:mod:`trainguard.kube.health_agent`) read a Node, ask :func:`health_patch` what to write,
and write it through :mod:`trainguard.kube.api`.

- ``node-health-status``, by severity: ``Schedulable`` < ``Unschedulable`` (deep checks
  running or failed) < ``UnschedulablePendingReboot`` < ``UnschedulablePendingReplacement``.
  A writer never lowers a Node's status: a Node that awaits a replacement is not made
  Schedulable by a later passing check. The one exception is the health agent clearing
  the ``Unschedulable`` it set while its own checks ran (:attr:`HealthChange.clear`).
  A value nobody knows (typed by hand) counts as ``Unschedulable``;
- ``deep-health-check-status``: ``InProgress`` | ``Passed`` | ``Failed``, as written;
- ``fault-type`` and ``fault-reason`` (HyperPod's keys; the values are trainguard's, see
  :class:`NodeFault`): the fault behind the status, written with it (when the status is
  raised to, or is already, the one asked for) and removed when the status is cleared
  to ``Schedulable``. A status that is not lowered keeps the fault that set it;
- the taint ``trainguard.dev/unhealthy=<status>:NoSchedule`` is on a Node exactly while
  the status trainguard wrote is not ``Schedulable`` (job pods never tolerate it; they
  are kept off by their required node affinity anyway), and the annotation
  ``trainguard.dev/node-health-reason`` says why;
- a job pod on a Node labelled ``UnschedulablePendingReplacement`` or
  ``UnschedulablePendingReboot`` (:data:`MOVE_OFF`) by anyone but the operator acting on
  that very job node is replaced: the job goes on without that Node.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from trainguard.kube.config import HEALTH_REASON_ANNOTATION, UNHEALTHY_TAINT, Obj, OperatorConfig

__all__ = [
    "DEEP_STATUSES",
    "MOVE_OFF",
    "PENDING_REBOOT",
    "PENDING_REPLACEMENT",
    "SCHEDULABLE",
    "STATUSES",
    "UNSCHEDULABLE",
    "HealthChange",
    "HealthKeys",
    "NodeFault",
    "health_patch",
    "label_value",
    "severity",
    "unhealthy_taint",
    "untolerated",
]


SCHEDULABLE: Final = "Schedulable"
UNSCHEDULABLE: Final = "Unschedulable"
PENDING_REBOOT: Final = "UnschedulablePendingReboot"
PENDING_REPLACEMENT: Final = "UnschedulablePendingReplacement"
STATUSES: Final = (SCHEDULABLE, UNSCHEDULABLE, PENDING_REBOOT, PENDING_REPLACEMENT)
"""HyperPod's ``node-health-status`` values, by severity."""
DEEP_STATUSES: Final = ("InProgress", "Passed", "Failed")
MOVE_OFF: Final = (PENDING_REPLACEMENT, PENDING_REBOOT)
"""Statuses of a Node that a job's pod is moved off."""
MAX_REASON: Final = 1024
"""Characters of the reason annotation."""
MAX_LABEL_VALUE: Final = 63
_NOT_IN_LABEL = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_ENDS = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def label_value(text: str) -> str:
    """``text`` as a valid label value: runs of other characters become ``-``, at most 63
    characters, beginning and ending with a letter or digit (``Unknown`` when none is
    left)."""
    value = _LABEL_ENDS.sub("", _NOT_IN_LABEL.sub("-", text))
    value = _LABEL_ENDS.sub("", value[:MAX_LABEL_VALUE])
    return value or "Unknown"


@dataclass(frozen=True)
class HealthKeys:
    """The label keys of the two statuses and of the fault behind them (trainguard's
    prefix, or HyperPod's)."""

    status: str
    deep: str
    fault_type: str | None = None  # None: the fault is not written
    fault_reason: str | None = None

    @classmethod
    def of(cls, settings: OperatorConfig) -> HealthKeys:
        return cls(
            settings.health_label,
            settings.deep_health_label,
            settings.fault_type_label,
            settings.fault_reason_label,
        )


@dataclass(frozen=True)
class NodeFault:
    """The fault a Node's status is for, as its ``fault-type`` and ``fault-reason`` labels
    say it (each made a valid label value by :func:`label_value`): the type is the fault's
    (:class:`~trainguard.control.events.FaultType`: ``HealthCheckFailed``,
    ``NodeUnhealthy``), the reason what caused it in one word (the failed check's name, the
    finding's kind, ``ReplacementRequested``). The sentence is the reason annotation's."""

    type: str
    reason: str


def severity(status: str | None) -> int:
    """0 for no label or ``Schedulable``, up to 3 for ``UnschedulablePendingReplacement``."""
    if status is None:
        return 0
    return STATUSES.index(status) if status in STATUSES else 1


@dataclass(frozen=True)
class HealthChange:
    """What a writer wants a Node to say (None: leave that label as it is).

    ``clear``: ``status`` may replace a plain ``Unschedulable`` although it is lower (the
    health agent's own, set while its checks ran).
    """

    status: str | None = None
    deep: str | None = None
    reason: str | None = None
    clear: bool = False
    fault: NodeFault | None = None


def unhealthy_taint(status: str) -> Obj:
    return {"key": UNHEALTHY_TAINT, "value": status, "effect": "NoSchedule"}


def health_patch(node: Obj, keys: HealthKeys, change: HealthChange) -> Obj | None:
    """The merge patch (:meth:`~trainguard.kube.api.KubeApi.patch_node`) that makes
    ``node`` say ``change`` by the rules of the module docstring; None when it says it
    already. The patch names the Node's ``resourceVersion`` (a Node changed since it was
    read is a conflict, to read again)."""
    meta = node.get("metadata") or {}
    labels: dict[str, str] = dict(meta.get("labels") or {})
    current = labels.get(keys.status)
    status = current
    wanted = change.status
    if wanted is not None and wanted != current:
        lowering = severity(wanted) <= severity(current)
        if not lowering or (change.clear and current == UNSCHEDULABLE):
            status = wanted
    new_labels: dict[str, str | None] = {}
    if status != current and status is not None:
        new_labels[keys.status] = status
    if change.deep is not None and labels.get(keys.deep) != change.deep:
        new_labels[keys.deep] = change.deep
    new_labels.update(_fault_labels(labels, keys, change, status))
    taints = list((node.get("spec") or {}).get("taints") or [])
    others = [t for t in taints if t.get("key") != UNHEALTHY_TAINT]
    ours = [] if status in (None, SCHEDULABLE) else [unhealthy_taint(str(status))]
    new_taints = others + ours
    patch: Obj = {}
    metadata: Obj = {}
    if new_labels:
        metadata["labels"] = new_labels
    changed = bool(new_labels)
    if change.reason is not None and (changed or status == wanted):
        reason = change.reason[:MAX_REASON]
        if (meta.get("annotations") or {}).get(HEALTH_REASON_ANNOTATION) != reason:
            metadata["annotations"] = {HEALTH_REASON_ANNOTATION: reason}
    if _taint_set(new_taints) != _taint_set(taints):
        patch["spec"] = {"taints": new_taints}
    if not metadata and not patch:
        return None
    if meta.get("resourceVersion"):
        metadata["resourceVersion"] = meta["resourceVersion"]
    if metadata:
        patch["metadata"] = metadata
    return patch


def _fault_labels(
    labels: dict[str, str], keys: HealthKeys, change: HealthChange, status: str | None
) -> dict[str, str | None]:
    """The fault labels to write (None: remove) for a Node whose status becomes ``status``."""
    if keys.fault_type is None or keys.fault_reason is None:
        return {}
    wanted: dict[str, str | None] = {}
    if status == SCHEDULABLE:  # cleared: no fault is behind it any more
        wanted = {keys.fault_type: None, keys.fault_reason: None}
    elif change.fault is not None and status == change.status:
        wanted = {
            keys.fault_type: label_value(change.fault.type),
            keys.fault_reason: label_value(change.fault.reason),
        }
    return {key: value for key, value in wanted.items() if labels.get(key) != value}


def _taint_set(taints: Sequence[Obj]) -> set[tuple[str, str, str]]:
    return {(str(t.get("key")), str(t.get("value")), str(t.get("effect"))) for t in taints}


def untolerated(tolerations: Sequence[Obj]) -> list[Obj]:
    """A pod's tolerations less any of trainguard's unhealthy taint (a job pod must never
    land on a Node trainguard found unhealthy)."""
    return [t for t in tolerations if t.get("key") != UNHEALTHY_TAINT]
