"""The fault timeline: when each fault was seen, and what recovering from it cost.

A fault is *recovered* at the first training step completed after it (the
first progress of a later attempt). ``resumed_step`` is the step the new
attempt resumed from (its first completed step minus one) and ``lost_steps``
the completed work that had to be redone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainguard.control.events import Fault


@dataclass
class FaultRecord:
    fault: Fault
    detected_at: float
    fault_step: int | None
    scope: str | None = None
    recovered_at: float | None = None
    resumed_step: int | None = None

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
                record.resumed_step = first_step - 1
                recovered.append(record)
        return recovered

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]


def with_evidence(fault: Fault, **evidence: Any) -> Fault:
    return replace(fault, evidence={**fault.evidence, **evidence})
