"""The ``workloads`` scenario: recovery and checkpoints on workloads other than the small MLP.

The other scenarios train ``bench/train.py``'s small MLP (256 wide, about 80 K parameters):
the workload trainguard was tuned on. This one measures, for each workload of
:data:`WORKLOADS`, in one run:

- recovery from one SIGKILLed rank (2 nodes x 2 ranks, gloo), with the recovery
  scenario's variants and definitions (:mod:`bench.recovery`): trainguard
  checkpointless (in-process restart, a hot spare per node), trainguard's
  process-level restart from its memory tier, and torchrun relaunched, resuming from
  rank 0's ``torch.save``; repetitions interleave the variants, and the baseline is
  hit at the step trainguard's injector hit;
- the step time (median over the trainguard runs' steps) and the state size;
- checkpoint save blocking against a plain copy of the same bytes, and restore from the
  memory tier against the durable tier and ``torch.load`` (:mod:`bench.workloads_ckpt`,
  one process per workload, interleaved repetitions).

Workloads: ``gpt``, the GPT example's model (``examples/gpt``, 120 K parameters, 116
state tensors with AdamW) driven by ``bench/workloads_gpt.py``, and ``mlp_wide``,
``bench/train.py``'s MLP 5120 wide (26.6 M parameters; with SGD's momentum, 212 MB of
state per rank) at 4 samples per rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bench.recovery import (
    FAULTY_RANK,
    FaultRecord,
    FaultSetup,
    Variant,
    checkpointless_job,
    log_rules,
    relaunch_kill,
    trainguard_fault,
)
from bench.report import load_average, summary
from bench.runs import REPO, TrainArgs, TrainguardJob, TrainguardRun
from bench.steps import median_step_seconds, read_steps
from bench.workloads_rows import REFERENCE_KEY

if TYPE_CHECKING:
    from bench.suite import Context

GPT_SCRIPT = REPO / "bench" / "workloads_gpt.py"

REFERENCE = ("--workload", "mlp", "--hidden", "256")
"""bench.workloads_ckpt's arguments for the small MLP of the other scenarios."""

HANG_RULE_SECONDS = 30.0
"""The jobs' hang rule: a wide MLP's step, or a rank's exit, takes seconds on 2 busy cores
(the recovery scenario's 5 s rule restarted finished GPT jobs whose ranks were exiting)."""


def trainguard_kill(setup: FaultSetup) -> FaultRecord:
    """:func:`bench.recovery.trainguard_kill` with :data:`HANG_RULE_SECONDS`."""
    job = TrainguardJob("bench-workloads", retries=3, log_rules=log_rules(HANG_RULE_SECONDS))
    run = TrainguardRun(setup.workdir, setup.args, job)
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def checkpointless_kill(setup: FaultSetup) -> FaultRecord:
    """:func:`bench.recovery.checkpointless_kill` with :data:`HANG_RULE_SECONDS`."""
    job = replace(
        checkpointless_job("bench-workloads-checkpointless", 3),
        log_rules=log_rules(HANG_RULE_SECONDS),
    )
    run = TrainguardRun(setup.workdir, setup.args, job)
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", trainguard_kill),
    ("trainguard_checkpointless", checkpointless_kill),
    ("baseline_relaunch", relaunch_kill),
]


@dataclass(frozen=True)
class GPTArgs(TrainArgs):
    """``bench/workloads_gpt.py``'s arguments (``--hidden`` is ignored there)."""

    script: ClassVar[Path] = GPT_SCRIPT


@dataclass(frozen=True)
class WideArgs(TrainArgs):
    """``bench/train.py`` with ``--global-batch``: a wide MLP at a small batch."""

    global_batch: int = 16

    def argv(self, out: Path, ckpt: str) -> list[str]:
        return [*super().argv(out, ckpt), "--global-batch", str(self.global_batch)]


@dataclass(frozen=True)
class Workload:
    """One workload: its training arguments, the step its fault hits, how it is named."""

    name: str
    what: str
    args: TrainArgs
    fault_step: int
    ckpt_argv: tuple[str, ...]  # bench.workloads_ckpt's --workload (and --hidden)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "what": self.what, "args": asdict(self.args)} | {
            "script": str(self.args.script.relative_to(REPO)),
            "fault_step": self.fault_step,
        }


# The fault mid-way between two checkpoints (every 10 steps), as in the recovery scenario.
WORKLOADS = (
    Workload(
        "gpt",
        "the GPT example's model (2 layers, d_model 64), AdamW, 8 sequences of 64 tokens per rank",
        GPTArgs(steps=40, step_sleep=0.0, log_all_ranks=True),
        15,
        ("--workload", "gpt"),
    ),
    Workload(
        "mlp_wide",
        "bench/train.py's MLP 5120 wide, SGD with momentum, 4 samples per rank",
        WideArgs(steps=22, step_sleep=0.0, hidden=5120, log_all_ranks=True),
        15,
        ("--workload", "mlp", "--hidden", "5120"),
    ),
)


@dataclass(frozen=True)
class WorkloadPlan:
    """How much of each workload the scenario runs (``Settings.workloads``)."""

    repeats: int = 2
    ckpt_repeats: int = 3
    workloads: tuple[Workload, ...] = WORKLOADS

    def to_json(self) -> dict[str, Any]:
        return {
            "repeats": self.repeats,
            "ckpt_repeats": self.ckpt_repeats,
            "workloads": [w.to_json() for w in self.workloads],
        }


QUICK_PLAN = WorkloadPlan(repeats=1, ckpt_repeats=1)

FaultScenario = Callable[["Context", str, Sequence[tuple[str, Variant]], str], dict[str, Any]]


def scenario(ctx: Context, fault_scenario: FaultScenario) -> dict[str, Any]:
    """Every workload's recovery and checkpoint figures (``fault_scenario`` is
    :func:`bench.suite._fault_scenario`, passed in: suite imports this module)."""
    plan = ctx.settings.workloads
    setup = {"hang_rule_s": HANG_RULE_SECONDS, "load_before": load_average()}
    result: dict[str, Any] = {"setup": plan.to_json() | setup}
    for workload in plan.workloads:
        settings = replace(
            ctx.settings,
            repeats=plan.repeats,
            fault_args=workload.args,
            fault_step=workload.fault_step,
        )
        what = f"SIGKILL of rank 3 at step {workload.fault_step}"
        name = f"workloads-{workload.name}"
        recovery = fault_scenario(replace(ctx, settings=settings), name, VARIANTS, what)
        recovery["setup"]["workload"] = workload.name
        step_s = step_seconds(ctx.workdir / name, plan.repeats)
        ckpt = checkpoint(ctx, workload, plan.ckpt_repeats)
        ctx.log(f"workloads {workload.name}: step {step_s['median']}, checkpoint {_brief(ckpt)}")
        result[workload.name] = {
            "workload": workload.to_json(),
            "step_s": step_s,
            "recovery": recovery,
            "checkpoint": ckpt,
        }
    # The small MLP's checkpoint figures, measured the same way, for the comparison.
    small = Workload("mlp", "bench/train.py's MLP 256 wide", TrainArgs(steps=0), 0, REFERENCE)
    result[REFERENCE_KEY] = checkpoint(ctx, small, plan.ckpt_repeats)
    result["setup"]["load_after"] = load_average()
    return result


def step_seconds(directory: Path, repeats: int) -> dict[str, Any]:
    """Median step time of each trainguard process-level run (its steps, all incarnations)."""
    medians = [
        median_step_seconds(read_steps(directory / f"trainguard-{rep}" / "out" / "steps.txt"))
        for rep in range(repeats)
    ]
    return summary(medians)


def checkpoint(ctx: Context, workload: Workload, repeats: int) -> dict[str, Any]:
    """:mod:`bench.workloads_ckpt` in its own process; the error, when it failed."""
    out = ctx.workdir / f"workloads-ckpt-{workload.name}.json"
    argv = [*workload.ckpt_argv, "--repeats", str(repeats), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.workloads_ckpt", *argv],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"python -m bench.workloads_ckpt exited {done.returncode}: {tail[0]}"}
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _brief(ckpt: dict[str, Any]) -> str:
    if "error" in ckpt:
        return str(ckpt["error"])
    save, copy = ckpt["trainguard_save_s"]["median"], ckpt["baseline_memcpy_s"]["median"]
    return f"{ckpt['state_bytes'] / 1e6:.0f} MB, save {save:.3f} s vs copy {copy:.3f} s"
