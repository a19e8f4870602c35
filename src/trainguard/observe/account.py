"""Goodput and downtime: where a job's wall time went, from its history alone.

The window is the job's run: from its start (``started_at``) to its end, or now.

- **Useful** time is time spent on steps that were kept. Each attempt's progress
  samples say which steps it completed and when; a step is *kept* unless a later
  attempt resumed from before it (then it was done again: its time is lost). An attempt
  resumed from the step its ranks restored (a ``CheckpointRestored`` or
  ``AttemptJoined`` event), else from before its first sampled step. An attempt
  keeps the steps from its first completed one to the newest one no later attempt
  redid; its useful time runs from the start of its first kept step (the completion
  time less one step, the attempt's median step time) to the completion of its last
  kept step. Time between steps inside that span (a checkpoint save, logging) counts
  as useful: the samples do not see inside an attempt.
- **Downtime** is every other stretch, with a cause: ``startup`` before the job's
  first step (kept or not); the type of the first fault after the previous kept work
  (``WorkerCrash``, ``LogHang``, ...), lost steps included, for each later gap before
  kept work and for a tail after the last kept step when a fault ended the job (or the
  job is recovering from one now); ``other`` for the rest (the tail of a job that
  completed: its final checkpoint and shutdown). A job with no step yet is all
  ``startup``, or the first fault's once one came.
- **Goodput** is useful / window.

The same function serves ``describe -o json``, the metrics and ``trainguard report``,
so they agree by construction.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.control.timeline import resume_point
from trainguard.observe.history import JobHistory, SeriesSample

__all__ = ["Accounting", "Downtime", "account"]

STARTUP = "startup"
OTHER = "other"
_MEDIAN_OF = 256  # step time: the median of an attempt's newest intervals, at most this many


@dataclass(frozen=True)
class Downtime:
    """One stretch of wall time without kept work."""

    start: float
    end: float
    cause: str  # STARTUP, a fault type, or OTHER
    scope: str | None = None  # the restart's scope, for a fault
    attempt: int | None = None  # the attempt whose fault it was

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class Useful:
    """One attempt's kept work: steps ``first..last`` between ``start`` and ``end``."""

    attempt: int
    start: float
    end: float
    first: int
    last: int


@dataclass(frozen=True)
class Accounting:
    start: float
    end: float
    useful: tuple[Useful, ...] = ()
    downtime: tuple[Downtime, ...] = ()
    lost_steps: int = 0
    step_seconds: float | None = None  # the median step time of the newest productive attempt
    faults: Mapping[str, int] = field(default_factory=dict)
    restarts: int = 0

    @property
    def wall_seconds(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def useful_seconds(self) -> float:
        return sum(u.end - u.start for u in self.useful)

    @property
    def kept_steps(self) -> int:
        return sum(u.last - u.first + 1 for u in self.useful)

    @property
    def goodput(self) -> float | None:
        wall = self.wall_seconds
        return None if wall <= 0 else min(1.0, self.useful_seconds / wall)

    def downtime_seconds(self) -> dict[str, float]:
        """Seconds by cause; ``other`` is what is left of the window (never negative)."""
        by_cause: dict[str, float] = defaultdict(float)
        for d in self.downtime:
            by_cause[d.cause] += d.seconds
        rest = self.wall_seconds - self.useful_seconds - sum(by_cause.values())
        by_cause[OTHER] += max(0.0, rest)
        return dict(by_cause)

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "wall_seconds": self.wall_seconds,
            "useful_seconds": self.useful_seconds,
            "downtime_seconds": self.downtime_seconds(),
            "lost_steps": self.lost_steps,
            "kept_steps": self.kept_steps,
            "step_seconds": self.step_seconds,
            "restarts": self.restarts,
            "faults": dict(self.faults),
        }


@dataclass
class _Attempt:
    number: int
    times: list[float]
    steps: list[int]
    step_seconds: float

    @property
    def first(self) -> int:
        return self.steps[0]

    @property
    def last(self) -> int:
        return self.steps[-1]

    def completed(self, step: int) -> float:
        """When ``step`` completed (interpolated between samples)."""
        i = bisect.bisect_left(self.steps, step)
        if i >= len(self.steps):
            return self.times[-1]
        if self.steps[i] == step or i == 0:
            return self.times[i]
        s0, s1, t0, t1 = self.steps[i - 1], self.steps[i], self.times[i - 1], self.times[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def _attempts(samples: Sequence[SeriesSample]) -> list[_Attempt]:
    by_attempt: dict[int, list[SeriesSample]] = defaultdict(list)
    for s in samples:
        by_attempt[s.attempt].append(s)
    out = []
    for number in sorted(by_attempt):
        times: list[float] = []
        steps: list[int] = []
        for s in sorted(by_attempt[number], key=lambda s: s.time):
            step = int(s.value)
            if steps and step <= steps[-1]:
                continue  # the newest step only grows
            times.append(s.time)
            steps.append(step)
        rates = [
            (t1 - t0) / (s1 - s0)
            for t0, t1, s0, s1 in zip(times, times[1:], steps, steps[1:], strict=False)
        ][-_MEDIAN_OF:]
        out.append(_Attempt(number, times, steps, statistics.median(rates) if rates else 0.0))
    return out


def account(
    history: JobHistory, now: float, samples: Sequence[SeriesSample] | None = None
) -> Accounting:
    """Where ``history``'s wall time went, up to its end or ``now`` (see the module
    docstring); ``samples``: the progress samples to use instead of the history's."""
    start = history.started_at or history.created_at
    end = history.finished_at or max(now, start)
    progress = history.progress() if samples is None else [s for s in samples if s.rank == -1]
    attempts = [a for a in _attempts(progress) if a.steps]
    fallback = next((a.step_seconds for a in reversed(attempts) if a.step_seconds), 0.0)
    for a in attempts:
        a.step_seconds = a.step_seconds or fallback

    # Kept steps, from the newest attempt back: each resumes from the step its ranks
    # restored (control/timeline.py), else from its first step - 1.
    restored: dict[int, int] = {}
    for event in history.events:
        if (point := resume_point(event)) is not None:
            restored[point[0]] = min(point[1], restored.get(point[0], point[1]))
    keep_to: dict[int, int] = {}
    limit: int | None = None
    for a in reversed(attempts):
        keep_to[a.number] = a.last if limit is None else min(a.last, limit)
        resumed = min(a.first - 1, restored.get(a.number, a.first - 1))
        limit = resumed if limit is None else min(limit, resumed)

    faults = [f for f in history.faults if isinstance(f.get("attempt"), int)]
    useful: list[Useful] = []
    downtime: list[Downtime] = []
    lost = 0
    edge, edge_attempt = start, None  # the end of kept work so far, and its attempt
    if attempts:  # before the job's first step: starting up, kept or not
        a = attempts[0]
        edge = max(start, min(end, a.completed(a.first) - a.step_seconds))
        downtime.append(Downtime(start, edge, STARTUP))
    for a in attempts:
        last = keep_to[a.number]
        lost += max(0, a.last - max(last, a.first - 1))
        if last < a.first:
            continue  # everything it did was done again later
        begin = max(edge, a.completed(a.first) - a.step_seconds)
        downtime.append(_gap(edge, begin, edge_attempt, a.number, faults))
        done = max(begin, a.completed(last))
        useful.append(Useful(a.number, begin, done, a.first, last))
        edge, edge_attempt = done, a.number
    downtime.append(_gap(edge, end, edge_attempt, None, faults))
    by_type = Counter(str(f.get("type")) for f in history.faults)
    return Accounting(
        start=start,
        end=end,
        useful=tuple(useful),
        downtime=tuple(d for d in downtime if d.seconds > 0),
        lost_steps=lost,
        step_seconds=attempts[-1].step_seconds if attempts else None,
        faults=dict(by_type),
        restarts=history.restarts,
    )


def _gap(
    start: float,
    end: float,
    after: int | None,
    before: int | None,
    faults: Sequence[Mapping[str, Any]],
) -> Downtime:
    """The stretch between kept work of attempt ``after`` (None: the job's start) and of
    attempt ``before`` (None: the job's end), caused by the first fault in between."""
    for f in faults:
        number = f["attempt"]
        if (after is None or number >= after) and (before is None or number < before):
            return Downtime(start, end, str(f.get("type")), f.get("scope"), number)
    return Downtime(start, end, STARTUP if after is None else OTHER)
