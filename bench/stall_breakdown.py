"""Where the stall of an in-process (checkpointless) recovery goes, from the job's timeline.

Every time is seconds after the fault (``FaultInjected``); the phases overlap in part
(the survivors abort while the controller decides), so each is measured to a milestone:

- ``detect_s``: the controller's fault decision (``faults[0].detected_at``);
- ``abort_s``: the last survivor out of the broken collective, its group aborted
  (its ``InProcessRestart`` event);
- ``reform_s``: from the later of those two to the last rank's new group formed
  (``AttemptJoined`` time less its ``state_seconds``): the attempt announced, the spare
  told, every rank through the group's join;
- ``state_s``: the longest state synchronisation of a rank (``state_seconds``: from its
  own memory, or a peer's, for the spare);
- ``first_step_s``: from the last rank's join to the end of the first step after the
  fault (the stall's end).

The five add up to the stall (``stall_s``) but for rounding.
"""

from __future__ import annotations

from typing import Any


def breakdown(
    job: dict[str, Any], fault_at: float, stall_s: float | None
) -> dict[str, float] | None:
    """The phases of the first in-process recovery after ``fault_at``; None if the
    timeline lacks them (not an in-process recovery, or an older trainguard)."""
    faults = job.get("faults") or []
    if not faults or stall_s is None:
        return None
    attempt = faults[0].get("attempt")
    left = [
        e["time"]
        for e in job["events"]
        if e["kind"] == "InProcessRestart" and (e.get("data") or {}).get("attempt") == attempt
    ]
    joined = [
        e
        for e in job["events"]
        if e["kind"] == "AttemptJoined"
        and isinstance(attempt, int)
        and (e.get("data") or {}).get("attempt") == attempt + 1
        and "state_seconds" in (e.get("data") or {})
    ]
    if not left or not joined:
        return None
    detect = faults[0]["detected_at"] - fault_at
    abort = max(left) - fault_at
    last = max(joined, key=lambda e: e["time"])
    joined_at = last["time"] - fault_at
    state = max(float(e["data"]["state_seconds"]) for e in joined)
    reformed = joined_at - float(last["data"]["state_seconds"])
    return {
        "detect_s": detect,
        "abort_s": abort,
        "reform_s": reformed - max(detect, abort),
        "state_s": state,
        "first_step_s": stall_s - joined_at,
    }
