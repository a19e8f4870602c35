"""DDP with the model held at module level; destroy_process_group() at the end."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x = torch.randn(16, 8)
for _ in range(20):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
weight = [round(v, 5) for v in model.module.weight.detach().flatten().tolist()]
print(f"rank {dist.get_rank()} weight {weight}")
with open(os.path.join(os.environ["OUT"], f"result-{dist.get_rank()}.txt"), "w") as f:
    f.write(repr(weight))
dist.destroy_process_group()
