"""An ordinary torchrun DDP script, nothing trainguard-specific in it.

It prints which launcher variables it sees, trains a tiny model for a few steps
and prints a checksum of the result, so a test can compare its output under
torchrun and under trainguard line by line.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

CONTRACT = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
]
# Values that legitimately differ between two launches.
VARYING = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"}

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--tag", default="none")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
missing = [k for k in CONTRACT if k not in os.environ]
print(f"rank {rank}: missing env: {missing}", flush=True)
for key in CONTRACT:
    if key not in VARYING and key in os.environ:
        print(f"rank {rank}: {key}={os.environ[key]}", flush=True)
print(f"rank {rank}: world {dist.get_world_size()} tag {args.tag}", flush=True)

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + rank)
for _ in range(args.steps):
    x = torch.randn(16, 8, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"rank {rank}: checksum {checksum:.10f}", flush=True)
# Every rank done before any tears its group down: without this, gloo (torch 2.13) here
# sometimes aborts a rank at exit ("terminate called without an active exception"),
# under torchrun as under trainguard. It still did once in ~10 suite runs: the group's
# worker thread may still be finishing the barrier's work when the group is destroyed,
# so give it a moment (as trainguard.resilient's end_default_group does).
dist.barrier()
time.sleep(0.1)
dist.destroy_process_group()
