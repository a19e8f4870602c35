"""A deterministic data-parallel training script using trainguard.resilient.

Every rank appends what it does to ``<out>/rank-<R>.log`` (one JSON object a line:
``start`` per attempt, ``completed`` per step, ``fallback``) and writes
``<out>/final-<R>.json`` with a SHA-256 of its final weights, so a test can check that
steps were neither lost nor repeated and that a faulted run ends bit-identical to a
clean one. Batches and seeds depend on (step, rank) only, never on process history.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
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
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument("--save-at", type=int, default=0, help="rank 0 saves the state after N steps")
parser.add_argument("--resume-from", type=Path, help="the fallback loads this saved state")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
extra: dict[str, Any] = {"samples_seen": 0}
state = resilient.TrainState(model=model, optimizer=optimizer, extra=extra)


def record(event: str, **data: Any) -> None:
    rank = int(os.environ.get("RANK", "0"))
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **data})
    with open(args.out / f"rank-{rank}.log", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def load_saved() -> int | None:
    if args.resume_from is None:
        record("fallback", steps=None)
        return None
    saved = torch.load(args.resume_from, weights_only=True)
    state.load_state_dict(saved["state"])
    record("fallback", steps=saved["steps"])
    return int(saved["steps"])


def average_gradients() -> None:
    """One all_reduce over a fixed layout: the same sums in every run."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@resilient.restartable(state, fallback=load_saved)
def train(run: resilient.Run) -> None:
    record("start", attempt=run.attempt, start_step=run.start_step, source=run.state_source)
    for step in range(run.start_step, args.steps):
        gen = torch.Generator().manual_seed(1000 + step * 97 + run.rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        average_gradients()
        optimizer.step()
        extra["samples_seen"] += 8 * run.world_size
        run.completed(step)
        record("completed", step=step, attempt=run.attempt)
        if args.save_at == step + 1 and run.rank == 0:
            saved = {"state": copy.deepcopy(state.state_dict()), "steps": step + 1}
            torch.save(saved, args.out / "saved.pt")
        time.sleep(args.step_sleep)


train()
digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.numpy().tobytes())
rank = int(os.environ["RANK"])
final = {"pid": os.getpid(), "sha256": digest.hexdigest(), "samples_seen": extra["samples_seen"]}
(args.out / f"final-{rank}.json").write_text(json.dumps(final))
