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

import json
import os
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
