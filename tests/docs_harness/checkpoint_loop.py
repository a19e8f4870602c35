"""docs/checkpoints.md under `trainguard run`: a DDP model, its Adam optimizer and a step.

The Checkpointer block and the DCP block run in the same worker, on a gloo group this
harness sets up (as the script around them would). After the Checkpointer block, a fresh
model and optimizer restore the last step: Adam's moments and the weights must be what
the block trained (the state the docs build is read at each save, never stale).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.checkpoint import Checkpointer, RNGState

STEPS = 6


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def namespace() -> dict[str, Any]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, optimizer = _model_and_adam()

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
    if "ckpt" not in namespace:  # the DCP block
        return
    assert namespace["step"] == STEPS, namespace["step"]  # every step was saved
    model, optimizer = _model_and_adam()
    with Checkpointer() as ckpt:
        assert ckpt.load_latest({"model": model, "optim": optimizer, "rng": RNGState()}) == STEPS
    trained = namespace["optimizer"].state_dict()["state"]
    restored = optimizer.state_dict()["state"]
    assert trained.keys() == restored.keys() and restored, "Adam's moments were saved"
    for index, moments in trained.items():
        for key, value in moments.items():
            assert torch.equal(restored[index][key], value), (index, key)
    for key, value in namespace["model"].state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
