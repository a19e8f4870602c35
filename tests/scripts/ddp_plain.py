"""A torchrun DDP script (ddp_plain.py) and the same, checkpointless (ddp_checkpointless.py)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-sleep", type=float, default=0.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
ddp = DDP(model)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * world_size + rank)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


for step in range(1, args.steps + 1):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.10f}", flush=True)
    time.sleep(args.step_sleep)


dist.barrier()
dist.destroy_process_group()
