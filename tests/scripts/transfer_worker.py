"""A peer state sync among 4 gloo ranks (tests/test_resilient_transfer.py runs it).

Ranks 0 and 1 hold the state after 4 steps, rank 3 after 3 (it is behind), rank 2 is a
replacement with no state (its model built by ``no_init_on_spare``). ``synchronise``
brings all four to step 4: ranks 0 and 1 both send (a share each), ranks 2 and 3 both
receive, in place. Then all run steps 5 and 6 with ``resilient.DistributedDataParallel``
(made without its initial broadcast). Every rank writes ``<out>/rank-<R>.json``: the
SHA-256 of its final state and of a reference run without the fault (all four ranks
running steps 1-6 straight), whether each received tensor is the one the state had, and
what the DDP broadcast check saw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainguard.resilient as resilient
from trainguard.resilient import transfer
from trainguard.resilient.ddp import mark_in_sync
from trainguard.resilient.run import StateProgress
from trainguard.resilient.sync import synchronise

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

# Small pieces, so that a few-MB state is cut into slices and packed buckets.
transfer.BUCKET_BYTES = 64 << 10
transfer.CHUNK_BYTES = 256 << 10

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def build(skip_init: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with resilient.no_init_on_spare(skip_init):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 640)
        )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(ddp: Any, model: torch.nn.Module, optim: torch.optim.Optimizer, n: int) -> None:
    gen = torch.Generator().manual_seed(n * world + rank)
    x = torch.randn(8, 64, generator=gen)
    loss = ddp(x).square().mean()
    optim.zero_grad()
    loss.backward()
    if ddp is model:  # no DDP: one all_reduce over a fixed layout, as DDP's buckets
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in model.parameters():
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    optim.step()


def digest(state: dict[str, Any]) -> str:
    sha = hashlib.sha256()
    for tensor in _tensors(state):
        sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node.detach().reshape(-1)]
    if isinstance(node, dict):
        return [t for key in sorted(node, key=str) for t in _tensors(node[key])]
    if isinstance(node, (list, tuple)):
        return [t for value in node for t in _tensors(value)]
    return []


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


# The reference: six steps, no fault (the last two through a DDP, as below).
model, optim = build()
for n in range(1, 5):
    step(model, model, optim, n)
reference_ddp = resilient.DistributedDataParallel(model)
for n in range(5, 7):
    step(reference_ddp, model, optim, n)
reference = digest(full_state(model, optim))
del reference_ddp

# The faulted run: four steps everywhere; rank 3 goes back to its step-3 state, rank 2
# starts over in a fresh process's state.
model, optim = build()
snapshot: dict[str, Any] = {}
for n in range(1, 5):
    step(model, model, optim, n)
    if n == 3 and rank == 3:
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {
            i: {k: v.clone() for k, v in s.items()} for i, s in optim.state_dict()["state"].items()
        }
progress = StateProgress(has_state=True, steps=4)
if rank == 3:
    model.load_state_dict(snapshot)
    for p, (_, saved) in zip(model.parameters(), sorted(moments.items()), strict=True):
        for key, value in saved.items():
            optim.state[p][key].copy_(value)
    progress.steps = 3
if rank == 2:
    model, optim = build(skip_init=True)
    progress = StateProgress()
# A non-contiguous tensor (sent from a contiguous copy, in slices), the holders' only.
extra = torch.arange(300 * 700, dtype=torch.float64).reshape(300, 700)
if rank in (2, 3):
    extra.zero_()
state = {"model": model, "optim": optim, "extra": extra.t()}
before = [p.data_ptr() for p in model.parameters()]
moments_before = [
    optim.state[p]["exp_avg"].data_ptr() for p in model.parameters() if optim.state[p]
]
source, detail = synchronise(state, progress, None)
in_place = [p.data_ptr() for p in model.parameters()] == before
extra_ok = torch.equal(
    state["extra"], torch.arange(300 * 700, dtype=torch.float64).reshape(300, 700).t()
)
if moments_before:  # rank 3 had moments: received into them
    in_place &= [optim.state[p]["exp_avg"].data_ptr() for p in model.parameters()] == moments_before

ddp = resilient.DistributedDataParallel(model)
for n in range(5, 7):
    step(ddp, model, optim, n)
final = digest(full_state(model, optim))

# The broadcast DDP skips: right after a sync, a DDP leaves rank 1's (changed) values
# alone; without the mark it broadcasts rank 0's.
probe = torch.nn.Linear(3, 2)
with torch.no_grad():
    probe.weight.fill_(float(rank))
mark_in_sync(True)
resilient.DistributedDataParallel(probe).ddp  # noqa: B018  # made here
kept = float(probe.weight[0, 0].detach())
mark_in_sync(False)
resilient.DistributedDataParallel(probe).ddp  # noqa: B018
broadcast = float(probe.weight[0, 0].detach())

(args.out / f"rank-{rank}.json").write_text(
    json.dumps(
        {
            "source": source,
            "detail": detail,
            "steps": progress.steps,
            "in_place": in_place,
            "extra_ok": extra_ok,
            "reference": reference,
            "final": final,
            "kept": kept,
            "broadcast": broadcast,
        }
    )
)
dist.barrier()
dist.destroy_process_group()
