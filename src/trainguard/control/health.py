"""Each node's health, as the control plane owns it: HyperPod's two status values, and
the faults that change them.

- ``deep`` (HyperPod's ``deep-health-check-status``): the node's on-start checks,
  ``InProgress`` while its agent runs them (the node takes no ranks yet), then ``Passed``
  or ``Failed``; None when the job asked for none;
- ``status`` (``node-health-status``): ``Schedulable`` until something says otherwise:
  a failed deep check makes the node ``Unschedulable``; a monitor's finding makes it
  ``UnschedulablePendingReplacement`` or ``UnschedulablePendingReboot`` (by the action the
  finding asks for); so does a replacement asked for by hand.

A node that is not ``Schedulable`` never takes ranks again in this job: the controller
replaces it by a spare, and fails the job (naming the node and why) when none is left.

:meth:`HealthBook.observe` reads the agents' health reports (``NodeStatus.health``) and
returns the new faults and the events to record: each check's result and each finding
once (per agent incarnation and finding number), and each change of a node's status.
Pure, like the rest of the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.control.events import EventKind, Fault, FaultType, Note
from trainguard.control.reports import NodeReport

__all__ = ["DeepHealth", "HealthBook", "HealthStatus", "NodeHealth"]


class HealthStatus(StrEnum):
    SCHEDULABLE = "Schedulable"
    UNSCHEDULABLE = "Unschedulable"
    PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
    PENDING_REBOOT = "UnschedulablePendingReboot"


class DeepHealth(StrEnum):
    IN_PROGRESS = "InProgress"
    PASSED = "Passed"
    FAILED = "Failed"


_BY_ACTION = {"replace": HealthStatus.PENDING_REPLACEMENT, "reboot": HealthStatus.PENDING_REBOOT}


@dataclass
class NodeHealth:
    status: HealthStatus = HealthStatus.SCHEDULABLE
    deep: DeepHealth | None = None
    reason: str = ""  # why it is not Schedulable (the check or finding)

    def to_json(self) -> dict[str, Any]:
        deep = self.deep.value if self.deep is not None else None
        return {"status": self.status.value, "deep": deep, "reason": self.reason}


@dataclass
class _Seen:
    incarnation: str
    checks: set[str] = field(default_factory=set)
    finding_seq: int = -1


class HealthBook:
    """Every node's health; see the module docstring."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeHealth] = {}
        self._seen: dict[str, _Seen] = {}
        self._pending: list[Fault] = []  # replacements asked for by hand, not yet raised

    def of(self, node_id: str) -> NodeHealth:
        return self.nodes.setdefault(node_id, NodeHealth())

    def unusable(self, node_id: str) -> str | None:
        """Why ``node_id`` may not take ranks again (None: it may)."""
        health = self.nodes.get(node_id)
        if health is None or health.status is HealthStatus.SCHEDULABLE:
            return None
        return f"{node_id} is {health.status.value}: {health.reason}"

    def relaunch(self, node_id: str) -> Note | None:
        """``node_id`` restarts fresh on another machine: Schedulable again (the event to
        record), or None when it was."""
        health = self.nodes.pop(node_id, None)
        if health is None or health.status is HealthStatus.SCHEDULABLE:
            return None
        self._seen.pop(node_id, None)
        return Note(
            EventKind.NODE_HEALTH,
            f"{node_id} restarts fresh on another machine (was {health.status.value})",
            node=node_id,
            data=NodeHealth().to_json(),
        )

    @staticmethod
    def checking(report: NodeReport | None) -> bool:
        """The node's agent is still running its on-start checks (it takes no ranks yet)."""
        status = report.status if report is not None else None
        return status is not None and status.health.deep == DeepHealth.IN_PROGRESS.value

    def replace(self, now: float, attempt: int, node_id: str, reason: str) -> list[Note]:
        """Someone asked for ``node_id`` to be replaced: it becomes PendingReplacement, and
        a fault is raised at the next :meth:`observe`."""
        if self.unusable(node_id) is not None:
            return []
        fault = Fault(
            FaultType.NODE_UNHEALTHY,
            now,
            attempt,
            node_id,
            message=f"{node_id} is to be replaced: {reason}",
            evidence={"action": "replace", "source": "request"},
        )
        self._pending.append(fault)
        return [self._set(node_id, HealthStatus.PENDING_REPLACEMENT, reason)]

    def observe(
        self, now: float, attempt: int, reports: Mapping[str, NodeReport]
    ) -> tuple[list[Fault], list[Note]]:
        """The new faults, and the events to record, in the agents' reports."""
        faults, self._pending = self._pending, []
        notes: list[Note] = []
        for node_id, report in reports.items():
            status = report.status
            if status is None:
                continue
            seen = self._seen.get(node_id)
            if seen is None or seen.incarnation != status.incarnation:
                seen = self._seen[node_id] = _Seen(status.incarnation)
            health = status.health
            node = self.of(node_id)
            if health.deep is not None and node.deep != health.deep:
                node.deep = DeepHealth(health.deep)
                notes.append(
                    Note(
                        EventKind.NODE_HEALTH,
                        f"{node_id}: deep health checks {node.deep.value}",
                        node=node_id,
                        data=node.to_json(),
                    )
                )
            for check in health.checks:
                if check.name in seen.checks:
                    continue
                seen.checks.add(check.name)
                notes.append(self._check_note(node_id, check.to_json()))
                if check.outcome == "failed":
                    why = f"its {check.name} check failed: {check.message}"
                    faults.append(
                        Fault(
                            FaultType.HEALTH_CHECK_FAILED,
                            now,
                            attempt,
                            node_id,
                            message=f"{node_id} failed its {check.name} health check: "
                            f"{check.message}",
                            evidence={"check": check.name, **check.evidence},
                        )
                    )
                    notes.append(self._set(node_id, HealthStatus.UNSCHEDULABLE, why))
            for finding in health.findings:
                if finding.seq <= seen.finding_seq:
                    continue
                seen.finding_seq = finding.seq
                data = finding.to_json()
                notes.append(
                    Note(
                        EventKind.HEALTH_FINDING,
                        f"{node_id}: {finding.kind}: {finding.message}",
                        node=node_id,
                        data=data,
                    )
                )
                faults.append(
                    Fault(
                        FaultType.NODE_UNHEALTHY,
                        now,
                        attempt,
                        node_id,
                        message=f"{node_id} unhealthy: {finding.kind}: {finding.message}",
                        evidence={
                            "kind": finding.kind,
                            "action": finding.action,
                            **finding.evidence,
                        },
                    )
                )
                if self.unusable(node_id) is None:
                    why = f"{finding.kind}: {finding.message}"
                    notes.append(self._set(node_id, _BY_ACTION[finding.action], why))
        return faults, notes

    def _check_note(self, node_id: str, check: dict[str, Any]) -> Note:
        return Note(
            EventKind.HEALTH_CHECK,
            f"{node_id}: health check {check['name']} {check['outcome']} "
            f"in {check['seconds']:.2f} s: {check['message']}",
            node=node_id,
            data=check,
        )

    def _set(self, node_id: str, status: HealthStatus, reason: str) -> Note:
        health = self.of(node_id)
        health.status, health.reason = status, reason
        return Note(
            EventKind.NODE_HEALTH,
            f"{node_id} is now {status.value}: {reason}",
            node=node_id,
            data=health.to_json(),
        )
