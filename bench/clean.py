"""Runs without faults: start-up (launch -> first completed step), throughput, and the
CPU the launcher's own processes use.

Each side is measured like for like:

- the launcher alone: trainguard (log rules on, no checkpoint) against bare torchrun
  (2 agents, c10d rendezvous, no checkpoint);
- with checkpoints every 10 steps: trainguard's memory checkpoint (``Checkpointer``)
  against torchrun with rank 0 ``torch.save``-ing model and optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.baseline import free_port
from bench.cpu import CpuSampler
from bench.recovery import log_rules
from bench.runs import Run, TorchrunRun, TrainArgs, TrainguardJob, TrainguardRun
from bench.steps import first_step_end, throughput


@dataclass(frozen=True)
class CleanRecord:
    first_step_s: float | None  # launch -> end of the first step
    steps_per_s: float | None
    completed: bool
    launcher_cpu_s_per_min: float | None = None  # the launcher's own processes, training
    # trainguard's worker template per node (MiB, bench/cpu.py's memory_mib): the largest
    # resident, proportional (shared pages split with its workers) and private memory
    template_rss_mib: float | None = None
    template_pss_mib: float | None = None
    template_uss_mib: float | None = None


CleanVariant = Callable[[Path, TrainArgs, float], CleanRecord]


def trainguard_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    """trainguard as a torchrun user would run it: log rules, no checkpoint."""
    job = TrainguardJob("bench-clean", log_rules=log_rules(), ckpt="none")
    return _trainguard(workdir, args, job, timeout)


def trainguard_checkpoint_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    """With the memory checkpoint every ``args.ckpt_every`` steps."""
    job = TrainguardJob("bench-clean", log_rules=log_rules(), memory_every_steps=args.ckpt_every)
    return _trainguard(workdir, args, job, timeout)


def torchrun_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    return _torchrun(workdir, args, "none", timeout)


def torchrun_save_clean(workdir: Path, args: TrainArgs, timeout: float) -> CleanRecord:
    """torchrun, rank 0 ``torch.save``-ing every ``args.ckpt_every`` steps."""
    return _torchrun(workdir, args, "torch", timeout)


CLEAN_VARIANTS: list[tuple[str, CleanVariant]] = [
    ("trainguard", trainguard_clean),
    ("trainguard_checkpoint", trainguard_checkpoint_clean),
    ("baseline_torchrun", torchrun_clean),
    ("baseline_torchrun_save", torchrun_save_clean),
]
# (trainguard variant, its like-for-like baseline) per clean metric.
LIKE_FOR_LIKE = [
    ("trainguard", "baseline_torchrun"),
    ("trainguard_checkpoint", "baseline_torchrun_save"),
]


def _trainguard(workdir: Path, args: TrainArgs, job: TrainguardJob, timeout: float) -> CleanRecord:
    run = TrainguardRun(workdir, args, job)
    sampler = CpuSampler(lambda: [p.pid for p in run.procs if p.poll() is None])
    try:
        run.start()
        sampler.start()
        finished = run.wait(timeout)
    finally:
        sampler.stop()
        run.stop()
    return _record(run, finished, args.steps, sampler)


def _torchrun(workdir: Path, args: TrainArgs, ckpt: str, timeout: float) -> CleanRecord:
    run = TorchrunRun(workdir, args, run_id="clean", ckpt=ckpt)
    sampler = CpuSampler(lambda: [p.pid for p in run.procs if p.poll() is None])
    try:
        run.start(free_port())
        sampler.start()
        finished = run.wait(timeout)
    finally:
        sampler.stop()
        run.stop()
    return _record(run, finished, args.steps, sampler)


def _record(run: Run, finished: bool, steps: int, sampler: CpuSampler) -> CleanRecord:
    records = run.steps()
    first = first_step_end(records)
    completed = finished and bool(records) and max(r.step for r in records) == steps
    last = max((r.end for r in records), default=None)
    cpu = sampler.launcher_rate(first, last) if first is not None and last is not None else None
    memory = sampler.template_memory() or {}
    return CleanRecord(
        None if first is None else first - run.launched_at,
        throughput(records),
        completed,
        cpu,
        memory.get("rss"),
        memory.get("pss"),
        memory.get("uss"),
    )
