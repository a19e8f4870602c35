"""Hangs found without rules: a job that prints progress and stops making it.

trainguard reads every rank's progress lines (``Step N``, ``Batch N``, ... or the spec's
``progressPattern``) and the steps heartbeats give. A job that showed progress in an
attempt and then shows none for much longer than its own step time is hung, log rules or
not (``NoProgress``, a hang: its stacks are captured and the restart policy takes it):

- **the bound**: :data:`STEP_FACTOR` times the attempt's mean seconds per step so far,
  and at least ``no_progress_timeout`` (``noProgressTimeoutSeconds``, default
  :data:`DEFAULT_TIMEOUT`; null switches this off), counted from the latest step any
  rank reported (the job is hung), or from a rank's own latest step while others go on
  (that rank is: it printed steps, then stopped);
- **only while every rank runs**: once a rank has exited (its work done, or a fault
  already found) the silence of the others is not this rule's (see
  :mod:`trainguard.control.exit_hang`); before the attempt's first step, the log rules'
  start cut-off is the only timer;
- time does not run while the attempt is paused (:class:`~trainguard.monitor.hang.PauseClock`).

Pure: every time comes from the reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from trainguard.control.exit_hang import step_seconds
from trainguard.monitor.hang import PauseClock
from trainguard.wire.status import NodeStatus, Progress, WorkerState

__all__ = ["DEFAULT_TIMEOUT", "STEP_FACTOR", "Stall", "StallWatch"]

DEFAULT_TIMEOUT: Final = 60.0
"""The bound's floor: seconds without a new step before a job is hung."""
STEP_FACTOR: Final = 10.0
"""The bound is at least this many of the attempt's mean step times."""


@dataclass(frozen=True)
class Stall:
    """No step since ``since`` (the latest at ``step``), for more than ``bound`` seconds:
    of the whole job, or of ``rank`` (on ``node``) while the others went on."""

    step: int
    since: float
    bound: float
    per_step: float | None
    rank: int | None = None
    node: str | None = None

    def message(self, now: float, elapsed: float) -> str:
        pace = f"{self.per_step:.2f}s a step" if self.per_step is not None else "one step so far"
        who = f"rank {self.rank}" if self.rank is not None else "the job"
        return (
            f"NoProgress: {who} completed no step after step {self.step} for {elapsed:.0f}s "
            f"(bound {self.bound:g}s: {STEP_FACTOR:g} steps at {pace}, at least "
            f"noProgressTimeoutSeconds)"
        )

    def evidence(self) -> dict[str, Any]:
        return {"last_step": self.step, "since": self.since, "bound": self.bound,
                "seconds_per_step": self.per_step}  # fmt: skip


class StallWatch:
    """Watches one attempt's progress (see the module doc)."""

    def __init__(self, timeout: float | None, clock: PauseClock | None = None) -> None:
        self.timeout = timeout
        self.clock = clock or PauseClock()
        self._fired = False

    def check(
        self, now: float, progress: Progress | None, current: Sequence[tuple[str, NodeStatus]]
    ) -> Stall | None:
        """A stall to report now (once per attempt), or None."""
        if self.timeout is None or self._fired or progress is None:
            return None
        ranks = _rank_steps(current)
        if ranks is None:
            return None  # a rank exited: not this rule's silence
        latest = (progress.step, progress.time)
        for _, step, t in ranks.values():
            if t > latest[1]:
                latest = (step, t)
        per_step = step_seconds(progress)
        bound = _bound(self.timeout, per_step)
        if self.clock.elapsed(latest[1], now) > bound:
            self._fired = True
            return Stall(latest[0], latest[1], bound, per_step)
        for rank, (node_id, step, t) in sorted(ranks.items()):
            if self.clock.elapsed(t, now) > bound:
                self._fired = True
                return Stall(step, t, bound, per_step, rank, node_id)
        return None

    def due(
        self, progress: Progress | None, current: Sequence[tuple[str, NodeStatus]]
    ) -> float | None:
        """The soonest :meth:`check` can find a stall, from these reports (a pause only
        puts it off); None: it cannot."""
        if self.timeout is None or self._fired or progress is None:
            return None
        ranks = _rank_steps(current)
        if ranks is None:
            return None
        oldest = min((t for _, _, t in ranks.values()), default=progress.time)
        return min(oldest, progress.time) + _bound(self.timeout, step_seconds(progress))

    def elapsed(self, stall: Stall, now: float) -> float:
        return self.clock.elapsed(stall.since, now)


def _bound(timeout: float, per_step: float | None) -> float:
    """The stall bound: ``timeout``, or :data:`STEP_FACTOR` steps when that is longer."""
    return max(timeout, STEP_FACTOR * per_step) if per_step else timeout


def _rank_steps(
    current: Sequence[tuple[str, NodeStatus]],
) -> dict[int, tuple[str, int, float]] | None:
    """Each rank's node, latest step and its time (a heartbeat's where newer than the
    progress line's); None when a rank is not running."""
    ranks: dict[int, tuple[str, int, float]] = {}
    for node_id, status in current:
        if any(w.state is not WorkerState.RUNNING for w in status.workers):
            return None
        steps = {r: (s, t) for r, (s, t) in status.monitor.rank_steps.items()}
        for rank, beat in status.heartbeats.items():
            if beat.step is not None and beat.time > steps.get(rank, (0, -1.0))[1]:
                steps[rank] = (beat.step, beat.time)
        for rank, (step, t) in steps.items():
            ranks[rank] = (node_id, step, t)
    return ranks
