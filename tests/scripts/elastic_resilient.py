"""A resilient data-parallel script with a fixed global batch, for elastic scalings in place.

Every attempt splits the global batch over its world (``run.batch_split``) and deals the
rest of the epoch (``run.shard``); sample ``k`` is ``x = k`` (one feature), so the
samples a step used are in its records. Each process appends one JSON object a line to
``<out>/pid-<pid>.jsonl``: ``start`` per attempt (rank, world, first step, state source,
the split) and ``step`` per step (rank, world, the step's samples on this rank), written
before ``run.completed``, which may end the attempt after counting the step.

``--slow-while PATH``: while PATH exists each step sleeps ``--slow-sleep`` instead of
``--step-sleep``, so a test can keep training going until a scaling it waits for has
happened, however slow the machine is to start a pod's worker.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.resilient as resilient

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--global-batch", type=int, default=12)
parser.add_argument("--step-sleep", type=float, default=0.1)
parser.add_argument("--slow-while", type=Path, default=None)
parser.add_argument("--slow-sleep", type=float, default=0.5)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)

torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
state = resilient.TrainState(model=model, optimizer=optimizer)


def record(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **data})
    with open(args.out / f"pid-{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")


@resilient.restartable(state)
def train(run: resilient.Run) -> None:
    split = run.batch_split(args.global_batch)
    shard = run.shard(args.steps * args.global_batch, split)
    record("start", attempt=run.attempt, rank=run.rank, world=run.world_size,
           start_step=run.start_step, source=run.state_source, per_rank=split.per_rank,
           accumulation=split.accumulation_steps)  # fmt: skip
    batches = iter(shard)
    for step in range(run.start_step, args.steps):
        optimizer.zero_grad()
        samples: list[int] = []
        for _ in range(split.accumulation_steps):
            batch = next(batches)
            samples += batch
            x = torch.tensor(batch, dtype=torch.float32).unsqueeze(1) / 1000.0
            loss = ((model(x) - 2 * x) ** 2).sum() / args.global_batch
            loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        optimizer.step()
        record("step", step=step, attempt=run.attempt, rank=run.rank, world=run.world_size,
               samples=samples)  # fmt: skip
        if run.rank == 0:
            print(f"Batch {step} world {run.world_size}", flush=True)
        run.completed(step)
        slow = args.slow_while is not None and args.slow_while.exists()
        time.sleep(args.slow_sleep if slow else args.step_sleep)
    dist.barrier()


train()
record("done", weight=float(model.weight.item()))
