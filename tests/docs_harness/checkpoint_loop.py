"""docs/checkpoints.md under `trainguard run`: a DDP model, its optimizer and a step.

The Checkpointer block and the DCP block run in the same worker, on a gloo group this
harness sets up (as the script around them would).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 6


def namespace() -> dict[str, Any]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step() -> None:
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return {
        "torch": torch,
        "model": model,
        "optimizer": optimizer,
        "steps": STEPS,
        "train_step": train_step,
        "state_dict": {"model": model.state_dict()},
    }


def after(namespace: dict[str, Any]) -> None:
    if "ckpt" in namespace:  # the Checkpointer block: every step was saved
        assert namespace["step"] == STEPS, namespace["step"]
