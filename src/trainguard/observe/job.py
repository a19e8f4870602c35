"""One running job's observer: the platform calls it every turn.

It thins the job's progress and its ranks' paces into samples for the store
(:class:`~trainguard.observe.history.Trace`), and keeps the job's metrics current:
counters from each turn's events and the fault timeline, gauges (goodput, downtime,
speed, nodes, checkpoint lag) at most every
:data:`STATE_INTERVAL`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trainguard.control.controller import JobController
from trainguard.control.events import Event
from trainguard.control.reports import NodeReport
from trainguard.control.timeline import resume_point
from trainguard.observe.account import Accounting, account
from trainguard.observe.gauges import JobState
from trainguard.observe.history import JobHistory, SeriesSample, Trace

if TYPE_CHECKING:  # prometheus-client costs ~14 MB: imported only by a run that serves metrics
    from trainguard.observe.metrics import JobMetrics

__all__ = ["STATE_INTERVAL", "JobObserver"]

STATE_INTERVAL = 1.0
"""Seconds between two updates of a job's state gauges (the accounting walks its samples)."""


class JobObserver:
    """See the module docstring. ``metrics``: None when the run exports none."""

    def __init__(self, job_id: str, name: str, metrics: JobMetrics | None = None) -> None:
        self.job_id = job_id
        self.name = name
        self.metrics = metrics
        self.trace = Trace()
        self._counted_faults = 0
        self._state_at = float("-inf")
        self._speed: tuple[int, float, float] | None = None  # step, time, steps/s
        self._restores: list[Event] = []  # where attempts resumed from (the accounting's)

    def turn(
        self,
        now: float,
        controller: JobController,
        events: Sequence[Event],
        reports: Mapping[str, NodeReport] | None,
    ) -> list[SeriesSample]:
        """Take one turn's news; returns the samples to store."""
        attempt = controller.current
        progress = attempt.watch.progress if attempt is not None else None
        if attempt is not None and progress is not None:
            first = (progress.first_step, progress.first_time)
            self.trace.progress(attempt.number, first, (progress.step, progress.time))
        paces = controller.stragglers.paces()
        if attempt is not None and paces:
            self.trace.paces(now, attempt.number, paces)
        self._restores += [e for e in events if resume_point(e) is not None]
        ended = controller.phase.terminal
        if ended:
            self.trace.end()
        if self.metrics is not None:
            self.metrics.events(events)
            self._count_faults(controller, ended)
            if ended or now - self._state_at >= STATE_INTERVAL:
                self._state_at = now
                self.metrics.state(self._state(now, controller, reports, paces))
        return self.trace.take()

    def detected(self, seconds: float) -> None:
        """A fault was decided on ``seconds`` after it happened (when the platform knows)."""
        if self.metrics is not None:
            self.metrics.detected(seconds)

    def forget(self) -> None:
        """The job is gone: drop its gauges."""
        if self.metrics is not None:
            self.metrics.forget()

    def accounting(self, now: float, controller: JobController) -> Accounting:
        """Where the job's time went so far (:func:`~trainguard.observe.account.account`)."""
        history = JobHistory(
            job_id=self.job_id,
            name=self.name,
            phase=controller.phase.value,
            created_at=controller.started_at or now,
            started_at=controller.started_at,
            finished_at=controller.finished_at,
            restarts=controller.restarts,
            events=tuple(self._restores),
            faults=tuple(controller.timeline.to_json()),
        )
        return account(history, now, self.trace.snapshot())

    def _count_faults(self, controller: JobController, ended: bool) -> None:
        """Each fault once its restart's scope is known (or the job ended without one)."""
        assert self.metrics is not None
        records = controller.timeline.records
        ready = []
        while self._counted_faults < len(records):
            record = records[self._counted_faults]
            if record.scope is None and not ended:
                break
            ready.append({"type": str(record.fault.type), "scope": record.scope or "none"})
            self._counted_faults += 1
        self.metrics.faults(ready)

    def _state(
        self,
        now: float,
        controller: JobController,
        reports: Mapping[str, NodeReport] | None,
        paces: Mapping[int, float],
    ) -> JobState:
        attempt = controller.current
        progress = attempt.watch.progress if attempt is not None else None
        step = progress.step if progress is not None else None
        speed = None
        if progress is not None:
            if self._speed is not None and progress.step > self._speed[0]:
                last_step, last_time, _ = self._speed
                if progress.time > last_time:
                    speed = (progress.step - last_step) / (progress.time - last_time)
                    self._speed = (progress.step, progress.time, speed)
            elif self._speed is None or progress.step < self._speed[0]:
                self._speed = (progress.step, progress.time, 0.0)
            if speed is None and self._speed is not None:
                # No new step since the last update: the speed holds until a second has
                # passed without any, then it falls to 0.
                speed = self._speed[2] if now - self._speed[1] < 2 * STATE_INTERVAL else 0.0
        nodes: Counter[str] = Counter()
        lag: int | None = None
        spares = 0
        if reports is not None:
            memory: list[int] = []
            committed: list[int] = []
            for report in reports.values():
                status = report.status
                nodes[status.state.value if status is not None else "pending"] += 1
                if status is not None:
                    spares += status.hot_spares
                    memory += status.checkpoint.memory_steps
                    committed += status.checkpoint.committed
            if controller.config.durable is not None and memory:
                lag = max(memory) - max(committed, default=0)
        return JobState(
            accounting=self.accounting(now, controller),
            step=step,
            steps_per_second=speed,
            rank_steps_per_second={r: 1.0 / s for r, s in paces.items() if s > 0},
            nodes=dict(nodes) if reports is not None else None,
            health=health_counts(controller),
            persist_lag_steps=lag,
            hot_spares=spares if reports is not None else None,
        )


def health_counts(controller: JobController) -> dict[str, int]:
    """The job's nodes (current ones, and those it left) by node-health-status."""
    book = controller.health
    names = [*controller.nodes, *(n for n in book.nodes if n not in controller.nodes)]
    return dict(
        Counter(book.nodes[n].status.value if n in book.nodes else "Schedulable" for n in names)
    )
