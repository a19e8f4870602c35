"""Stragglers: ranks that progress slower than the rest of the job.

Each rank's pace is its seconds per step over its last ``window`` steps, from its own
progress samples (the time its ``Step N`` line was read, or the time of a heartbeat
that gave a step): ``(t_new - t_old) / (s_new - s_old)`` with the newest stored sample
``s_old <= s_new - window``. The samples are the rank's own times, so the pace is exact
however sparsely the controller polls. The job's pace is the median over the ranks
with a full window; a rank whose pace is at least ``threshold`` times that median is a
straggler. It is reported once, and again only after it was back under the threshold;
everything starts afresh with each attempt.

What this can see, and what it cannot:

- a rank is compared with the others, never with a fixed number, so a slowdown of every
  rank together (a slow filesystem, a smaller batch) reports nothing;
- it needs two ranks with a full window, and a rank's pace changes only when the rank
  progresses: a rank that stops altogether is a hang (log rules, heartbeats), not a
  straggler;
- in lockstep synchronous training (DDP, FSDP) every rank waits for the slowest at
  each collective, so the ranks' step times converge and a slow rank looks like the
  others. A heartbeat given before the collectives does not help: a pace is a
  difference of times, and the slow rank's extra compute is a constant lag that
  cancels out. Only ranks that progress at their own pace are told apart (independent
  ranks, loosely coupled ones). Telling a lockstep straggler apart needs another
  signal, such as each rank's own compute time per step, or its lag behind the others
  within one step: not measured yet.

Pure: the caller passes the samples and the attempt; nothing here reads a clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

from trainguard.control.events import Fault, FaultType
from trainguard.wire.status import NodeStatus

__all__ = [
    "DEFAULT_ACTION",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW",
    "MAX_SAMPLES",
    "MAX_WINDOW",
    "StepSample",
    "Straggler",
    "StragglerAction",
    "StragglerWatch",
]

StragglerAction = Literal["report", "restart"]

DEFAULT_THRESHOLD: Final = 1.3
DEFAULT_WINDOW: Final = 20
DEFAULT_ACTION: Final[StragglerAction] = "report"
MAX_WINDOW: Final = 10_000
MAX_SAMPLES: Final = 64
"""Samples kept per rank, whatever the window: older ones are thinned to one every
``ceil(window / (MAX_SAMPLES - 4))`` steps, so a window longer than 60 steps may span
that many steps more (the pace stays exact over the span it has)."""


class StepSample(NamedTuple):
    """A rank's completed ``step`` at unix time ``time``; ``beat``: from a heartbeat (else
    from a progress line). A rank's samples come from one source at a time."""

    step: int
    time: float
    beat: bool = False


@dataclass(frozen=True)
class Straggler:
    """A rank found slower than the job: its pace and the job's median (seconds/step)."""

    rank: int
    node: str | None
    step: int
    seconds_per_step: float
    median_seconds_per_step: float
    window: int

    @property
    def ratio(self) -> float:
        return self.seconds_per_step / self.median_seconds_per_step

    @property
    def message(self) -> str:
        where = f" ({self.node})" if self.node else ""
        return (
            f"rank {self.rank}{where} is a straggler: {self.ratio:.1f}x the median step time "
            f"({self.seconds_per_step:.3f} s vs {self.median_seconds_per_step:.3f} s over "
            f"{self.window} steps)"
        )

    def fault(self, now: float, attempt: int, step: int | None) -> Fault:
        """This straggler as a fault of ``attempt`` (``step``: the job's, as faults have)."""
        return Fault(
            FaultType.STRAGGLER,
            now,
            attempt,
            node=self.node,
            rank=self.rank,
            step=step,
            message=self.message,
            evidence=self.to_json(),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "step": self.step,
            "ratio": round(self.ratio, 3),
            "seconds_per_step": self.seconds_per_step,
            "median_seconds_per_step": self.median_seconds_per_step,
            "window": self.window,
        }


class _Pace:
    """One rank's samples, (step, time) oldest first: the newest, and older ones spaced at
    least ``spacing`` steps apart, back to the newest one a full window before the newest;
    ``seconds``: the pace over that window, once there is one."""

    __slots__ = ("beat", "samples", "seconds", "spacing", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.spacing = max(1, math.ceil(window / (MAX_SAMPLES - 4)))
        self.samples: deque[tuple[int, float]] = deque()
        self.beat = False
        self.seconds: float | None = None

    def add(self, step: int, time: float, beat: bool) -> bool:
        """Keep a sample; False when it tells nothing new (an older or the same step)."""
        samples = self.samples
        if samples:
            newest = samples[-1]
            if beat != self.beat or step < newest[0]:
                samples.clear()  # another source, or a rank restarted within the attempt
            elif step == newest[0] or time < newest[1]:
                return False
            elif len(samples) >= 2 and newest[0] - samples[-2][0] < self.spacing:
                samples.pop()  # kept only as the newest: too close to the one before
        self.beat = beat
        samples.append((step, time))
        horizon = step - self.window
        while len(samples) >= 2 and samples[1][0] <= horizon:
            samples.popleft()
        while len(samples) > MAX_SAMPLES:
            samples.popleft()
        old = samples[0]
        full = len(samples) >= 2 and old[0] <= horizon
        self.seconds = (time - old[1]) / (step - old[0]) if full else None
        return True


class StragglerWatch:
    """Compares the ranks' paces within an attempt; see the module docstring.

    ``threshold`` None: paces are measured (:meth:`paces`), nobody is reported.
    """

    def __init__(self, threshold: float | None, window: int) -> None:
        if threshold is not None and not (math.isfinite(threshold) and threshold > 1):
            raise ValueError(f"threshold: must be a finite number > 1, got {threshold!r}")
        if isinstance(window, bool) or not 2 <= window <= MAX_WINDOW:
            raise ValueError(f"window: must be an integer in [2, {MAX_WINDOW}], got {window!r}")
        self.threshold = threshold
        self.window = window
        self.attempt: int | None = None
        self._ranks: dict[int, _Pace] = {}
        self._nodes: dict[int, str] = {}
        self._reported: set[int] = set()
        self._seen: dict[str, NodeStatus] = {}

    def reset(self, attempt: int) -> None:
        """Forget every rank: ``attempt`` begins."""
        self.attempt = attempt
        self._ranks.clear()
        self._nodes.clear()
        self._reported.clear()
        self._seen.clear()

    def observe_statuses(
        self, attempt: int, current: Iterable[tuple[str, NodeStatus]]
    ) -> list[Straggler]:
        """Feed the statuses of ``attempt`` (node id, status); the new stragglers. A
        rank's sample is its heartbeat where the heartbeat gives a step (the worker's own
        clock, when it called), else its latest progress line. A status seen at the last
        call (the same object) is skipped."""
        if attempt != self.attempt:
            self.reset(attempt)
        changed = False
        for node_id, status in current:
            if self._seen.get(node_id) is status:
                continue
            self._seen[node_id] = status
            beats = status.heartbeats
            for rank, (step, t) in status.monitor.rank_steps.items():
                beat = beats.get(rank)
                if beat is None or beat.step is None:
                    changed |= self._add(rank, step, t, False, node_id)
            for rank, beat in beats.items():
                if beat.step is not None:
                    changed |= self._add(rank, beat.step, beat.time, True, node_id)
        return self._verdicts() if changed else []

    def observe(
        self,
        attempt: int,
        samples: Mapping[int, StepSample | tuple[int, float]],
        nodes: Mapping[int, str] | None = None,
    ) -> list[Straggler]:
        """Feed per-rank samples of ``attempt`` (and where each rank runs); the new
        stragglers."""
        if attempt != self.attempt:
            self.reset(attempt)
        changed = False
        for rank, sample in samples.items():
            step, t, beat = StepSample(*sample)
            changed |= self._add(rank, step, t, beat, (nodes or {}).get(rank))
        return self._verdicts() if changed else []

    def paces(self) -> dict[int, float]:
        """Seconds per step of every rank with a full window, in the current attempt."""
        return {
            rank: pace.seconds for rank, pace in self._ranks.items() if pace.seconds is not None
        }

    def median(self) -> float | None:
        """The job's seconds per step: the median pace (None with fewer than 2 ranks)."""
        paces = list(self.paces().values())
        return statistics.median(paces) if len(paces) >= 2 else None

    # -- the pieces -------------------------------------------------------------

    def _add(self, rank: int, step: int, t: float, beat: bool, node: str | None) -> bool:
        pace = self._ranks.get(rank)
        if pace is None:
            pace = self._ranks[rank] = _Pace(self.window)
        if node is not None:
            self._nodes[rank] = node
        return pace.add(step, t, beat)

    def _verdicts(self) -> list[Straggler]:
        threshold = self.threshold
        paces = self.paces() if threshold is not None else {}
        if threshold is None or len(paces) < 2:
            return []
        median = statistics.median(paces.values())
        if not median > 0:
            return []
        found = []
        for rank, seconds in paces.items():
            if seconds < threshold * median:
                self._reported.discard(rank)
            elif rank not in self._reported:
                self._reported.add(rank)
                found.append(
                    Straggler(
                        rank=rank,
                        node=self._nodes.get(rank),
                        step=self._ranks[rank].samples[-1][0],
                        seconds_per_step=seconds,
                        median_seconds_per_step=median,
                        window=self.window,
                    )
                )
        return found
