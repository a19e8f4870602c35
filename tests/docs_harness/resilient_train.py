"""docs/checkpointless.md: a `@resilient.restartable` training loop's surroundings.

A model, its optimizer, the data position, a real Checkpointer and the loop's pieces,
which the page's block uses but leaves to the script around it. docs/elastic.md's block
(`resilient_elastic`) uses the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import trainguard.resilient as resilient
from trainguard.checkpoint import Checkpointer

TOTAL_STEPS = 5
GLOBAL_BATCH = 8


def namespace() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(TOTAL_STEPS * GLOBAL_BATCH, 4)

    def forward_backward(indices: Any) -> None:
        model(data[list(indices)]).square().mean().backward()

    def all_reduce_gradients() -> None:
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()

    return {
        "resilient": resilient,  # imported at the top of the script
        "model": model,
        "optimizer": optimizer,
        "loader_state": {"position": 0},
        "checkpointer": Checkpointer(),  # the job's tiers: the block saves and falls back
        "DistributedDataParallel": DistributedDataParallel,
        "total_steps": TOTAL_STEPS,
        "state": resilient.TrainState(model=model, optimizer=optimizer),
        "GLOBAL_BATCH": GLOBAL_BATCH,
        "STEPS": TOTAL_STEPS,
        "forward_backward": forward_backward,
        "all_reduce_gradients": all_reduce_gradients,
    }


def after(namespace: dict[str, Any]) -> None:
    """The block saved each step's TrainState (its fallback found no checkpoint yet)."""
    checkpointer = namespace["checkpointer"]
    assert checkpointer.last_restore is None
    assert max(checkpointer.memory.shards()) == TOTAL_STEPS
    checkpointer.close()
