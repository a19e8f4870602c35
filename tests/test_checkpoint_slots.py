"""Memory slots ready before the saves that use them: pre-faulted, and page-locked for CUDA.

Page-locking needs a GPU; here ``host_memory.register``/``unregister`` are replaced by a
recorder, so the bookkeeping (register once, unregister before unmapping or growing,
re-register after growing) is checked on any machine. The GPU lane
(``tests/test_gpu_checkpoint.py``) runs the real thing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainguard.checkpoint import Checkpointer, host_memory
from trainguard.checkpoint.background import Prepare
from trainguard.checkpoint.memory import MemoryTier


class Registrar:
    """Stands in for cudaHostRegister/Unregister: which addresses are page-locked now."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, nbytes: int) -> bool:
        assert address not in self.locked, "registered twice"
        self.locked[address] = nbytes
        self.calls.append(("register", nbytes))
        return True

    def unregister(self, address: int) -> None:
        assert address in self.locked, "unregistered memory that was not registered"
        self.calls.append(("unregister", self.locked.pop(address)))


@pytest.fixture
def registrar(monkeypatch: pytest.MonkeyPatch) -> Registrar:
    fake = Registrar()
    monkeypatch.setattr(host_memory, "register", fake.register)
    monkeypatch.setattr(host_memory, "unregister", fake.unregister)
    return fake


def _tier(directory: str, keep: int = 2) -> MemoryTier:
    return MemoryTier(directory, rank=0, world_size=1, job_id="job", keep=keep)


def test_prepare_pins_each_slot_once_and_unpins_before_unmapping(
    shm: str, registrar: Registrar
) -> None:
    tier = _tier(shm)
    tier.prepare(1 << 20, pin=True)
    assert len(registrar.locked) == 2
    assert all(nbytes >= 1 << 20 for nbytes in registrar.locked.values())
    tier.prepare(1 << 20, pin=True)  # ready: nothing again
    assert [c for c, _ in registrar.calls] == ["register", "register"]
    tier.close()
    assert registrar.locked == {}


def test_a_growing_slot_is_unpinned_before_it_is_remapped_and_pinned_again(
    shm: str, registrar: Registrar
) -> None:
    tier = _tier(shm, keep=1)
    tier.prepare(1 << 16, pin=True)
    buffer, prepared = tier.begin(0, 4 << 20, pin=True)
    assert prepared and buffer.numel() >= 4 << 20
    assert [c for c, _ in registrar.calls] == ["register", "unregister", "register"]
    assert list(registrar.locked.values()) == [buffer.numel()]
    _, prepared = tier.begin(0, 4 << 20, pin=True)
    assert not prepared
    tier.close()
    assert registrar.locked == {}


def test_unpinned_slots_are_pinned_without_losing_their_snapshot(
    shm: str, registrar: Registrar
) -> None:
    tier = _tier(shm, keep=1)
    tier.prepare(1 << 20)
    tier.commit(0, {"step": 3})
    assert registrar.calls == []
    assert tier.unready(1 << 20, pin=True) == [0]
    assert tier.read_meta(0) == {"step": 3}  # only page-locking is missing: kept
    tier.prepare_slot(0, 1 << 20, pin=True)
    assert len(registrar.locked) == 1 and tier.unready(1 << 20, pin=True) == []
    assert tier.unready(8 << 20) == [0] and tier.read_meta(0) is None  # must grow: dropped
    tier.close()


def _state() -> dict[str, Any]:
    return {"w": torch.randn(1 << 18), "b": torch.arange(1000), "step": 1}


def test_first_save_prepares_the_other_slots_in_the_background(shm: str) -> None:
    state = _state()
    with Checkpointer(memory_dir=shm, job_id="job", environ={}, memory_keep=3) as ckpt:
        assert ckpt.memory.unready(1 << 20) == [0, 1, 2]
        ckpt.save(1, state)
        ckpt.wait()
        assert ckpt.memory.unready(1 << 20) == []
        assert ckpt.memory.shards().keys() == {1}
        for step in (2, 3, 4):
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.memory.shards().keys() == {2, 3, 4}


def test_slot_preparation_in_the_background_waits_while_a_save_copies(shm: str) -> None:
    """Pre-faulting, like the checksum, leaves the memory bandwidth to a save's copy."""
    with Checkpointer(memory_dir=shm, job_id="job", environ={}, memory_keep=3) as ckpt:
        background = ckpt._background
        assert ckpt.memory.unready(1 << 20) == [0, 1, 2]
        with background.copying():
            background.submit(Prepare((1,), 1 << 20, False, None))
            with pytest.raises(TimeoutError):
                background.wait(timeout=0.5)
        background.wait(timeout=60)
        assert ckpt.memory.unready(1 << 20) == [0, 2]


def test_non_blocking_save_of_cpu_state_commits_in_the_background(shm: str) -> None:
    state = _state()
    with Checkpointer(memory_dir=shm, job_id="job", environ={}) as ckpt:
        assert ckpt.save(5, state, blocking=False)
        ckpt.wait()
        assert ckpt.memory.shards().keys() == {5}
        restored = {"w": torch.zeros(1 << 18), "b": torch.zeros(1000, dtype=torch.int64)}
        assert ckpt.load_latest(restored) == 5
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])


def test_back_to_back_non_blocking_saves_replace_the_oldest_snapshot(shm: str) -> None:
    state = _state()
    with Checkpointer(memory_dir=shm, job_id="job", environ={}, memory_keep=2) as ckpt:
        ckpt.load_latest(state)
        for step in (1, 2, 3):  # each before the previous one is committed, most likely
            ckpt.save(step, state, blocking=False)
        ckpt.wait()
        assert ckpt.memory.shards().keys() == {2, 3}


def test_a_slot_that_cannot_be_page_locked_is_not_tried_again(
    shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[int] = []
    monkeypatch.setattr(host_memory, "register", lambda address, nbytes: tries.append(1) and False)
    tier = _tier(shm, keep=1)
    tier.prepare(1 << 20, pin=True)
    assert tier.unready(1 << 20, pin=True) == [] and len(tries) == 1
    tier.begin(0, 1 << 20, pin=True)
    assert len(tries) == 1
    tier.close()
