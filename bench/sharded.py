"""The ``sharded`` scenario: recovery and save blocking of a sharded model (FSDP2 and HSDP).

The model is :mod:`bench.sharded_train`'s small transformer (``hidden`` wide, 4 blocks,
Adam), on 2 nodes x 2 ranks, gloo, in two layouts: ``hsdp`` (a 2 x 2 mesh, replicate x
shard: each rank holds half the state, and its replica peer the same half) and ``fsdp``
(a 1 x 4 mesh: each rank a quarter, held by no other rank). For each layout, in one run:

- recovery from one SIGKILLed rank (rank 3, at ``fault_step``), with the recovery
  scenario's definitions (:mod:`bench.recovery`: ``stall_s`` fault -> next completed
  step, ``lost_steps`` the completed steps redone) and ``lost_s`` = stall + steps redone x
  the layout's median step time. Variants: ``trainguard_checkpointless`` (the script on
  ``trainguard.resilient``, in-process restarts, one hot spare: HSDP's replacement takes
  its shards from its replica peer, FSDP's every rank rolls back to the memory tier),
  ``trainguard`` (a process-level restart from the memory tier, every step saved, every
  ``ckpt_every``-th kept) and ``baseline_relaunch`` (plain torchrun, DCP saved every
  ``ckpt_every`` steps to local disk, the job relaunched when torchrun exits; it resumes
  from DCP). Repetitions interleave the variants; the baseline is hit at the step
  trainguard's injector hit.
- save blocking of the same sharded state (:mod:`bench.sharded_ckpt`, 4 ranks under
  ``torchrun --standalone``): ``Checkpointer.save`` against DCP's ``async_save``.

Targets (ratios of medians): HSDP checkpointless ``lost_s`` <= 0.2x the relaunch's,
FSDP checkpointless (from the memory tier) <= 0.5x, sharded save() blocking <= 0.5x
DCP's ``async_save``. Every row names the state size per rank.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bench.recovery import (
    FAULTY_RANK,
    FaultRecord,
    FaultSetup,
    Variant,
    kill_under,
    log_rules,
    relaunch_kill,
)
from bench.report import load_average, ratio, summary
from bench.runs import REPO, TrainArgs, TrainguardJob
from bench.steps import read_steps
from bench.workloads import HANG_RULE_SECONDS, FaultScenario

if TYPE_CHECKING:
    from bench.suite import Context

SCRIPT = REPO / "bench" / "sharded_train.py"
LAYOUTS = ("hsdp", "fsdp")
SPARES = 1
RUN_TIMEOUT = 600.0  # a whole faulted run: 4 ranks importing torch twice on busy cores
TARGETS: dict[str, float] = {
    "hsdp_checkpointless_lost_s_vs_relaunch": 0.2,
    "fsdp_checkpointless_lost_s_vs_relaunch": 0.5,
    "save_vs_dcp_async_save": 0.5,
}
RATIO = "trainguard_checkpointless_lost_s_vs_baseline_relaunch"
"""Where each layout's recovery result keeps the ratio its target judges."""


@dataclass(frozen=True)
class ShardedArgs(TrainArgs):
    """:mod:`bench.sharded_train`'s arguments: bench/train.py's and ``--layout``."""

    script: ClassVar[Path] = SCRIPT
    layout: str = "fsdp"

    def argv(self, out: Path, ckpt: str) -> list[str]:
        return [*super().argv(out, ckpt), "--layout", self.layout]


@dataclass(frozen=True)
class ShardedPlan:
    """How much the scenario runs (``Settings.sharded``)."""

    repeats: int = 2
    ckpt_repeats: int = 7
    steps: int = 30
    fault_step: int = 15  # mid-way between two checkpoints
    ckpt_every: int = 10
    hidden: int = 256

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def args(self, layout: str) -> ShardedArgs:
        return ShardedArgs(
            steps=self.steps,
            step_sleep=0.0,
            hidden=self.hidden,
            ckpt_every=self.ckpt_every,
            log_all_ranks=True,
            layout=layout,
        )


QUICK_PLAN = ShardedPlan(repeats=1, ckpt_repeats=3, steps=20)


def _job(name: str, plan_every: int, **fields: Any) -> TrainguardJob:
    return TrainguardJob(
        name,
        retries=3,
        log_rules=log_rules(HANG_RULE_SECONDS),
        memory_every_steps=plan_every,
        **fields,
    )


def trainguard_kill(setup: FaultSetup) -> FaultRecord:
    """A process-level restart from the memory tier (no in-process restarts)."""
    return kill_under(_job("bench-sharded", setup.args.ckpt_every), setup)


def checkpointless_kill(setup: FaultSetup) -> FaultRecord:
    """``trainguard.resilient`` with in-process restarts and one hot spare."""
    job = _job(
        "bench-sharded-checkpointless",
        setup.args.ckpt_every,
        ckpt="resilient",
        spec_fields={"trainguard": {"inProcessRestart": True, "hotSpares": SPARES}},
    )
    return kill_under(job, setup)


# bench.workloads' three sides, with this scenario's jobs and script.
VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", trainguard_kill),
    ("trainguard_checkpointless", checkpointless_kill),
    ("baseline_relaunch", relaunch_kill),
]


def scenario(ctx: Context, fault_scenario: FaultScenario) -> dict[str, Any]:
    """Both layouts' recovery and save figures (``fault_scenario`` is
    :func:`bench.suite._fault_scenario`, passed in: suite imports this module)."""
    plan: ShardedPlan = ctx.settings.sharded
    setup = {
        "nodes": 2,
        "nproc_per_node": 2,
        "hot_spares": SPARES,
        "model": f"transformer, {plan.hidden} wide, 4 blocks, Adam",
        "hang_rule_s": HANG_RULE_SECONDS,
        "load_before": load_average(),
    }
    result: dict[str, Any] = {"setup": plan.to_json() | setup, "targets": TARGETS}
    for layout in LAYOUTS:
        settings = replace(
            ctx.settings,
            repeats=plan.repeats,
            fault_args=plan.args(layout),
            fault_step=plan.fault_step,
            run_timeout=max(ctx.settings.run_timeout, RUN_TIMEOUT),
        )
        what = f"SIGKILL of rank {FAULTY_RANK} at step {plan.fault_step}"
        name = f"sharded-{layout}"
        recovery = fault_scenario(replace(ctx, settings=settings), name, VARIANTS, what)
        step_s = add_lost_seconds(recovery, ctx.workdir / name)
        ckpt = checkpoint(ctx.workdir, layout, plan)
        ctx.log(f"sharded {layout}: step {step_s}, {brief(recovery, ckpt)}")
        result[layout] = {
            "recovery": recovery,
            "step_s": step_s,
            "state_bytes_per_rank": state_bytes(ctx.workdir / name),
            "checkpoint": ckpt,
        }
    result["setup"]["load_after"] = load_average()
    return result


def add_lost_seconds(recovery: dict[str, Any], directory: Path) -> float | None:
    """Each run's ``lost_s`` (stall + steps redone x the median step of every run of the
    layout, all sides: the same script and model), its summaries and paired ratios."""
    from bench.suite import paired_ratios  # suite imports this module

    durations = [
        r.end - r.start
        for path in sorted(directory.glob("*/out/steps.txt"))
        for r in read_steps(path)
    ]
    step_s = statistics.median(durations) if durations else None
    for variant in [k for k in recovery if k.startswith(("trainguard", "baseline"))]:
        for run in recovery[variant]["runs"]:
            stall, lost = run.get("stall_s"), run.get("lost_steps")
            known = None not in (stall, lost, step_s)
            run["lost_s"] = stall + lost * step_s if known else None
        recovery[variant]["lost_s"] = summary([r["lost_s"] for r in recovery[variant]["runs"]])
    recovery["ratio"] |= paired_ratios(recovery, ("lost_s",))
    return step_s


def state_bytes(directory: Path) -> int | None:
    """Rank 0's state bytes, as the training script wrote them after its first step."""
    for path in sorted(directory.glob("*/out/state.json")):
        try:
            return int(json.loads(path.read_text())["state_bytes_per_rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def checkpoint(workdir: Path, layout: str, plan: ShardedPlan) -> dict[str, Any]:
    """:mod:`bench.sharded_ckpt` under ``torchrun --standalone`` (4 ranks); the medians and
    their ratio, or the error."""
    out = workdir / f"sharded-ckpt-{layout}.json"
    argv = [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        str(REPO / "bench" / "sharded_ckpt.py"),
        *("--layout", layout, "--hidden", str(plan.hidden)),
        *("--repeats", str(plan.ckpt_repeats), "--out", str(out)),
    ]
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    if done.returncode != 0 or not out.exists():
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"bench/sharded_ckpt.py exited {done.returncode}: {tail[0]}"}
    return checkpoint_figures(json.loads(out.read_text()))


def checkpoint_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """Summaries of bench/sharded_ckpt.py's times, and the ratio of their medians."""
    ours = summary(raw["trainguard_save_s"])
    theirs = summary(raw["baseline_dcp_async_save_s"])
    return {
        "state_bytes_per_rank": raw["state_bytes_per_rank"],
        "trainguard_save_s": ours,
        "baseline_dcp_async_save_s": theirs,
        "ratio": {"save_vs_dcp_async_save": ratio(ours, theirs)},
        "raw": raw,
    }


def brief(recovery: dict[str, Any], ckpt: dict[str, Any]) -> str:
    lost = {k: recovery[k]["lost_s"]["median"] for k in recovery if "lost_s" in recovery[k]}
    if "error" in ckpt:
        return f"lost {lost}; checkpoint: {ckpt['error']}"
    return f"lost {lost}; save ratio {ckpt['ratio']['save_vs_dcp_async_save']}"
