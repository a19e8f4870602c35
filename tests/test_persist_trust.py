"""The agent's durable writer persists only shards whose data matches their checksum.

A memory shard without a checksum is trusted only by its writer (the same rank, in the
same attempt, see ``checkpoint.shard.unchecked_refusal``); a durable shard is trusted by
every rank of every later attempt. So the writer refuses a shard whose data does not
match its checksum, and one that has none (a worker's ``save()`` commits its meta
without one and adds it in the background: the writer waits for it, and refuses the
shard when it never comes).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from conftest import wait_for
from trainguard.agent.persist import DurablePersister, DurableSettings, scan_memory
from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.durable import DurableTier
from trainguard.checkpoint.shard import verify

JOB = "job-trust"
WORLD = 2


def save(memory: Path, step: int) -> None:
    """Both ranks of the node save ``step`` (``close()`` waits for the checksums)."""
    for rank in range(WORLD):
        with Checkpointer(
            memory_dir=str(memory), rank=rank, world_size=WORLD, job_id=JOB, durable_url=""
        ) as ckpt:
            ckpt.save(step, {"w": torch.full((32, 8), float(step * 10 + rank))})


def meta_of(memory: Path, step: int, rank: int) -> Path:
    return scan_memory(memory)[step][rank].meta_path


def strip_checksum(meta_path: Path) -> dict[str, Any]:
    """Make ``meta_path`` copy-complete (no checksum); returns the meta it had."""
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "checksum": None}))
    return meta


def settled(persister: DurablePersister, step: int) -> dict[str, Any]:
    def done() -> bool:
        status = persister.status()
        return step in status.committed or step in status.failed

    wait_for(done, timeout=30)
    return persister.status().to_json()


def run(
    memory: Path, durable: Path, step: int, *, workers_alive: bool = True, timeout: float = 30.0
) -> dict[str, Any]:
    settings = DurableSettings(str(durable), JOB)
    persister = DurablePersister(
        memory, settings, commit_timeout=timeout, workers_alive=lambda: workers_alive
    )
    try:
        persister.request(step, WORLD, True, list(range(WORLD)))
        return settled(persister, step)
    finally:
        persister.close()


def test_a_good_step_is_persisted_and_verifies(tmp_path: Path) -> None:
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    save(memory, 2)
    status = run(memory, durable, 2)
    assert status["committed"] == [2] and status["failed"] == {}, status
    tier = DurableTier(str(durable), JOB)
    for rank in range(WORLD):
        data, meta = tier.read_shard(2, rank)
        verify(data, meta, job_id=JOB, world_size=WORLD, rank=rank, step=2)


def test_a_corrupt_shard_with_a_checksum_is_not_persisted(tmp_path: Path) -> None:
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    save(memory, 2)
    data_path = meta_of(memory, 2, 1).with_suffix(".data")
    raw = bytearray(data_path.read_bytes())
    raw[5] ^= 0x40
    data_path.write_bytes(bytes(raw))
    reason = run(memory, durable, 2)["failed"]["2"]
    assert "rank 1's step 2 does not match its checksum" in reason
    assert str(data_path) in reason
    assert DurableTier(str(durable), JOB).steps() == {}  # not even the good rank 0


def test_a_checksum_less_shard_is_not_persisted(tmp_path: Path) -> None:
    """Its worker died before adding the checksum; its data is corrupt as well."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    save(memory, 2)
    meta_path = meta_of(memory, 2, 1)
    strip_checksum(meta_path)
    data_path = meta_path.with_suffix(".data")
    data_path.write_bytes(b"\xff" * 16 + data_path.read_bytes()[16:])
    reason = run(memory, durable, 2, workers_alive=False)["failed"]["2"]
    assert "ranks [1] have no checksum" in reason and str(meta_path) in reason, reason
    assert "the workers exited" in reason
    assert DurableTier(str(durable), JOB).steps() == {}


def test_a_checksum_that_never_comes_fails_the_step_in_time(tmp_path: Path) -> None:
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    save(memory, 2)
    strip_checksum(meta_of(memory, 2, 0))
    reason = run(memory, durable, 2, timeout=0.5)["failed"]["2"]
    assert "ranks [0] have no checksum" in reason and "not added within" in reason, reason
    assert DurableTier(str(durable), JOB).steps() == {}


def test_the_writer_waits_for_a_checksum_the_worker_adds_later(tmp_path: Path) -> None:
    """As in a live job: persisted once the worker's checkpointer adds the checksum."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    save(memory, 2)
    meta_path = meta_of(memory, 2, 1)
    full = strip_checksum(meta_path)

    def add_checksum() -> None:  # as the checkpointer does: tmp file + rename
        tmp = meta_path.with_name(meta_path.name + ".tmp")
        tmp.write_text(json.dumps(full))
        os.replace(tmp, meta_path)

    later = threading.Timer(0.5, add_checksum)
    later.start()
    try:
        status = run(memory, durable, 2)
    finally:
        later.join()
    assert status["committed"] == [2] and status["failed"] == {}, status
    _, meta = DurableTier(str(durable), JOB).read_shard(2, 1)
    assert meta["checksum"] == full["checksum"]
