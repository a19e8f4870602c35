"""A torchtitan-style training script: FSDP2 (``--dp-replicate 1``) or HSDP
(``--dp-replicate R``: R replicas of the shards), checkpointless under trainguard.

The same script runs under plain torchrun: trainguard.resilient's
``init_process_group``, ``init_device_mesh``, ``fully_shard`` and ``loop`` are torch's
own there (and ``loop`` a plain loop over the steps). Under ``trainguard run`` with
``inProcessRestart`` a crashed rank is replaced in place: with HSDP it takes its shards
from the rank that holds them in another replica (no step lost); with FSDP every rank
rolls back to the memory tier's newest common step (``loop`` saves each step to the
checkpoint tiers) and the steps since are redone. See docs/sharded.md.

    torchrun --standalone --nproc-per-node 4 examples/titan/train.py --dp-replicate 2
    trainguard run -f examples/titan/job-hsdp.yaml --inject kill:rank=1@step=20
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from model import ModelArgs, Transformer

import trainguard.resilient as resilient
from trainguard.resilient import fully_shard, init_device_mesh

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--dp-replicate", type=int, default=1, help="replicas (HSDP when > 1)")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
parser.add_argument("--save-final", default="", help="rank 0 saves the full weights here")
args = parser.parse_args()

resilient.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
if world_size % args.dp_replicate:
    parser.error(f"--dp-replicate {args.dp_replicate} does not divide {world_size} ranks")
shard = world_size // args.dp_replicate
if args.dp_replicate > 1:
    mesh = init_device_mesh(
        "cpu", (args.dp_replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )
else:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))

model_args = ModelArgs()
torch.manual_seed(0)
model = Transformer(model_args)
for block in model.layers.values():  # each block a unit: gathered one at a time
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s sequences of this rank: a function of (step, rank) alone, so a
    step redone after a fault, or by a replacement, sees the same data."""
    generator = torch.Generator().manual_seed(step * world_size + rank)
    start = torch.randint(0, model_args.vocab_size, (args.batch_size, 1), generator=generator)
    tokens = (start + torch.arange(model_args.seq_len + 1)) % model_args.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train_step(step: int) -> None:
    inputs, labels = batch(step)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)  # the mean over the ranks, after the update
    if rank == 0 and (step % args.log_every == 0 or step == args.steps):
        print(f"step {step} loss {logged.item() / world_size:.6f}", flush=True)
    time.sleep(args.step_sleep)


started = time.monotonic()
resilient.loop(train_step, range(1, args.steps + 1), {"model": model, "optim": optimizer})
weights = {name: param.full_tensor() for name, param in model.named_parameters()}
if rank == 0:
    print(f"done: {args.steps} steps in {time.monotonic() - started:.1f} s", flush=True)
    if args.save_final:
        torch.save(weights, args.save_final)
dist.barrier()
dist.destroy_process_group()
