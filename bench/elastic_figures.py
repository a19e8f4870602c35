"""The elastic scenario's figures (:mod:`bench.elastic`), from a run's records alone.

A run leaves rank 0's step records (``steps.txt``: incarnation, step, start, end), each
rank's line per incarnation (``worlds.txt``: incarnation, rank, world size, pid, time,
written by ``bench/train.py --elastic``) and its job's events (``describe -o json``).
From them: each scaling's time from the injection and from the controller's decision
to the end of the first step at the new world size, the gap in training, the steps
redone, the path it took (the survivors kept their processes: in-process; else a
restart), and the throughput before, between and after. Pure functions, no I/O besides
:func:`read_worlds`; every time is ``time.time()`` on one machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.steps import StepRecord, parse_lines, throughput

IN_PROCESS, RESTART = "in-process", "restart"
PHASE_SKIP = 3
"""Steps left out at the start of each phase's throughput (warm-up after a scaling)."""
DECISIONS = ("ScalingRequested", "ElasticScaling")
"""The controller's events that mark a scaling decided (the earlier one counts)."""


@dataclass(frozen=True)
class WorldRecord:
    """One rank's line in ``worlds.txt``: it started ``incarnation`` at ``world`` ranks."""

    incarnation: str
    rank: int
    world: int
    pid: int
    time: float


def read_worlds(path: Path) -> list[WorldRecord]:
    """The lines of ``worlds.txt``; a missing file or a torn line is skipped."""
    return parse_lines(
        path, 5, lambda p: WorldRecord(p[0], int(p[1]), int(p[2]), int(p[3]), float(p[4]))
    )


@dataclass(frozen=True)
class Scaling:
    """One change of the world size, judged from the records and the events."""

    injected_at: float  # the injection that caused it (FaultInjected)
    decided_at: float | None  # the first ScalingRequested / ElasticScaling after it
    first_step: StepRecord  # the first step completed at the new size
    last_end: float  # the end of the last step completed before it (at the old size)
    old_world: int
    new_world: int
    lost_steps: int  # steps done before it and done again at the new size
    path: str | None  # IN_PROCESS or RESTART (None: not known)
    pids_kept: bool | None  # a survivor's worker pid is in both incarnations
    event_in_place: bool | None  # the ElasticScaling event's ``in_place``

    @property
    def from_injection_s(self) -> float:
        return self.first_step.end - self.injected_at

    @property
    def stall_s(self) -> float:
        """The gap in training: last step at the old size -> first at the new one."""
        return self.first_step.end - self.last_end

    @property
    def from_decision_s(self) -> float | None:
        return None if self.decided_at is None else self.first_step.end - self.decided_at


@dataclass(frozen=True)
class ElasticRecord:
    """One run of one variant; times in seconds."""

    completed: bool
    down_s: float | None = None  # preemption injected -> first step at the smaller size
    down_from_decision_s: float | None = None  # scaling decided -> the same step
    down_lost_steps: int | None = None
    down_stall_s: float | None = None  # last step at the old size -> first at the new
    down_path: str | None = None
    up_s: float | None = None  # scale-up decided -> first step at the larger size
    up_from_capacity_s: float | None = None  # capacity injected -> the same step
    up_lost_steps: int | None = None
    up_stall_s: float | None = None
    up_path: str | None = None
    lost_steps: int | None = None  # step numbers completed more than once, whole run
    steps_per_s_before: float | None = None
    steps_per_s_between: float | None = None
    steps_per_s_after: float | None = None
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def elastic_figures(
    records: Sequence[StepRecord],
    worlds: Sequence[WorldRecord],
    events: Sequence[Mapping[str, Any]],
    completed: bool = True,
    note: str = "",
) -> ElasticRecord:
    """The figures of one run: its step records, its incarnations, its job's events
    (``kind``, ``time``, ``data``, as ``describe -o json`` has them)."""
    sized = _with_worlds(records, worlds)
    down_at = _injected(events, "preempt")
    up_at = _injected(events, "capacity")
    notes = [note] if note else []
    down = _scaling(sized, worlds, events, down_at, shrink=True) if down_at else None
    up = _scaling(sized, worlds, events, up_at, shrink=False) if up_at else None
    if down_at is None or up_at is None:
        notes.append("an injection was not recorded in the job's events")
    if down_at is not None and down is None:
        notes.append("no step at a smaller world size after the preemption")
    if up_at is not None and up is None:
        notes.append("no step at a larger world size after the capacity was given")
    for scaling in (down, up):
        if scaling and _disagree(scaling):
            notes.append(
                f"{scaling.old_world} -> {scaling.new_world}: the event says in_place="
                f"{scaling.event_in_place}, the pids say kept={scaling.pids_kept}"
            )
    rates = _phase_rates(sized, down, up)
    steps = [r.step for r in records]
    return ElasticRecord(
        completed=completed,
        down_s=down.from_injection_s if down else None,
        down_from_decision_s=down.from_decision_s if down else None,
        down_lost_steps=down.lost_steps if down else None,
        down_stall_s=down.stall_s if down else None,
        down_path=down.path if down else None,
        up_s=up.from_decision_s if up else None,
        up_from_capacity_s=up.from_injection_s if up else None,
        up_lost_steps=up.lost_steps if up else None,
        up_stall_s=up.stall_s if up else None,
        up_path=up.path if up else None,
        lost_steps=len(steps) - len(set(steps)) if steps else None,
        steps_per_s_before=rates[0],
        steps_per_s_between=rates[1],
        steps_per_s_after=rates[2],
        note="; ".join(notes),
        detail={
            "worlds": _incarnation_worlds(worlds),
            "scalings": [_describe(s) for s in (down, up) if s is not None],
        },
    )


def _disagree(s: Scaling) -> bool:
    """The ElasticScaling event and the pids tell different paths."""
    return None not in (s.pids_kept, s.event_in_place) and s.pids_kept != s.event_in_place


def _with_worlds(
    records: Sequence[StepRecord], worlds: Sequence[WorldRecord]
) -> list[tuple[StepRecord, int]]:
    """The records whose incarnation's world size is known, with it, by end time."""
    size = _incarnation_worlds(worlds)
    known = [(r, size[r.incarnation]) for r in records if r.incarnation in size]
    return sorted(known, key=lambda pair: pair[0].end)


def _incarnation_worlds(worlds: Sequence[WorldRecord]) -> dict[str, int]:
    return {w.incarnation: w.world for w in sorted(worlds, key=lambda w: w.time)}


def _injected(events: Sequence[Mapping[str, Any]], kind: str) -> float | None:
    """When the first ``--inject <kind>:...`` fired (its FaultInjected event)."""
    times = [
        float(e["time"])
        for e in events
        if e.get("kind") == "FaultInjected"
        and str((e.get("data") or {}).get("spec", "")).startswith(f"{kind}:")
    ]
    return min(times, default=None)


def _scaling(
    sized: Sequence[tuple[StepRecord, int]],
    worlds: Sequence[WorldRecord],
    events: Sequence[Mapping[str, Any]],
    injected_at: float,
    shrink: bool,
) -> Scaling | None:
    """The change of world size after ``injected_at``: smaller (``shrink``) or larger
    than the world of the last step completed before it."""
    before = [(r, w) for r, w in sized if r.end <= injected_at]
    if not before:
        return None
    old_record, old_world = before[-1]
    after = [
        (r, w)
        for r, w in sized
        if r.end > injected_at and (w < old_world if shrink else w > old_world)
    ]
    if not after:
        return None
    first, new_world = after[0]
    done_before = [r for r, _ in sized if r.end < first.end]
    lost = max(0, max((r.step for r in done_before), default=0) - (first.step - 1))
    decided = [
        float(e["time"])
        for e in events
        if e.get("kind") in DECISIONS and injected_at <= float(e["time"]) <= first.end
    ]
    scaled = [
        e
        for e in events
        if e.get("kind") == "ElasticScaling" and injected_at <= float(e["time"]) <= first.end
    ]
    in_place = bool((scaled[0].get("data") or {}).get("in_place")) if scaled else None
    kept = _pids_kept(worlds, old_record.incarnation, first.incarnation)
    path = kept if kept is not None else in_place
    return Scaling(
        injected_at=injected_at,
        decided_at=min(decided, default=None),
        first_step=first,
        last_end=done_before[-1].end,
        old_world=old_world,
        new_world=new_world,
        lost_steps=lost,
        path=None if path is None else IN_PROCESS if path else RESTART,
        pids_kept=kept,
        event_in_place=in_place,
    )


def _pids_kept(worlds: Sequence[WorldRecord], old: str, new: str) -> bool | None:
    """Whether a rank's process of incarnation ``old`` runs incarnation ``new`` too
    (the survivors kept their processes); None when either is unknown."""
    old_pids = {w.pid for w in worlds if w.incarnation == old}
    new_pids = {w.pid for w in worlds if w.incarnation == new}
    if not old_pids or not new_pids:
        return None
    return bool(old_pids & new_pids)


def _phase_rates(
    sized: Sequence[tuple[StepRecord, int]], down: Scaling | None, up: Scaling | None
) -> tuple[float | None, float | None, float | None]:
    """Steps per second at the full size before the scale-down, at the smaller size
    between the scalings, and at the full size after the scale-up."""
    before = [r for r, w in sized if down is not None and r.end <= down.injected_at]
    between = [
        r
        for r, w in sized
        if down is not None
        and r.end >= down.first_step.end
        and w == down.new_world
        and (up is None or r.end < up.first_step.end)
    ]
    after = [r for r, w in sized if up is not None and r.end >= up.first_step.end]
    return (
        throughput(before, skip=PHASE_SKIP),
        throughput(between, skip=PHASE_SKIP),
        throughput(after, skip=PHASE_SKIP),
    )


def _describe(s: Scaling) -> dict[str, Any]:
    return {
        "from": s.old_world,
        "to": s.new_world,
        "injected_at": s.injected_at,
        "decided_at": s.decided_at,
        "first_step": s.first_step.step,
        "first_step_end": s.first_step.end,
        "lost_steps": s.lost_steps,
        "stall_s": s.stall_s,
        "path": s.path,
        "pids_kept": s.pids_kept,
        "event_in_place": s.event_in_place,
    }
