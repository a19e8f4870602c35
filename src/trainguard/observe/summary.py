"""The one line a run ends with about its faults: what happened, what it cost.

``trainguard run`` prints it under the job's result, e.g.::

    1 fault: WorkerCrash (rank 3) recovered in 0.8s by an in-process restart, 0 steps lost
    (at step 100, resumed from step 100)

Pure: it reads the controller's fault timeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from trainguard.control.events import Event
from trainguard.control.timeline import FaultRecord

__all__ = ["event_line", "fault_summary"]

_SCOPES = {"in-process": "an in-process restart", "process": "a process restart",
           "job": "a full job restart"}  # fmt: skip


def fault_summary(records: Sequence[FaultRecord]) -> str | None:
    """One line about ``records`` (None: no fault)."""
    if not records:
        return None
    parts = []
    for r in records:
        who = f"rank {r.fault.rank}" if r.fault.rank is not None else r.fault.node or "the job"
        what = f"{r.fault.type} ({who})"
        if r.recovery_seconds is None:
            at = "" if r.fault_step is None else f" at step {r.fault_step}"
            parts.append(f"{what} not recovered{at}")
            continue
        how = _SCOPES.get(r.scope or "", f"a {r.scope} restart")
        lost = "" if r.lost_steps is None else f", {r.lost_steps} steps lost"
        if r.fault_step is not None and r.resumed_step is not None:
            lost += f" (at step {r.fault_step}, resumed from step {r.resumed_step})"
        parts.append(f"{what} recovered in {r.recovery_seconds:.1f}s by {how}{lost}")
    count = f"{len(records)} fault{'s' if len(records) > 1 else ''}"
    return f"{count}: " + "; ".join(parts)


def event_line(event: Event) -> str:
    """An event as the console shows it, on every host: ``HH:MM:SS Kind: message``."""
    stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
    return f"{stamp} {event.kind}: {event.message}"
