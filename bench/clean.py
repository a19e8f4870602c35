"""Runs without faults: start-up (launch -> first completed step) and throughput.

trainguard runs the job as users would (log rules on, a memory checkpoint every 10
steps); the baseline is bare torchrun (2 agents, c10d rendezvous, no checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.baseline import free_port
from bench.recovery import log_rules
from bench.runs import Run, TorchrunRun, TrainArgs, TrainguardJob, TrainguardRun
from bench.steps import first_step_end, throughput


@dataclass(frozen=True)
class CleanRecord:
    first_step_s: float | None  # launch -> end of the first step
    steps_per_s: float | None
    completed: bool


def trainguard_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    job = TrainguardJob("bench-clean", log_rules=log_rules(), memory_every_steps=args.ckpt_every)
    run = TrainguardRun(workdir, args, job)
    try:
        run.start()
        finished = run.wait(timeout)
    finally:
        run.stop()
    return _record(run, finished, args.steps)


def torchrun_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    run = TorchrunRun(workdir, args, run_id="clean", ckpt="none")
    try:
        run.start(free_port())
        finished = run.wait(timeout)
    finally:
        run.stop()
    return _record(run, finished, args.steps)


def _record(run: Run, finished: bool, steps: int) -> CleanRecord:
    records = run.steps()
    first = first_step_end(records)
    completed = finished and bool(records) and max(r.step for r in records) == steps
    return CleanRecord(
        None if first is None else first - run.launched_at, throughput(records), completed
    )
