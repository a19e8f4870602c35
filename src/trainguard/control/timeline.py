"""The fault timeline: when each fault was seen, and what recovering from it cost.

A fault is *recovered* at the first training step completed after it (the
first progress of a later attempt).

- ``fault_step`` is the step the faulty attempt reached by the time it stopped: its
  progress when the fault was detected, raised by what is learnt later of that attempt
  (step lines read after the fault: a killed rank's last ones, a rank not blocked by the
  dead one that went on until stopped; a resilient rank's own count when it left).
- ``resumed_step`` is the step the new attempt resumed from: the step its ranks restored
  (a ``CheckpointRestored`` or ``AttemptJoined`` worker event: :func:`resume_point`), else
  its first completed step minus one. A script that prints its step every N steps has its
  first line N steps after the restore: that line alone would hide the steps redone.
- ``lost_steps`` = ``fault_step`` - ``resumed_step``: the completed work done again (0
  only when nothing is redone).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainguard.control.events import Event, EventKind, Fault

# Worker events that say where an attempt's ranks resumed from (their ``step``), and the
# one that says where a resilient rank was when it left an attempt.
RESUME_KINDS = (EventKind.CHECKPOINT_RESTORED, EventKind.ATTEMPT_JOINED)
LEFT_KIND = EventKind.IN_PROCESS_RESTART


def resume_point(event: Event) -> tuple[int, int] | None:
    """``(attempt, step)`` when ``event`` is a rank restoring ``step`` in ``attempt``
    (the attempt its data names: a resilient rank's event may be read an attempt late)."""
    return _step_of(event) if event.kind in RESUME_KINDS else None


def left_at(event: Event) -> tuple[int, int] | None:
    """``(attempt, step)`` when ``event`` is a resilient rank leaving ``attempt`` after
    completing ``step``."""
    return _step_of(event) if event.kind == LEFT_KIND else None


def _step_of(event: Event) -> tuple[int, int] | None:
    step, attempt = event.data.get("step"), event.data.get("attempt", event.attempt)
    if isinstance(step, int) and isinstance(attempt, int) and not isinstance(step, bool):
        return attempt, step
    return None


@dataclass
class FaultRecord:
    fault: Fault
    detected_at: float
    fault_step: int | None
    scope: str | None = None
    recovered_at: float | None = None
    resumed_step: int | None = None
    recovered_by: int | None = None  # the attempt whose first step recovered it

    @property
    def recovery_seconds(self) -> float | None:
        if self.recovered_at is None:
            return None
        return self.recovered_at - self.detected_at

    @property
    def lost_steps(self) -> int | None:
        if self.fault_step is None or self.resumed_step is None:
            return None
        return max(0, self.fault_step - self.resumed_step)

    def at_step(self) -> str:
        """`` at step 208``: the step the fault's attempt reached, where known."""
        return "" if self.fault_step is None else f" at step {self.fault_step}"

    def to_json(self) -> dict[str, Any]:
        return {
            **self.fault.to_json(),
            "detected_at": self.detected_at,
            "fault_step": self.fault_step,
            "scope": self.scope,
            "recovered_at": self.recovered_at,
            "recovery_seconds": self.recovery_seconds,
            "resumed_step": self.resumed_step,
            "lost_steps": self.lost_steps,
        }


class Timeline:
    """Fault records in detection order, filled in as recovery proceeds."""

    def __init__(self) -> None:
        self.records: list[FaultRecord] = []
        self._resumed: dict[int, int] = {}  # attempt -> the step its ranks restored

    def reached(self, attempt: int, step: int) -> None:
        """``attempt`` had completed ``step`` (learnt late, perhaps): its faults' step."""
        for record in self.records:
            if record.fault.attempt == attempt and (
                record.fault_step is None or record.fault_step < step
            ):
                record.fault_step = step

    def resumed(self, attempt: int, step: int) -> None:
        """A rank of ``attempt`` resumed from ``step`` (restored it): the faults that
        attempt recovers resumed from there, not from before its first step line."""
        step = min(step, self._resumed.get(attempt, step))
        self._resumed[attempt] = step
        for record in self.records:
            if record.recovered_by == attempt:
                record.resumed_step = step

    def add(self, fault: Fault, fault_step: int | None) -> None:
        self.records.append(FaultRecord(fault, fault.time, fault_step))

    def update_fault(self, old: Fault, new: Fault) -> None:
        """Replace a fault value (e.g. once its stacks are attached)."""
        for record in self.records:
            if record.fault is old:
                record.fault = new

    def set_scope(self, attempt: int, scope: str) -> None:
        for record in self.records:
            if record.fault.attempt == attempt and record.scope is None:
                record.scope = scope

    def progress(self, attempt: int, first_step: int, first_time: float) -> list[FaultRecord]:
        """The first completed step of ``attempt``: recovers every earlier open fault."""
        recovered = []
        for record in self.records:
            if record.recovered_at is None and record.fault.attempt < attempt:
                record.recovered_at = max(first_time, record.detected_at)
                record.resumed_step = self._resumed.get(attempt, first_step - 1)
                record.recovered_by = attempt
                recovered.append(record)
        return recovered

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]


def with_evidence(fault: Fault, **evidence: Any) -> Fault:
    return replace(fault, evidence={**fault.evidence, **evidence})
