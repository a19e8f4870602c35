"""Why a failed job failed: the fault that started the failure, not only the last one.

A job fails when a fault meets a spent budget, and the controller's reason (its
``JobFailed`` event) names that last fault. The failure may have begun earlier: a host
went silent (cut off, powered down), its node was lost, and each restart after it then
failed to bring the node back (``its agent could not be launched``, ``no host joined to
run it``). The last fault is then a consequence, and naming it alone blames the launch,
not the silence.

The fault that started the failure is the first one since the job last recovered (its
last ``Recovered`` event, or its start): no attempt after it completed a step.
:func:`failure_cause` names it first when it is a host's silence, or a fault of another
type than the last attempt's (a crash, then a node that could not be brought back); the
same fault again (a crash each attempt, a script error) is the reason's own. Pure:
literal events in, a line out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.control.events import Event, EventKind, FaultType

__all__ = ["failure_cause", "went_silent"]


def failure_cause(events: Sequence[Event]) -> str | None:
    """The cause of a failed job, from its events (oldest first); None: it did not fail
    (no ``JobFailed`` event)."""
    ended = [e for e in events if e.kind == EventKind.JOB_FAILED]
    if not ended:
        return None
    failed = ended[-1].message
    started = _first_unrecovered_fault(events)
    if started is None or failed.startswith(started.message):
        return failed
    last = {
        e.data.get("type")
        for e in events
        if e.kind == EventKind.FAULT and e.attempt == ended[-1].attempt
    }
    if not went_silent(started.data) and started.data.get("type") in last:
        return failed
    attempt = "" if started.attempt is None else f"attempt {started.attempt}: "
    origin = f"{attempt}{started.message}"
    if went_silent(started.data):
        stamp = time.strftime("%H:%M:%S", time.localtime(started.time))
        origin = f"{started.node}'s host went silent at {stamp} ({origin})"
    return f"{origin}; no attempt after it completed a step, and the job failed on: {failed}"


def went_silent(fault: Mapping[str, Any]) -> bool:
    """A node lost because its agent stopped answering (its host cut off or down), not
    because it is known to be gone (its agent exited, its pod was deleted)."""
    evidence = fault.get("evidence")
    if fault.get("type") != FaultType.NODE_LOST or not isinstance(evidence, Mapping):
        return False
    contacts = evidence.get("failed_contacts")
    return evidence.get("gone") is None and isinstance(contacts, int) and contacts > 0


def _first_unrecovered_fault(events: Sequence[Event]) -> Event | None:
    """The first ``Fault`` event after the last ``Recovered`` one."""
    first: Event | None = None
    for e in events:
        if e.kind == EventKind.RECOVERED:
            first = None
        elif e.kind == EventKind.FAULT and first is None:
            first = e
    return first
