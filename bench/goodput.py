"""Goodput under repeated faults: rank 3 SIGKILLed every ``interval`` s for ``duration`` s.

The window is ``[launch, launch + duration]`` of wall time; the kills come at
``interval, 2*interval, ...`` seconds after the first completed step (trainguard's
``--inject kill:rank=3@Ts``; for the baseline, the benchmark sends them). Goodput is
:func:`bench.steps.goodput`: the time spent in steps that were kept, over the window.
Each variant returns a :class:`GoodputRecord`; add one to :data:`GOODPUT_VARIANTS`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.baseline import Relaunch, signal_at_times
from bench.lost_time import breakdown
from bench.recovery import FAULTY_RANK, checkpointless_job, log_rules
from bench.runs import Run, TrainArgs, TrainguardJob, TrainguardRun, event_times
from bench.steps import StepRecord, goodput, median_step_seconds, recovery_after


@dataclass(frozen=True)
class GoodputSetup:
    workdir: Path
    args: TrainArgs
    duration: float
    interval: float

    @property
    def offsets(self) -> list[float]:
        """Seconds after the first step at which a kill is due (within the window)."""
        count = int(self.duration // self.interval)
        return [self.interval * (i + 1) for i in range(count)]


@dataclass(frozen=True)
class GoodputRecord:
    goodput: float
    faults: int  # kills actually sent within the window
    steps_kept: int  # distinct steps completed within the window
    step_s: float | None  # median step duration
    stalls_s: list[float] = field(default_factory=list)  # each kill -> next completed step
    note: str = ""
    lost: dict[str, float] = field(default_factory=dict)  # bench.lost_time.breakdown

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


GoodputVariant = Callable[[GoodputSetup], GoodputRecord]


def trainguard_goodput(setup: GoodputSetup) -> GoodputRecord:
    """Process-level restarts from the memory tier."""
    job = TrainguardJob("bench-goodput", retries=1000, log_rules=log_rules())
    return _trainguard(setup, job)


def checkpointless_goodput(setup: GoodputSetup) -> GoodputRecord:
    """In-process restarts: each kill is taken over by a hot spare, state from a peer."""
    return _trainguard(setup, checkpointless_job("bench-goodput-checkpointless", retries=1000))


def _trainguard(setup: GoodputSetup, job: TrainguardJob) -> GoodputRecord:
    run = TrainguardRun(setup.workdir, setup.args, job)
    end = 0.0
    try:
        run.start([f"kill:rank={FAULTY_RANK}@{t:g}s" for t in setup.offsets])
        end = run.launched_at + setup.duration
        _sleep_until(run, end)
        run.interrupt()
        run.wait(60)
    finally:
        run.stop()
    job = run.describe()
    kills = [t for t in event_times(job, "FaultInjected") if t <= end]
    return _record(run.steps(), run.launched_at, end, kills, event_times(job, "Fault"))


def relaunch_goodput(setup: GoodputSetup) -> GoodputRecord:
    relaunch = Relaunch(setup.workdir, setup.args, max_launches=1000)
    end = 0.0
    try:
        relaunch.start()
        end = relaunch.launched_at + setup.duration
        kills = signal_at_times(
            relaunch.steps,
            relaunch.rank_process,
            FAULTY_RANK,
            setup.offsets,
            signal.SIGKILL,
            until=end,
        )
        while time.time() < end:
            time.sleep(0.2)
    finally:
        relaunch.stop()
    return _record(relaunch.steps(), relaunch.launched_at, end, kills)


GOODPUT_VARIANTS: list[tuple[str, GoodputVariant]] = [
    ("trainguard", trainguard_goodput),
    ("trainguard_checkpointless", checkpointless_goodput),
    ("baseline_relaunch", relaunch_goodput),
]


def _record(
    records: list[StepRecord],
    start: float,
    end: float,
    kills: list[float],
    decisions: list[float] | None = None,
) -> GoodputRecord:
    kept = [r for r in records if start <= r.start and r.end <= end]
    stalls = [rec.stall_s for t in kills if (rec := recovery_after(records, t)) is not None]
    missing = len(kills) - len(stalls)
    note = (
        f"{missing} of {len(kills)} kills not recovered when the window closed" if missing else ""
    )
    return GoodputRecord(
        goodput(records, start, end),
        len(kills),
        len({r.step for r in kept}),
        median_step_seconds(kept),
        stalls,
        note if missing else "",
        breakdown(records, start, end, kills, decisions or []),
    )


def _sleep_until(run: Run, end: float) -> None:
    while time.time() < end and all(code is None for code in run.returncodes):
        time.sleep(0.2)
