"""docs/checkpoints.md's FSDP2 block: a model sharded with ``fully_shard`` on one gloo rank.

The names the block uses (``torch``, ``model`` before sharding, ``steps``,
``train_step(model, optimizer)``), a world of one on a file store, and a memory-tier
directory of its own (``TRAINGUARD_CHECKPOINT_MEMORY_DIR``, so that ``close()`` keeps the
snapshots). After the block, a fresh sharded model and optimizer restore the last step:
the full parameters and Adam's moments must be what the block trained. The multi-rank
cases (a SIGKILL, 4 -> 2 ranks, TP) are tests/test_checkpoint_sharded.py.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainguard.checkpoint import Checkpointer

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def namespace() -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="tg-docs-sharded-")
    os.environ["TRAINGUARD_CHECKPOINT_MEMORY_DIR"] = os.path.join(work, "memory")
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    if not dist.is_initialized():
        store = f"file://{os.path.join(work, 'store')}"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    return {"torch": torch, "model": _model(), "steps": STEPS, "train_step": train_step}


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def after(namespace: dict[str, Any]) -> None:
    assert isinstance(next(namespace["model"].parameters()), DTensor)
    model = _model()
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Checkpointer() as ckpt:
        assert ckpt.load_latest({"model": model, "optim": optimizer}) == STEPS
    for (name, trained), restored in zip(
        namespace["model"].named_parameters(), model.parameters(), strict=True
    ):
        assert torch.equal(_full(trained.detach()), _full(restored.detach())), name
    trained_state = namespace["optimizer"].state_dict()["state"]
    restored_state = optimizer.state_dict()["state"]
    assert trained_state.keys() == restored_state.keys() and restored_state
    for index, moments in trained_state.items():
        for key, value in moments.items():
            assert torch.equal(_full(restored_state[index][key]), _full(value)), (index, key)
