"""Elastic training: a node preempted, then capacity given back, on two paths side by side.

Both variants run ``bench/train.py --elastic`` as an elastic trainguard job (``nodes``
nodes x 1 process, ``elasticPolicy`` from ``min_nodes`` to ``nodes``, the global batch
fixed at every size) and take the same two injections: ``preempt:node=<last>`` at one
step, ``capacity:+1`` at a later one.

- ``trainguard_in_process``: ``--ckpt resilient`` (``@trainguard.resilient.restartable``)
  in a job with ``inProcessRestart``: the survivors can re-form a smaller group without
  restarting, and a new node can join a running job, taking its state from a peer. Where
  the controller does not (yet) scale in place, the job restarts instead; the figures
  say which path each scaling took.
- ``baseline_checkpoint_restart`` (HyperPod's path): ``--ckpt torch`` in the same job
  without ``inProcessRestart``: on ``trainguard.elastic.scale_requested()`` rank 0
  saves, every rank exits 0, and the job restarts at the new size from that checkpoint.

The figures come from the step records (``steps.txt``, rank 0's) and each incarnation's
world size and pids (``worlds.txt``, every rank's), with the times of the job's events
(``trainguard describe -o json``); every time is ``time.time()`` on this machine. The
arithmetic is :mod:`bench.elastic_figures`'s (pure, tested without jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.elastic_figures import (
    DECISIONS,
    ElasticRecord,
    elastic_figures,
    read_worlds,
)
from bench.layout import ratio_key, sides
from bench.report import ratio, summary
from bench.runs import TrainArgs, TrainguardJob, TrainguardRun

METRICS = (
    "down_s",
    "down_from_decision_s",
    "down_lost_steps",
    "down_stall_s",
    "up_s",
    "up_from_capacity_s",
    "up_lost_steps",
    "up_stall_s",
    "lost_steps",
    "steps_per_s_before",
    "steps_per_s_between",
    "steps_per_s_after",
)
GOALS = {"down_s_ratio": 0.2, "down_lost_steps": 0, "up_s_ratio": 0.5}
"""The issue's targets for the in-process path against checkpoint-restart (the table
compares the measured figures with them)."""


@dataclass(frozen=True)
class ElasticArgs(TrainArgs):
    """``bench/train.py``'s arguments, plus ``--elastic`` and a fixed global batch."""

    global_batch: int = 96  # divisible by every world size here (1, 2, 3, 4)

    def argv(self, out: Path, ckpt: str) -> list[str]:
        return [*super().argv(out, ckpt), "--elastic", "--global-batch", str(self.global_batch)]


@dataclass(frozen=True)
class ElasticPlan:
    """The scenario's job and injections (``Settings.elastic``)."""

    args: ElasticArgs = field(default_factory=lambda: ElasticArgs(steps=280, step_sleep=0.05))
    nodes: int = 3  # x 1 process; the last is preempted
    min_nodes: int = 2
    preempt_step: int = 40
    capacity_step: int = 90  # a step the job reaches at the smaller size
    # scalingTimeoutInSeconds: capacity must last this long before a scale-up. Both sides
    # bring the new node up meanwhile; 5 s covers its start here (~3.5 s: an agent and a
    # torch import on 2 busy cores). HyperPod's examples use 60 s.
    scaling_timeout: float = 5.0
    graceful_timeout: float = 15.0  # gracefulShutdownTimeoutInSeconds: time to save and exit
    timeout: float = 300.0  # one run, launch to the end

    def injections(self) -> list[str]:
        return [
            f"preempt:node={self.nodes - 1}@step={self.preempt_step}",
            f"capacity:+1@step={self.capacity_step}",
        ]

    def elastic_policy(self) -> dict[str, Any]:
        return {
            "minReplicas": self.min_nodes,
            "maxReplicas": self.nodes,
            "scalingTimeoutInSeconds": self.scaling_timeout,
            "gracefulShutdownTimeoutInSeconds": self.graceful_timeout,
        }


@dataclass(frozen=True)
class ElasticJob(TrainguardJob):
    """A :class:`TrainguardJob` on ``nodes`` nodes x 1 process."""

    nodes: int = 3

    def spec(self, args: TrainArgs, out: Path) -> dict[str, Any]:
        job = super().spec(args, out)
        job["spec"]["nprocPerNode"] = "1"
        job["spec"]["replicaSpecs"][0]["replicas"] = self.nodes
        return job


def in_process_job(plan: ElasticPlan) -> ElasticJob:
    """``--ckpt resilient`` with ``inProcessRestart``: scalings in place where they can be."""
    return ElasticJob(
        "bench-elastic-in-process",
        ckpt="resilient",
        spec_fields={
            "elasticPolicy": plan.elastic_policy(),
            "trainguard": {"inProcessRestart": True},
        },
        nodes=plan.nodes,
    )


def checkpoint_restart_job(plan: ElasticPlan) -> ElasticJob:
    """``--ckpt torch``: save on ``scale_requested()``, exit, restart at the new size."""
    return ElasticJob(
        "bench-elastic-restart",
        ckpt="torch",
        spec_fields={"elasticPolicy": plan.elastic_policy()},
        nodes=plan.nodes,
    )


# -- the runs -------------------------------------------------------------------


Variant = Callable[[ElasticPlan, Path], ElasticRecord]


def run_job(plan: ElasticPlan, workdir: Path, job: ElasticJob) -> ElasticRecord:
    """``trainguard run`` of ``job`` with the plan's injections, to its end."""
    run = TrainguardRun(workdir, plan.args, job)
    try:
        run.start(plan.injections())
        finished = run.wait(plan.timeout)
    finally:
        run.stop()
    described = run.describe()
    ok = finished and described["phase"] == "Succeeded"
    note = "" if ok else f"job {described['phase']}: {described.get('reason')}"
    if not finished:
        note = f"not done within {plan.timeout:g} s; {note}"
    worlds = read_worlds(run.out / "worlds.txt")
    record = elastic_figures(run.steps(), worlds, described["events"], ok, note)
    kinds = {"FaultInjected", "Fault", *DECISIONS, "ElasticScalingFailed", "AttemptStarted"}
    timeline = [
        {k: e.get(k) for k in ("time", "kind", "message")}
        for e in described["events"]
        if e["kind"] in kinds
    ]
    record.detail["events"] = timeline
    record.detail["launched_at"] = run.launched_at
    return record


def in_process(plan: ElasticPlan, workdir: Path) -> ElasticRecord:
    return run_job(plan, workdir, in_process_job(plan))


def checkpoint_restart(plan: ElasticPlan, workdir: Path) -> ElasticRecord:
    return run_job(plan, workdir, checkpoint_restart_job(plan))


ELASTIC_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard_in_process", in_process),
    ("baseline_checkpoint_restart", checkpoint_restart),
]


def scenario(
    plan: ElasticPlan, repeats: int, workdir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every variant ``repeats`` times, interleaved; the results as bench/layout.py says."""
    records: dict[str, list[ElasticRecord]] = {name: [] for name, _ in ELASTIC_VARIANTS}
    for rep in range(repeats):
        for name, variant in ELASTIC_VARIANTS:
            record = variant(plan, workdir / f"{name}-{rep}")
            log(f"elastic {rep + 1}/{repeats} {name}: {brief(record)}")
            records[name].append(record)
    result: dict[str, Any] = {
        "setup": {
            "nodes": plan.nodes,
            "nproc_per_node": 1,
            "min_nodes": plan.min_nodes,
            "preempt": f"node {plan.nodes - 1} at step {plan.preempt_step}",
            "capacity": f"+1 node at step {plan.capacity_step}",
            "scaling_timeout_s": plan.scaling_timeout,
            "graceful_shutdown_timeout_s": plan.graceful_timeout,
            "steps": plan.args.steps,
            "step_sleep_s": plan.args.step_sleep,
            "global_batch": plan.args.global_batch,
            "checkpoint_every_steps": plan.args.ckpt_every,
            "repeats": repeats,
        },
        "goals": dict(GOALS),
    }
    for name, recs in records.items():
        result[name] = side_figures(recs)
    result["ratio"] = paired_ratios(result)
    return result


def side_figures(records: Sequence[ElasticRecord]) -> dict[str, Any]:
    """One variant's summaries, how often each path was taken, and the runs."""
    figures: dict[str, Any] = {m: summary([getattr(r, m) for r in records]) for m in METRICS}
    figures["paths"] = {
        "down": _count([r.down_path for r in records]),
        "up": _count([r.up_path for r in records]),
    }
    figures["completed"] = sum(r.completed for r in records)
    figures["runs"] = [r.to_json() for r in records]
    return figures


def paired_ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Each trainguard variant / each baseline, medians over the repetitions where both
    have the figure."""
    ratios: dict[str, float | None] = {}
    for ours in sides(result, "trainguard"):
        for theirs in sides(result, "baseline"):
            pairs = list(zip(result[ours]["runs"], result[theirs]["runs"], strict=False))
            for m in METRICS:
                both = [(a[m], b[m]) for a, b in pairs if a[m] is not None and b[m] is not None]
                ratios[ratio_key(ours, m, theirs)] = ratio(
                    summary([a for a, _ in both]), summary([b for _, b in both])
                )
    return ratios


def _count(paths: Sequence[str | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        key = path or "unknown"
        counts[key] = counts.get(key, 0) + 1
    return counts


def brief(record: ElasticRecord) -> str:
    def s(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}s"

    text = (
        f"down {s(record.down_s)} ({record.down_path}, lost {record.down_lost_steps}), "
        f"up {s(record.up_s)} ({record.up_path}, lost {record.up_lost_steps}), "
        f"steps/s {_rates(record)}"
    )
    return text + (f"; {record.note}" if record.note else "")


def _rates(record: ElasticRecord) -> str:
    values = (record.steps_per_s_before, record.steps_per_s_between, record.steps_per_s_after)
    return " / ".join("—" if v is None else f"{v:.1f}" for v in values)
