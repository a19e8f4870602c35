"""The peers' copy of ``bench/train.py``'s workload: same MLP, data, step time and records.

Runs inside the peers' environment (torch and the peer, never trainguard), so it
imports nothing from the project. A step is the same as ``bench.train.Recorder.step``:
the data of (step, rank) from a generator seeded by both, ``--step-sleep`` of simulated
compute, forward, backward (with the all-reduce), optimizer step. The record written
for each completed step is the same line ``bench.steps.read_steps`` reads::

    <incarnation> <step> <start time> <end time>

where the incarnation is whatever the peer calls a new membership (torchft's quorum,
NVRx's restart iteration), so ``bench.steps.recovery_after`` computes the stall and the
steps redone for a peer exactly as for trainguard. ``worlds.txt`` gets
``<incarnation> <world> <end time>`` for the same steps: the world size each ran at.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BATCH = 32
FEATURES = 64


def model(hidden: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * world + rank)
    return torch.randn(BATCH, FEATURES, generator=gen)


def publish_pid(out: Path, rank: int, extra: dict[str, Any] | None = None) -> None:
    """``<out>/pids/rank<R>.json``: this process, so the benchmark can signal it."""
    path = out / "pids" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), **(extra or {})}))
    os.replace(tmp, path)


class Records:
    """The step lines (only where ``write``) and the world-size changes."""

    def __init__(self, out: Path, write: bool) -> None:
        self.write = write
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def step(self, incarnation: str, step: int, start: float, end: float, world: int) -> None:
        if not self.write:
            return
        with open(self.out / "steps.txt", "a", encoding="utf-8") as f:
            f.write(f"{incarnation} {step} {start:.6f} {end:.6f}\n")
        with open(self.out / "worlds.txt", "a", encoding="utf-8") as f:
            f.write(f"{incarnation} {world} {end:.6f}\n")
        print(f"Batch {step} world {world}", flush=True)


def state_of(mib: int, tensors: int = 4) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 state in ``tensors`` tensors (as ``bench/checkpoint.py``)."""
    numel = (mib << 20) // 4 // tensors
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(numel, generator=gen) for i in range(tensors)}


def checkpoint_parser(doc: str | None) -> argparse.ArgumentParser:
    """The checkpoint scripts' common arguments (``--mib``, ``--repeats``, ``--out``)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    return p


def save_restore(
    state: dict[str, torch.Tensor],
    repeats: int,
    save: Callable[[int], Callable[[], object] | None],
    restore: Callable[[int], dict[str, torch.Tensor] | None],
) -> dict[str, Any]:
    """Each repetition changes the state, times ``save(step)`` until it returns (then calls
    what it returned, untimed: waiting for its background part), zeroes the state and times
    ``restore(step)`` (the restored tensors, or None: restored into ``state``)."""
    saves: list[float] = []
    restores: list[float] = []
    identical = True
    for step in range(1, repeats + 1):
        for t in state.values():
            t.add_(1.0)
        saved = {k: t.clone() for k, t in state.items()}
        start = time.perf_counter()
        finish = save(step)
        saves.append(time.perf_counter() - start)
        if finish is not None:
            finish()
        for t in state.values():
            t.zero_()
        start = time.perf_counter()
        got = restore(step)
        restores.append(time.perf_counter() - start)
        got = state if got is None else got
        identical = identical and all(k in got and torch.equal(got[k], saved[k]) for k in saved)
    return {"save_s": saves, "restore_s": restores, "identical": identical}


def init_gloo_alone() -> None:
    """A gloo group of one (DCP and the peers' checkpointers want a process group)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
