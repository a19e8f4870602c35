"""A job's state as its gauges show it: :class:`~trainguard.observe.job.JobObserver` makes
it, :meth:`~trainguard.observe.metrics.JobMetrics.state` shows it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.observe.account import Accounting

__all__ = ["JobState"]


@dataclass(frozen=True)
class JobState:
    """A job's state as the gauges show it."""

    accounting: Accounting
    step: int | None = None
    steps_per_second: float | None = None
    rank_steps_per_second: Mapping[int, float] | None = None
    nodes: Mapping[str, int] | None = None
    health: Mapping[str, int] | None = None  # nodes by node-health-status
    persist_lag_steps: int | None = None
    hot_spares: int | None = None
