"""CUDA checkpoints on a GPU: page-locked slots, side-stream copies, bit-identical restore.

Runs where CUDA is (``make gpu-check``); skipped elsewhere. The bookkeeping behind it is
covered on any machine by ``tests/test_checkpoint_slots.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from trainguard.checkpoint import Checkpointer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "steps": 3}


def _flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state.detach().cpu().clone()]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _flat(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _flat(item)]
    return []


@pytest.mark.parametrize("blocking", [True, False])
def test_cuda_state_saves_to_pinned_slots_and_restores_bit_identical(
    shm: str, blocking: bool
) -> None:
    model, optimizer = _trained()
    state = _snapshot(model, optimizer)
    want = _flat(state)
    with Checkpointer(memory_dir=shm, job_id="gpu", environ={}) as ckpt:
        assert ckpt.save(3, state, blocking=blocking)
        if not blocking:  # queued after the copies: must not reach the snapshot
            for param in model.parameters():
                param.data.add_(1.0)
        ckpt.wait()
        slot = ckpt.memory.shards()[3].slot
        assert ckpt.memory.buffer(slot).is_pinned()

    fresh, fresh_optimizer = _trained()
    for param in fresh.parameters():
        param.data.zero_()
    target = _snapshot(fresh, fresh_optimizer)
    with Checkpointer(memory_dir=shm, job_id="gpu", environ={}) as ckpt:
        assert ckpt.load_latest(target) == 3
        ckpt.wait()  # the other slots are readied in the background
        assert all(ckpt.memory.buffer(s).is_pinned() for s in range(ckpt.memory.slots))
    got = _flat(target)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(t.is_cuda for t in fresh.state_dict().values())


def test_the_slots_after_the_first_save_are_pinned_in_the_background(shm: str) -> None:
    model, optimizer = _trained()
    with Checkpointer(memory_dir=shm, job_id="gpu", environ={}, memory_keep=3) as ckpt:
        ckpt.save(1, _snapshot(model, optimizer))
        ckpt.wait()
        assert all(ckpt.memory.buffer(s).is_pinned() for s in range(3))
        assert os.path.exists(ckpt.memory.meta_path(0))


def test_dcp_tiered_writer_stages_cuda_state_and_reads_it_back_bit_identical(
    shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint.dcp import TieredStorageReader, TieredStorageWriter

    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_MEMORY_DIR", shm)
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "gpu-dcp")
    for name in ("TRAINGUARD_CHECKPOINT_CONFIG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, optimizer = _trained()
    saved = _snapshot(model, optimizer)
    want = _flat(saved)
    dcp.save(saved, storage_writer=TieredStorageWriter(step=4))
    fresh, fresh_optimizer = _trained()
    for param in fresh.parameters():
        param.data.zero_()
    target = _snapshot(fresh, fresh_optimizer)
    dcp.load(target, storage_reader=TieredStorageReader())
    assert all(torch.equal(a, b) for a, b in zip(_flat(target), want, strict=True))
