"""The scenarios of ``make bench``: each runs trainguard and its baselines, side by side.

Every scenario function takes the :class:`Settings` and a work directory and returns
its part of ``results.json`` (laid out as :mod:`bench.layout` says): the trainguard
figures under ``trainguard`` (another configuration under ``trainguard_<name>``), each
baseline's under a key starting with ``baseline``, and ``ratio`` (trainguard / baseline,
medians). Repetitions interleave the variants, so slow spells on a shared machine hit
every side alike.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import agent_cost
from bench.clean import CLEAN_VARIANTS, LIKE_FOR_LIKE, CleanRecord
from bench.elastic import ElasticPlan
from bench.elastic import scenario as elastic_scenario
from bench.goodput import GOODPUT_VARIANTS, GoodputSetup
from bench.hosts import CUT_NODE, HOSTS_CUT_VARIANTS, HOSTS_KILL_VARIANTS
from bench.hosts import HANG_RULE_SECONDS as HOSTS_HANG_RULE_SECONDS
from bench.hosts import HOSTS as HOSTS_COUNT
from bench.hosts import unavailable as hosts_unavailable
from bench.layout import ratio_key, sides
from bench.recovery import (
    HANG_RULE_SECONDS,
    HANG_VARIANTS,
    RECOVERY_VARIANTS,
    FaultRecord,
    FaultSetup,
    Variant,
)
from bench.report import load_average, ratio, summary
from bench.runs import NNODES, NPROC_PER_NODE, REPO, TrainArgs
from bench.sharded import QUICK_PLAN as SHARDED_QUICK_PLAN
from bench.sharded import ShardedPlan
from bench.sharded import scenario as sharded_scenario
from bench.slurm import SLURM_DEFAULTS, SLURM_LOST_VARIANTS, SLURM_NODES, SLURM_SETTINGS
from bench.slurm import unavailable as slurm_unavailable
from bench.workloads import QUICK_PLAN, WorkloadPlan
from bench.workloads import scenario as workloads_scenario
from trainguard.spec.model import HOSTS_NODE_LOST_AFTER_SECONDS


@dataclass(frozen=True)
class Settings:
    """Step counts and repetitions: :data:`FULL` for ``make bench``, :data:`QUICK` to develop."""

    repeats: int = 3
    # trainguard's agents hit the named step; the baselines' injector (the benchmark) sees
    # steps late, as it reads the step file: steps of 0.1 s leave room for that.
    # Every rank prints its progress: the agent of the faulty rank's node sees the step.
    fault_args: TrainArgs = field(
        default_factory=lambda: TrainArgs(steps=60, step_sleep=0.1, log_all_ranks=True)
    )
    fault_step: int = 25  # mid-way between two checkpoints (every 10 steps)
    cap: float = 30.0  # how long a baseline that may never recover gets after the fault
    # Runs of torchrun after a hang: nothing can notice a stopped rank before gloo's
    # collective timeout, so every run waits out the cap; more runs only re-measure it.
    capped_baseline_repeats: int = 1
    clean_args: TrainArgs = field(default_factory=lambda: TrainArgs(steps=1000, step_sleep=0.0))
    goodput_args: TrainArgs = field(
        default_factory=lambda: TrainArgs(steps=1_000_000, step_sleep=0.05)
    )
    goodput_seconds: float = 180.0
    goodput_interval: float = 30.0
    checkpoint_sizes: tuple[int, ...] = (256, 1024)
    checkpoint_repeats: int = 3
    # Saves spaced like training steps (each save and each plain copy after this idle
    # time): the first faults its slot in, the later ones run at copy speed.
    checkpoint_spaced_size: int = 256
    checkpoint_spaced_saves: int = 8
    checkpoint_spacing: float = 0.5
    checkpoint_cuda_sizes: tuple[int, ...] = (1024, 4096)  # only with a CUDA device
    scale_nodes: tuple[int, ...] = (256, 1024, 4096, 16384)
    agent_repeats: int = 5
    # A node preempted, then capacity given back (bench/elastic.py); `repeats` times.
    elastic: ElasticPlan = field(default_factory=ElasticPlan)
    # The host cut off (bench/hosts.py): its capped baseline's cap. A node is lost after
    # 8 s, and a job restart on two busy cores can take a minute (torch imported again).
    hosts_cap: float = 120.0
    # The GPT example and a wide MLP (bench/workloads.py): their runs and repetitions.
    workloads: WorkloadPlan = field(default_factory=WorkloadPlan)
    # FSDP2 and HSDP (bench/sharded.py): their runs and repetitions.
    sharded: ShardedPlan = field(default_factory=ShardedPlan)
    run_timeout: float = 300.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


FULL = Settings()
QUICK = replace(
    FULL,
    repeats=1,
    clean_args=TrainArgs(steps=100, step_sleep=0.0),
    cap=30.0,
    goodput_seconds=50.0,
    goodput_interval=20.0,
    checkpoint_sizes=(64,),
    checkpoint_repeats=2,
    checkpoint_spaced_size=64,
    checkpoint_spaced_saves=3,
    checkpoint_spacing=0.1,
    checkpoint_cuda_sizes=(256,),
    scale_nodes=(16, 64),
    agent_repeats=3,
    workloads=QUICK_PLAN,
    sharded=SHARDED_QUICK_PLAN,
)


# The control plane's goals (the scale figures at GOAL_NODES nodes x 8 ranks, on the
# benchmark machine). The summary table compares the figures with them.
GOAL_NODES = 4096
SCALE_GOALS: dict[str, float] = {
    "start_s": 2.0,  # assign ranks + /start to every node
    "stop_s": 1.0,  # a worker's death -> the last node's /stop
    "poll_cycle_s": 1.0,  # one status poll of every node
    "controller_rss_peak_mb": 200.0,  # the controller process's peak resident memory
}
GROWTH_GOAL = 1.1
"""The scale figures may grow at most as N^1.1 from the smallest N to GOAL_NODES."""
AGENT_GOALS: dict[str, float] = {"start_s": 0.5, "rss_peak_mb": 100.0}
INJECTION_LAG_GOAL = 1
"""A step-triggered injection lands at most this many steps after the named one."""
DETECT_GOAL_S = 0.15
"""SIGKILL of a rank -> the controller's fault decision (the recovery scenario)."""


CAPPED_BASELINES = ("baseline_torchrun",)  # in the hang scenario


@dataclass
class Context:
    settings: Settings
    workdir: Path
    log: Callable[[str], None]
    clean: dict[str, list[CleanRecord]] = field(default_factory=dict)


def _fault_scenario(
    ctx: Context, name: str, variants: Sequence[tuple[str, Variant]], what: str
) -> dict[str, Any]:
    s = ctx.settings
    records: dict[str, list[FaultRecord]] = {v: [] for v, _ in variants}
    for rep in range(s.repeats):
        step = s.fault_step
        for variant, fn in variants:
            if variant in CAPPED_BASELINES and rep >= s.capped_baseline_repeats:
                continue
            setup = FaultSetup(
                ctx.workdir / name / f"{variant}-{rep}",
                s.fault_args,
                step,
                timeout=s.run_timeout,
                cap=s.cap,
            )
            record = fn(setup)
            ctx.log(f"{name} {rep + 1}/{s.repeats} {variant}: {_brief(record)}")
            records[variant].append(record)
            if variant == "trainguard" and record.step_at_fault is not None:
                # The baselines are hit at the step trainguard's injector actually hit.
                step = record.step_at_fault
    result: dict[str, Any] = {
        "setup": {
            "nodes": NNODES,
            "nproc_per_node": NPROC_PER_NODE,
            "fault": what,
            "checkpoint_every_steps": s.fault_args.ckpt_every,
            "step_sleep_s": s.fault_args.step_sleep,
            "repeats": s.repeats,
            "cap_s": s.cap,
            "capped_baseline_repeats": s.capped_baseline_repeats,
            "capped_baselines": [v for v, _ in variants if v in CAPPED_BASELINES],
        }
    }
    metrics = ("stall_s", "lost_steps", "detect_s")
    for variant, recs in records.items():
        result[variant] = {m: summary([getattr(r, m) for r in recs]) for m in metrics}
        if variant.startswith("trainguard"):  # where the step injection landed
            lags = [r.injection_lag_steps for r in recs]
            result[variant]["injection_lag_steps"] = summary(lags)
        result[variant]["recovered"] = sum(r.recovered for r in recs)
        parts = [r.breakdown for r in recs if r.breakdown]
        if parts:  # where an in-process recovery's stall went (bench/stall_breakdown.py)
            result[variant]["breakdown"] = {p: summary([b[p] for b in parts]) for p in parts[0]}
        result[variant]["runs"] = [r.to_json() for r in recs]
    result["ratio"] = paired_ratios(result, metrics)
    return result


def paired_ratios(result: dict[str, Any], metrics: Sequence[str]) -> dict[str, float | None]:
    """Each trainguard variant / each baseline, medians over the repetitions where both
    have the figure.

    Repetition i of every variant was faulted at the same step, so a baseline that
    recovered only sometimes is compared with trainguard in those repetitions only.
    """
    ratios: dict[str, float | None] = {}
    for variant in sides(result, "trainguard"):
        ours = result[variant]["runs"]
        for name in sides(result, "baseline"):
            theirs = result[name]["runs"]
            for m in metrics:
                pairs = [
                    (a[m], b[m])
                    for a, b in zip(ours, theirs, strict=False)
                    if a[m] is not None and b[m] is not None
                ]
                ratios[ratio_key(variant, m, name)] = ratio(
                    summary([a for a, _ in pairs]), summary([b for _, b in pairs])
                )
    return ratios


def recovery(ctx: Context) -> dict[str, Any]:
    what = f"SIGKILL of rank 3 at step {ctx.settings.fault_step}"
    result = _fault_scenario(ctx, "recovery", RECOVERY_VARIANTS, what)
    result["goals"] = {"detect_s": DETECT_GOAL_S, "injection_lag_steps": INJECTION_LAG_GOAL}
    return result


def hang(ctx: Context) -> dict[str, Any]:
    s = ctx.settings
    what = f"SIGSTOP of rank 3 at step {s.fault_step}"
    result = _fault_scenario(ctx, "hang", HANG_VARIANTS, what)
    result["setup"] |= {
        "hang_rule_s": HANG_RULE_SECONDS,
    }
    capped_bounds(result, s.cap, ("detect_s", "stall_s"))
    return result


def capped_bounds(result: dict[str, Any], cap: float, metrics: Sequence[str]) -> None:
    """Where the capped baseline got nowhere within the cap and trainguard always did,
    trainguard's median / the cap: an upper bound on the ratio (``..._at_most``)."""
    for key in metrics:
        ours, theirs = result["trainguard"][key], result["baseline_torchrun"][key]
        if ours["max"] is not None and ours["max"] < cap and theirs["n"] == 0:
            result["ratio"][f"{key}_vs_baseline_torchrun_at_most"] = ours["median"] / cap


def hosts(ctx: Context) -> dict[str, Any]:
    """One job on three namespace hosts (:mod:`bench.hosts`): a rank SIGKILLed on another
    host, and a host cut off. Skipped, with the reason, where namespace hosts cannot be
    made (not root, no ``ip``, no network namespaces)."""
    why = hosts_unavailable()
    if why is not None:
        ctx.log(f"hosts: skipped: {why}")
        return {"skipped": why}
    s = ctx.settings
    load_before = load_average()
    kill = _fault_scenario(
        ctx, "hosts-kill", HOSTS_KILL_VARIANTS, f"SIGKILL of rank 3 (host 1) at step {s.fault_step}"
    )
    what = f"host 1 cut off at step {s.fault_step} (on one host: node-kill of node {CUT_NODE})"
    capped = replace(ctx, settings=replace(s, cap=s.hosts_cap))
    cut = _fault_scenario(capped, "hosts-cut", HOSTS_CUT_VARIANTS, what)
    capped_bounds(cut, s.hosts_cap, ("detect_s", "stall_s"))
    setup = {
        "hosts": HOSTS_COUNT,
        "spares": 1,
        "node_lost_after_s": HOSTS_NODE_LOST_AFTER_SECONDS,  # the default across hosts
        "hang_rule_s": HOSTS_HANG_RULE_SECONDS,
        "load_before": load_before,
        "load_after": load_average(),
    }
    return {"setup": setup, "kill": kill, "cut": cut}


def slurm(ctx: Context) -> dict[str, Any]:
    """A node lost under a real Slurm (:mod:`bench.slurm`): trainguard in the allocation
    against Slurm's own requeue of the same job. Skipped, with the reason, where the
    cluster cannot be made (not root, no network namespaces, no Slurm packages)."""
    why = slurm_unavailable()
    if why is not None:
        ctx.log(f"slurm: skipped: {why}")
        return {"skipped": why}
    s = ctx.settings
    load_before = load_average()
    what = f"the host of the job's second node cut off at step {s.fault_step}"
    lost = _fault_scenario(ctx, "slurm-lost", SLURM_LOST_VARIANTS, what)
    setup = {
        "slurm_nodes": SLURM_NODES,
        "spares": 1,
        "node_lost_after_s": HOSTS_NODE_LOST_AFTER_SECONDS,
        "slurm_settings": SLURM_SETTINGS,
        "slurm_defaults_not_used": SLURM_DEFAULTS,
        "load_before": load_before,
        "load_after": load_average(),
    }
    return {"setup": setup, "lost": lost}


def workloads(ctx: Context) -> dict[str, Any]:
    """Recovery and checkpoints on the GPT example and a wide MLP (:mod:`bench.workloads`)."""
    return workloads_scenario(ctx, _fault_scenario)


def sharded(ctx: Context) -> dict[str, Any]:
    """Recovery and save blocking of FSDP2 and HSDP state (:mod:`bench.sharded`)."""
    return sharded_scenario(ctx, _fault_scenario)


def group_start(ctx: Context) -> dict[str, Any]:
    """Group (re)formation at 4-32 light ranks through the job's store service against a
    TCPStore on rank 0 (:mod:`bench.group_start`), interleaved round by round."""
    from bench.group_start import QUICK_ROUNDS, ROUNDS, WORLDS, measure

    rounds = ROUNDS if ctx.settings.repeats > 1 else QUICK_ROUNDS
    load_before = load_average()
    result = measure(WORLDS, rounds, ctx.workdir / "group_start", ctx.log)
    result["setup"].update(load_before=load_before, load_after=load_average())
    return result


def data_cache(ctx: Context) -> dict[str, Any]:
    """trainguard.data's cache against a plain DataLoader (:mod:`bench.data_cache`): a
    restart's first batch and steady steps/s, the sides interleaved."""
    from bench.data_cache import QUICK_REPEATS, REPEATS, measure

    repeats = REPEATS if ctx.settings.repeats > 1 else QUICK_REPEATS
    return measure(repeats, ctx.workdir / "data_cache", ctx.log)


def state_scale(ctx: Context) -> dict[str, Any]:
    """Checkpointless recovery at 0.04-4 GB of state a rank against the link's speed and a
    relaunch from /dev/shm snapshots (:mod:`bench.state_scale`)."""
    from bench.state_scale import measure

    load_before = load_average()
    result = measure(ctx.settings.repeats <= 1, ctx.workdir / "state_scale", ctx.log)
    result.update(load_before=load_before, load_after=load_average())
    return result


def _clean_runs(ctx: Context) -> dict[str, list[CleanRecord]]:
    if not ctx.clean:
        s = ctx.settings
        ctx.clean = {name: [] for name, _ in CLEAN_VARIANTS}
        for rep in range(s.repeats):
            for name, fn in CLEAN_VARIANTS:
                record = fn(ctx.workdir / "clean" / f"{name}-{rep}", s.clean_args, s.run_timeout)
                ctx.log(f"clean run {rep + 1}/{s.repeats} {name}: {record}")
                ctx.clean[name].append(record)
    return ctx.clean


def _clean_scenario(
    ctx: Context, metrics: Sequence[str], pairs: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    runs = _clean_runs(ctx)
    result: dict[str, Any] = {
        "setup": {
            "nodes": NNODES,
            "nproc_per_node": NPROC_PER_NODE,
            "steps": ctx.settings.clean_args.steps,
            "checkpoint_every_steps": ctx.settings.clean_args.ckpt_every,
            "repeats": ctx.settings.repeats,
        }
    }
    names = {name for pair in pairs for name in pair}
    for name, recs in runs.items():
        if name not in names:
            continue
        result[name] = {m: summary([getattr(r, m) for r in recs]) for m in metrics}
        result[name]["completed"] = sum(r.completed for r in recs)
    result["ratio"] = {
        ratio_key(ours, m, theirs): ratio(result[ours][m], result[theirs][m])
        for ours, theirs in pairs
        for m in metrics
    }
    return result


def overhead(ctx: Context) -> dict[str, Any]:
    """Throughput and the launcher's own CPU, like for like (see :mod:`bench.clean`);
    trainguard's worker template's memory per node beside them (no baseline has one)."""
    result = _clean_scenario(ctx, ("steps_per_s", "launcher_cpu_s_per_min"), LIKE_FOR_LIKE)
    for name, recs in _clean_runs(ctx).items():
        if name in result and any(r.template_rss_mib is not None for r in recs):
            for m in ("template_rss_mib", "template_pss_mib", "template_uss_mib"):
                result[name][m] = summary([getattr(r, m) for r in recs])
    return result


def startup(ctx: Context) -> dict[str, Any]:
    return _clean_scenario(ctx, ("first_step_s",), LIKE_FOR_LIKE[:1])


def goodput(ctx: Context) -> dict[str, Any]:
    s = ctx.settings
    result: dict[str, Any] = {
        "setup": {
            "nodes": NNODES,
            "nproc_per_node": NPROC_PER_NODE,
            "duration_s": s.goodput_seconds,
            "kill_every_s": s.goodput_interval,
            "checkpoint_every_steps": s.goodput_args.ckpt_every,
        }
    }
    for name, fn in GOODPUT_VARIANTS:
        setup = GoodputSetup(
            ctx.workdir / "goodput" / name, s.goodput_args, s.goodput_seconds, s.goodput_interval
        )
        record = fn(setup)
        ctx.log(f"goodput {name}: {record.goodput:.3f} with {record.faults} kills")
        result[name] = {"goodput": summary([record.goodput]), "runs": [record.to_json()]}
    result["ratio"] = _ratios(result, ("goodput",))
    return result


def checkpoint(ctx: Context) -> dict[str, Any]:
    """``bench/checkpoint.py`` in its own process (gigabytes of state, a gloo group); its
    CUDA figures only where there is a CUDA device."""
    s = ctx.settings
    out = ctx.workdir / "checkpoint.json"
    argv = [
        "--sizes",
        ",".join(str(n) for n in s.checkpoint_sizes),
        "--repeats",
        str(s.checkpoint_repeats),
        "--spaced-size",
        str(s.checkpoint_spaced_size),
        "--spaced-saves",
        str(s.checkpoint_spaced_saves),
        "--spacing",
        str(s.checkpoint_spacing),
        "--cuda-sizes",
        ",".join(str(n) for n in s.checkpoint_cuda_sizes),
        "--out",
        str(out),
    ]
    _python_module("bench.checkpoint", argv)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def scale(ctx: Context) -> dict[str, Any]:
    """``bench/scale.py`` once per N, each in a fresh process (its memory is measured).

    A size that fails (the largest may outgrow the machine) is reported as failed; the
    others still make the results."""
    figures: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for n in ctx.settings.scale_nodes:
        out = ctx.workdir / "scale" / f"{n}.json"
        workdir = ctx.workdir / "scale" / str(n)
        try:
            _python_module(
                "bench.scale", ["--nodes", str(n), "--workdir", str(workdir), "--out", str(out)]
            )
        except RuntimeError as exc:
            failed[str(n)] = str(exc)
            ctx.log(f"scale {n}: failed: {exc}")
            continue
        figures[str(n)] = json.loads(out.read_text())
        ctx.log(f"scale {n}: {figures[str(n)]}")
    if not figures:
        raise RuntimeError(f"every scale size failed: {failed}")
    result = scale_results(figures)
    if failed:
        result["failed"] = failed
    return result


SCALED = ("start_s", "stop_s", "stop_broadcast_s", "poll_cycle_s", "controller_rss_mib")


def growth_exponents(
    figures: dict[str, dict[str, Any]], small: str, big: str
) -> dict[str, float | None]:
    """``log(f(big) / f(small)) / log(big / small)`` of each scaled figure (1: linear)."""
    growth: dict[str, float | None] = {}
    for k in SCALED:
        a, b = figures[small].get(k), figures[big].get(k)
        if a and b and a > 0 and b > 0 and big != small:
            growth[k] = math.log(b / a) / math.log(int(big) / int(small))
        else:
            growth[k] = None
    return growth


def scale_results(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures per N, linear growth from the smallest N as the baseline, the ratios,
    the growth exponents (to the largest N, and to :data:`GOAL_NODES`), the goals."""
    sizes = sorted(figures, key=int)
    small, big = sizes[0], sizes[-1]
    linear = {
        n: {k: figures[small][k] * int(n) / int(small) for k in SCALED if figures[small].get(k)}
        for n in sizes
    }
    ratios = {
        n: {k: figures[n][k] / linear[n][k] for k in linear[n] if figures[n].get(k) is not None}
        for n in sizes
    }
    result: dict[str, Any] = {
        "setup": {"nproc_per_node": 8, "nodes": [int(n) for n in sizes]},
        "trainguard": figures,
        f"baseline_linear_from_{small}": linear,
        "ratio": ratios,
        "growth_exponent": growth_exponents(figures, small, big),
        "goals": {
            "nodes": GOAL_NODES,
            **SCALE_GOALS,
            "growth_from": int(small),
            "growth_exponent": GROWTH_GOAL,
        },
    }
    goal = str(GOAL_NODES)
    if goal in figures and goal not in (small, big):
        result["growth_exponent_to_goal"] = growth_exponents(figures, small, goal)
    return result


def agent(ctx: Context) -> dict[str, Any]:
    """``bench/agent_cost.py``: the real node agent's start and memory, and ``import
    torch``'s (what an agent importing torch pays at least), interleaved."""
    s = ctx.settings
    runs = agent_cost.measure(ctx.workdir / "agent", s.agent_repeats)
    result: dict[str, Any] = {
        "setup": {
            "repeats": s.agent_repeats,
            "agent": "python -m trainguard.agent ... -- true (spawn -> port file)",
            "baseline": "python -c 'import torch'",
        },
        "goals": AGENT_GOALS,
    }
    for name, costs in runs.items():
        result[name] = agent_figures(costs)
        ctx.log(f"agent {name}: {[c.to_json() for c in costs]}")
    result["ratio"] = _ratios(result, agent_cost.METRICS)
    return result


def elastic(ctx: Context) -> dict[str, Any]:
    """In-process scalings against checkpoint-restart (:mod:`bench.elastic`), interleaved."""
    s = ctx.settings
    return elastic_scenario(s.elastic, s.repeats, ctx.workdir / "elastic", ctx.log)


def agent_figures(costs: Sequence[agent_cost.Cost]) -> dict[str, Any]:
    """Summaries of one side's repetitions, and the runs."""
    figures: dict[str, Any] = {
        m: summary([getattr(c, m) for c in costs]) for m in (*agent_cost.METRICS, "rss_mib")
    }
    figures["runs"] = [c.to_json() for c in costs]
    return figures


def peers(ctx: Context) -> dict[str, Any]:
    """trainguard against torchft, NVRx and SageMaker's and DLRover's checkpointing, the
    peers installed in their own environment (:mod:`bench.peers`), interleaved."""
    from bench.peers.runner import scenario as peers_scenario

    s = ctx.settings
    return peers_scenario(s, s.repeats, ctx.workdir, ctx.log)


SCENARIOS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "recovery": recovery,
    "hang": hang,
    "checkpoint": checkpoint,
    "goodput": goodput,
    "overhead": overhead,
    "scale": scale,
    "startup": startup,
    "agent": agent,
    "elastic": elastic,
    "hosts": hosts,
    "slurm": slurm,
    "workloads": workloads,
    "sharded": sharded,
    "peers": peers,
    "group_start": group_start,
    "data_cache": data_cache,
    "state_scale": state_scale,
}


def _ratios(result: dict[str, Any], metrics: Sequence[str]) -> dict[str, float | None]:
    return {
        ratio_key(variant, m, name): ratio(result[variant][m], result[name][m])
        for variant in sides(result, "trainguard")
        for name in sides(result, "baseline")
        for m in metrics
    }


def _python_module(module: str, argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(argv)} exited {done.returncode}")


def _brief(record: FaultRecord) -> str:
    if not record.recovered:
        return f"not recovered: {record.note}"
    return f"stall {record.stall_s:.1f}s, lost {record.lost_steps}, detect {record.detect_s}"
