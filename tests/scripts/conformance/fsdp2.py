"""FSDP2 (fully_shard) on CPU over gloo."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
for _ in range(5):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
full = model[0].weight.full_tensor()
total = round(float(full.sum()), 4)
print(f"rank {dist.get_rank()} weight sum {total}")
Path(os.environ["OUT"], f"result-{dist.get_rank()}.txt").write_text(str(total))
dist.destroy_process_group()
