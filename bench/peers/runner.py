"""The ``peers`` scenario: trainguard against the systems users would pick instead.

One fault (``Settings.fault_args``, rank 3 SIGKILLed at ``Settings.fault_step``, as in the
``recovery`` scenario), every side once per repetition, interleaved: trainguard
checkpointless (in-process restart, a hot spare), trainguard's process-level restart, a
full torchrun relaunch (``bench.recovery``'s variants, unchanged), then each recovering
peer the peers' environment has (:mod:`bench.peers.env`). Then save blocking and
restore against the checkpointing peers (:mod:`bench.peers.checkpoints`).

Every side's stall and steps redone come from ``bench.recovery.from_steps`` over its rank
0's step records, so the columns mean the same for all. ``world_after``: the world size
of the step that ended the stall (trainguard's jobs and the relaunch always come back at
full size, by construction: no elastic job here). ``ratio``: each trainguard side over
each peer and the relaunch, medians over the repetitions where both recovered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.layout import ratio_key
from bench.peers import checkpoints, nvrx_peer, torchft_peer
from bench.peers.env import PeerEnv, prepare
from bench.recovery import (
    FaultRecord,
    FaultSetup,
    checkpointless_kill,
    relaunch_kill,
    trainguard_kill,
)
from bench.report import load_average, ratio, summary
from bench.runs import NNODES, NPROC_PER_NODE

WORLD = NNODES * NPROC_PER_NODE
CKPT_MIB = 64
CKPT_SAVES = 3  # saves (and restores) per process and repetition

Side = Callable[[PeerEnv, FaultSetup], FaultRecord]


def _full_world(fn: Callable[[FaultSetup], FaultRecord]) -> Side:
    def side(_env: PeerEnv, setup: FaultSetup) -> FaultRecord:
        record = fn(setup)
        full = {"world_after": WORLD, "world_restored_s": 0.0} if record.recovered else {}
        return replace(record, detail={**record.detail, **full})

    return side


@dataclass(frozen=True)
class PeerSide:
    name: str  # results key
    peer: str | None  # the peer it needs in the peers' environment (None: trainguard's)
    run: Side
    settings: str  # what the docs and the table say about how it ran


SIDES = [
    PeerSide(
        "trainguard_checkpointless",
        None,
        _full_world(checkpointless_kill),
        "2 nodes x 2 ranks, --ckpt resilient, inProcessRestart, 1 hot spare per node",
    ),
    PeerSide(
        "trainguard",
        None,
        _full_world(trainguard_kill),
        "2 nodes x 2 ranks, process-level restart from the memory tier (every 10 steps)",
    ),
    PeerSide(
        "peer_torchft",
        "torchft",
        lambda env, s: torchft_peer.run(env, s, torchft_peer.TUNED),
        f"4 replica groups x 1 gloo rank, lighthouse {' '.join(torchft_peer.TUNED.argv())}, "
        f"Manager timeout {torchft_peer.COLLECTIVE_TIMEOUT_S:g} s, dead group restarted "
        "by the benchmark as soon as it exits",
    ),
    PeerSide(
        "peer_nvrx",
        "nvrx",
        nvrx_peer.run,
        f"inprocess.Wrapper, {nvrx_peer.ACTIVE} active + {nvrx_peer.SPARES} spare, "
        f"gloo timeout {nvrx_peer.GLOO_TIMEOUT_S:g} s, heartbeat timeout 5 s",
    ),
    PeerSide(
        "baseline_relaunch",
        None,
        _full_world(relaunch_kill),
        "torchrun, relaunched when it exits, resumes from torch.save every 10 steps",
    ),
]
METRICS = ("stall_s", "lost_steps", "world_after", "world_restored_s")


def scenario(
    settings: Any, repeats: int, workdir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    load_before = load_average()
    env = prepare()
    log(f"peers: environment {env.to_json()}")
    sides = [s for s in SIDES if s.peer is None or env.has(s.peer)]
    records: dict[str, list[FaultRecord]] = {s.name: [] for s in sides}
    for rep in range(repeats):
        for side in sides:
            setup = FaultSetup(
                workdir / "peers" / f"{side.name}-{rep}",
                settings.fault_args,
                settings.fault_step,
                timeout=settings.run_timeout,
                cap=settings.cap,
            )
            record = side.run(env, setup)
            log(f"peers {rep + 1}/{repeats} {side.name}: {record.to_json()}")
            records[side.name].append(record)
    result: dict[str, Any] = {side.name: side_figures(side, records[side.name]) for side in sides}
    result["ratio"] = peer_ratios(result)
    ckpt = checkpoints.measure(
        env, workdir / "peers-checkpoint", CKPT_MIB, repeats, CKPT_SAVES, log
    )
    result["checkpoint"] = ckpt
    result["ratio"] |= checkpoint_ratios(ckpt)
    result["skipped"] = {
        **{s.name: env.skipped[s.peer] for s in SIDES if s.peer and s.peer in env.skipped},
        **{
            f"checkpoint_{peer}": figures["skipped"]
            for peer, figures in ckpt.items()
            if "skipped" in figures
        },
    }
    result["setup"] = {
        "world": WORLD,
        "fault": f"SIGKILL of rank 3 at step {settings.fault_step}",
        "steps": settings.fault_args.steps,
        "step_sleep_s": settings.fault_args.step_sleep,
        "repeats": repeats,
        "checkpoint_mib": CKPT_MIB,
        "checkpoint_saves": CKPT_SAVES,
        "environment": env.to_json(),
        "load_before": load_before,
        "load_after": load_average(),
    }
    return result


def side_figures(side: PeerSide, recs: list[FaultRecord]) -> dict[str, Any]:
    """One side's summaries (median, min, max over its repetitions) and its runs."""
    figures: dict[str, Any] = {m: summary([_figure(r, m) for r in recs]) for m in METRICS}
    figures["recovered"] = sum(r.recovered for r in recs)
    figures["settings"] = side.settings
    figures["runs"] = [r.to_json() for r in recs]
    return figures


def _figure(record: FaultRecord, metric: str) -> float | None:
    if metric in ("world_after", "world_restored_s"):
        value = record.detail.get(metric)
        return None if value is None else float(value)
    value = getattr(record, metric)
    return None if value is None else float(value)


def peer_ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Each trainguard side / each other side, over the repetitions both recovered in."""
    ours = [k for k in result if k.startswith("trainguard")]
    theirs = [k for k in result if k.startswith(("peer_", "baseline"))]
    ratios: dict[str, float | None] = {}
    for a in ours:
        for b in theirs:
            for m in ("stall_s", "lost_steps"):
                pairs = [
                    (x[m], y[m])
                    for x, y in zip(result[a]["runs"], result[b]["runs"], strict=False)
                    if x[m] is not None and y[m] is not None
                ]
                ratios[ratio_key(a, m, b)] = ratio(
                    summary([x for x, _ in pairs]), summary([y for _, y in pairs])
                )
    return ratios


def checkpoint_ratios(ckpt: dict[str, Any]) -> dict[str, float | None]:
    ours = ckpt.get("trainguard_memory") or {}
    out: dict[str, float | None] = {}
    for peer, figures in ckpt.items():
        if peer == "trainguard_memory" or "skipped" in figures:
            continue
        for m in ("save_s", "restore_s"):
            out[f"trainguard_memory_{m}_vs_peer_{peer}"] = ratio(
                ours.get(m) or {}, figures.get(m) or {}
            )
    return out
