"""What a node's silence means: the one place that turns contact evidence into a verdict.

- A node the platform knows to be gone (its agent process exited, its pod was deleted)
  is **lost** at once.
- A node whose agent answered before is **lost** once ``unreachable_after`` contacts in
  a row (status polls or requests, whichever came) got no answer, and (``lost_after``,
  across hosts) it has been silent that many seconds. Less is evidence only: the node
  stays **up**, judged by its last status. One refused connection or one slow reply is
  not worth a full job restart; and a node is not declared lost before its agent's own
  lease has fenced it (:mod:`trainguard.agent.lease`).
- A node whose agent never answered is **pending** (coming up); the controller gives it
  ``node_start_timeout`` from its launch.

Pure: the counts are the platform's facts, the bounds are the config's, as one
:class:`ContactRule` (``ControlConfig.contact_rule``). Every reader takes the whole rule,
so none can leave out a bound: the controller, in-process eligibility and the node state
users see (:func:`shown_state`) give one verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from trainguard.control.reports import NodeReport
from trainguard.wire.status import NodeState

__all__ = [
    "Contact",
    "ContactRule",
    "contact",
    "launch_verdict",
    "lost",
    "lost_reason",
    "settled",
    "shown_state",
]


class Contact(StrEnum):
    PENDING = "pending"  # launched, its agent has not answered yet
    UP = "up"  # its agent answered (its status may be a few failed contacts old)
    LOST = "lost"  # gone, or silent for ``unreachable_after`` contacts in a row


@dataclass(frozen=True)
class ContactRule:
    """When a silent node is lost: ``unreachable_after`` contacts in a row got no answer,
    and (across hosts) it has been silent ``lost_after`` seconds by then (0: the count
    alone decides)."""

    unreachable_after: int
    lost_after: float = 0.0


def contact(report: NodeReport | None, rule: ContactRule) -> Contact:
    """The verdict on one node (a node without a report is pending)."""
    if report is None:
        return Contact.PENDING
    if report.gone is not None:
        return Contact.LOST
    if report.status is None:
        return Contact.PENDING
    if report.failed_contacts >= rule.unreachable_after and report.silent_for >= rule.lost_after:
        return Contact.LOST
    return Contact.UP


def lost(report: NodeReport | None, rule: ContactRule) -> bool:
    return contact(report, rule) is Contact.LOST


def lost_reason(report: NodeReport, rule: ContactRule) -> str:
    """Why a lost node is lost, in words."""
    if report.gone is not None:
        return f"{report.node_id} lost: {report.gone}"
    error = f" (last: {report.error})" if report.error else ""
    silent = f" over {report.silent_for:.1f}s" if report.silent_for else ""
    return (
        f"{report.node_id} lost: its agent did not answer {report.failed_contacts} "
        f"contacts in a row{silent} (limit {rule.unreachable_after}){error}"
    )


def settled(report: NodeReport | None, rule: ContactRule) -> bool:
    """Nothing more to wait for on this node: none of its workers runs, or it is not up
    (a lost or never-up node: the platform reaps what is left of it)."""
    if contact(report, rule) is not Contact.UP:
        return True
    assert report is not None and report.status is not None
    return report.status.quiescent


def shown_state(report: NodeReport | None, rule: ContactRule) -> Contact | NodeState:
    """A node's state as users see it (``trainguard status``, a TrainingJob's status):
    the verdict while it is lost or pending, else its agent's own latest state."""
    verdict = contact(report, rule)
    if verdict is not Contact.UP or report is None or report.status is None:
        return verdict
    return report.status.state


def launch_verdict(
    node_ids: Sequence[str],
    reports: Mapping[str, NodeReport],
    rule: ContactRule,
    late: bool,
    start_timeout: float,
    now: float = 0.0,
    host_wait: float = 0.0,
) -> tuple[list[tuple[str, str]], list[str]]:
    """Of nodes being brought up for an attempt: ``(lost, waiting)`` — the lost ones with
    why, and the ones not up and idle yet (lost too once ``late``, past the start
    timeout). A node the platform waits for a host for is waiting for ``host_wait``
    seconds, then lost; one launched once a host came counts its start timeout from its
    launch."""
    lost: list[tuple[str, str]] = []
    waiting: list[str] = []
    exempt: set[str] = set()  # not late: waiting for a host, or launched since
    for node_id in node_ids:
        report = reports.get(node_id)
        if report is not None and report.awaiting_host is not None:
            if now - report.awaiting_host < host_wait:
                waiting.append(node_id)
                exempt.add(node_id)
            else:
                lost.append(
                    (node_id, f"{node_id} lost: no host joined to run it within {host_wait:g}s")
                )
            continue
        launched_at = report.launched_at if report is not None else None
        if launched_at is not None and now - launched_at < start_timeout:
            exempt.add(node_id)
        verdict = contact(report, rule)
        if verdict is Contact.LOST and report is not None:
            lost.append((node_id, lost_reason(report, rule)))
        elif verdict is Contact.PENDING or not settled(report, rule):
            waiting.append(node_id)
    if late:
        why = f"its agent was not ready within {start_timeout:g}s"
        lost += [(n, f"{n} lost: {why}") for n in waiting if n not in exempt]
        waiting = [n for n in waiting if n in exempt]
    return lost, waiting
