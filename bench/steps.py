"""Figures computed from the step records ``bench/train.py`` writes, the same way for every side.

A record is one completed step of rank 0: its incarnation (a launch or restart), the
step number and the step's start and end time (Unix seconds). Pure functions, no I/O
besides :func:`read_steps` (and :func:`parse_lines`, which the other record files use).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepRecord:
    incarnation: str
    step: int
    start: float
    end: float


@dataclass(frozen=True)
class Recovery:
    """What one fault at ``fault_at`` cost, judged from the step records alone."""

    fault_step: int  # last step the faulted incarnation completed
    resumed_step: int  # the step the next incarnation resumed from (its first step - 1)
    next_step_at: float  # end of the first step completed by a later incarnation
    stall_s: float  # fault -> next completed step

    @property
    def lost_steps(self) -> int:
        return max(0, self.fault_step - self.resumed_step)


def parse_lines(path: Path, fields: int, make: Callable[[list[str]], T]) -> list[T]:
    """``make`` of each line of ``path`` that has ``fields`` whitespace-separated fields,
    in file order; a missing file, a torn or foreign line (another count of fields, or
    one ``make`` cannot parse: ``ValueError``) is skipped."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) != fields:
            continue
        try:
            found.append(make(parts))
        except ValueError:
            continue
    return found


def read_steps(path: Path) -> list[StepRecord]:
    """The records in ``path`` in file order; a missing file or a torn last line is skipped."""
    return parse_lines(path, 4, lambda p: StepRecord(p[0], int(p[1]), float(p[2]), float(p[3])))


def first_step_end(records: Sequence[StepRecord]) -> float | None:
    return min((r.end for r in records), default=None)


def recovery_after(records: Sequence[StepRecord], fault_at: float) -> Recovery | None:
    """The recovery from a fault at ``fault_at``; None if no later incarnation completed a step.

    The faulted incarnation is the one that completed the last step started before the
    fault; a step it completed after the fault (in flight at the time) still counts as done.
    """
    before = [r for r in records if r.start <= fault_at]
    if not before:
        return None
    faulted = max(before, key=lambda r: r.end).incarnation
    order = _incarnation_order(records)
    later = [r for r in records if order[r.incarnation] > order[faulted] and r.end >= fault_at]
    if not later:
        return None
    first = min(later, key=lambda r: r.end)
    fault_step = max(r.step for r in records if r.incarnation == faulted)
    return Recovery(fault_step, first.step - 1, first.end, first.end - fault_at)


def throughput(records: Sequence[StepRecord], skip: int = 5) -> float | None:
    """Steps per second of one uninterrupted incarnation, after its first ``skip`` steps."""
    steady = sorted(records, key=lambda r: r.end)[skip:]
    if len(steady) < 2:
        return None
    return (len(steady) - 1) / (steady[-1].end - steady[0].end)


def goodput(records: Sequence[StepRecord], window_start: float, window_end: float) -> float:
    """Useful step time over wall time in ``[window_start, window_end]``.

    A step is useful once: its last completion within the window counts with its own
    duration (start to end), and any earlier completion of the same step number was
    work lost to a fault and redone. Checkpoints, restarts and start-up are not useful.
    """
    last: dict[int, StepRecord] = {}
    for record in sorted(records, key=lambda r: r.end):
        if window_start <= record.start and record.end <= window_end:
            last[record.step] = record
    useful = sum(r.end - r.start for r in last.values())
    return useful / (window_end - window_start)


def median_step_seconds(records: Sequence[StepRecord]) -> float | None:
    durations = [r.end - r.start for r in records]
    return statistics.median(durations) if durations else None


def _incarnation_order(records: Sequence[StepRecord]) -> dict[str, int]:
    """Incarnations in the order they first completed a step."""
    order: dict[str, int] = {}
    for record in sorted(records, key=lambda r: r.end):
        order.setdefault(record.incarnation, len(order))
    return order
