"""A job's history as the observers read it: attempts, events, faults, and samples.

Samples are what the events do not say: the job's newest completed step over time
(``rank`` :data:`JOB`) and each rank's pace in seconds per step. The platform records
them with a :class:`Trace` each turn (thinned to one per :data:`SAMPLE_INTERVAL` per
series, with each attempt's first and last step kept exactly) and keeps them in the
store's ``samples`` table; :func:`load_history` reads a job back for ``describe`` and
``report``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.control.events import Event
from trainguard.control.resume import RecordedAttempt
from trainguard.platform.store import Store

__all__ = ["JOB", "JobHistory", "SeriesSample", "Trace", "load_history"]

JOB = -1
"""The ``rank`` of the job's progress samples (their value is the step)."""
SAMPLE_INTERVAL = 1.0
"""Seconds between two kept samples of one series (progress, or one rank's pace)."""
PACE_INTERVAL = 10.0
"""Seconds between two recordings of the ranks' paces."""
MAX_PACE_RANKS = 1024
"""Jobs with more ranks than this record no per-rank paces (the store would grow fast)."""


@dataclass(frozen=True)
class SeriesSample:
    time: float
    attempt: int
    rank: int  # JOB for the job's progress
    value: float  # the step (JOB), or the rank's seconds per step

    def row(self) -> tuple[float, int, int, float]:
        return (self.time, self.attempt, self.rank, self.value)


@dataclass(frozen=True)
class JobHistory:
    """Everything recorded about one job (see the module docstring)."""

    job_id: str
    name: str
    phase: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    restarts: int = 0
    attempts: tuple[RecordedAttempt, ...] = ()
    events: tuple[Event, ...] = ()
    faults: tuple[Mapping[str, Any], ...] = ()  # the fault timeline (FaultRecord.to_json)
    samples: tuple[SeriesSample, ...] = ()

    def progress(self) -> list[SeriesSample]:
        """The job's progress samples (the step over time), oldest first."""
        return [s for s in self.samples if s.rank == JOB]

    def paces(self) -> list[SeriesSample]:
        return [s for s in self.samples if s.rank != JOB]


def load_history(store: Store, ref: str) -> JobHistory:
    """A job (by id or name) as recorded in ``store``; raises ``JobNotFound``."""
    job = store.job(ref)
    return JobHistory(
        job_id=job.id,
        name=job.name,
        phase=job.phase,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        restarts=job.restarts,
        attempts=tuple(
            RecordedAttempt(a["number"], a["phase"], a["started_at"], a["ended_at"], a["reason"])
            for a in store.attempts(job.id)
        ),
        events=tuple(store.events(job.id)),
        faults=tuple(json.loads(job.faults_json)),
        samples=tuple(SeriesSample(*row) for row in store.samples(job.id)),
    )


@dataclass
class _Series:
    last_kept: float = float("-inf")
    pending: SeriesSample | None = None  # newest sample not kept yet


@dataclass
class Trace:
    """Thins the progress and pace samples of a running job (see the module docstring).

    ``progress()`` and ``paces()`` take what the controller sees each turn; ``take()``
    returns the samples to store since the last call; ``samples`` keeps them all.
    """

    samples: list[SeriesSample] = field(default_factory=list)
    _new: list[SeriesSample] = field(default_factory=list)
    _series: dict[int, _Series] = field(default_factory=dict)
    _attempt: int | None = None
    _step: tuple[int, float] | None = None
    _paced_at: float = float("-inf")

    def progress(self, attempt: int, first: tuple[int, float], latest: tuple[int, float]) -> None:
        """The current attempt's first completed ``(step, time)`` and its newest."""
        if attempt != self._attempt:
            self._flush()
            self._attempt, self._step = attempt, None
            self._series.pop(JOB, None)
            self._add(SeriesSample(first[1], attempt, JOB, first[0]), keep=True)
        if latest != self._step and latest[1] >= first[1]:
            self._step = latest
            self._add(SeriesSample(latest[1], attempt, JOB, latest[0]))

    def paces(self, now: float, attempt: int, paces: Mapping[int, float]) -> None:
        """Each rank's seconds per step (recorded every :data:`PACE_INTERVAL`)."""
        if not paces or len(paces) > MAX_PACE_RANKS or now - self._paced_at < PACE_INTERVAL:
            return
        self._paced_at = now
        for rank, seconds in sorted(paces.items()):
            self._keep(SeriesSample(now, attempt, rank, seconds))

    def end(self) -> None:
        """The job ended: keep each series' newest sample."""
        self._flush()

    def snapshot(self) -> list[SeriesSample]:
        """The kept samples and each series' newest (for an account of the job so far)."""
        pending = [s.pending for s in self._series.values() if s.pending is not None]
        return self.samples + pending

    def take(self) -> list[SeriesSample]:
        new, self._new = self._new, []
        return new

    def _add(self, sample: SeriesSample, keep: bool = False) -> None:
        series = self._series.setdefault(sample.rank, _Series())
        if keep or sample.time - series.last_kept >= SAMPLE_INTERVAL:
            series.pending = None
            series.last_kept = sample.time
            self._keep(sample)
        else:
            series.pending = sample

    def _flush(self) -> None:
        for series in self._series.values():
            if series.pending is not None:
                self._keep(series.pending)
                series.last_kept, series.pending = series.pending.time, None

    def _keep(self, sample: SeriesSample) -> None:
        self.samples.append(sample)
        self._new.append(sample)
