"""DDP, and destroy_process_group() never called: torch tears the group down at exit."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 1))
    for _ in range(10):
        model(torch.ones(2, 4)).sum().backward()
    print(f"rank {dist.get_rank()} trained; the group is left to torch")
    Path(os.environ["OUT"], f"result-{dist.get_rank()}.txt").write_text("ok")


main()
