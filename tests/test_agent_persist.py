"""The agent's durable writer: memory shards of a chosen step -> durable tier -> committed.

Shards are written by real Checkpointers (two ranks of one node) into a memory tier
directory; the persister copies, verifies and uploads them (local path and moto's S3).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import wait_for
from s3_server import S3Server, s3_bucket_url, s3_server  # noqa: F401
from trainguard.agent.persist import DurablePersister, DurableSettings, scan_memory
from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.durable import DurableTier
from trainguard.checkpoint.shard import verify

JOB = "job-p"
WORLD = 2


def state(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((64, 16), float(step * 10 + rank)), "step": step}


def save_steps(memory: Path, steps: list[int], **kw: Any) -> None:
    for rank in range(WORLD):
        ckpt = Checkpointer(
            memory_dir=str(memory), rank=rank, world_size=WORLD, job_id=JOB, durable_url="", **kw
        )
        for step in steps:
            ckpt.save(step, state(step, rank))
        ckpt.close()


def persisted(persister: DurablePersister, step: int) -> dict[str, Any]:
    """The persister's status once ``step`` is committed or failed."""

    def settled() -> bool:
        status = persister.status()
        return step in status.committed or step in status.failed

    wait_for(settled, timeout=60)
    return persister.status().to_json()


@pytest.fixture(params=["local", "s3"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> DurableSettings:
    if request.param == "local":
        return DurableSettings(str(tmp_path / "durable"), JOB, keep=2)
    server: S3Server = request.getfixturevalue("s3_server")
    url = request.getfixturevalue("s3_bucket_url")
    return DurableSettings(f"{url}/ckpt", JOB, keep=2, storage_options=server.storage_options)


def test_a_requested_step_is_written_committed_and_restorable(
    tmp_path: Path, settings: DurableSettings
) -> None:
    memory = tmp_path / "memory"
    save_steps(memory, [4, 5, 6], memory_keep=3)
    persister = DurablePersister(memory, settings)
    try:
        status = persister.status().to_json()
        assert status["memory_steps"] == {
            str(s): {"ranks": [0, 1], "force": False} for s in (4, 5, 6)
        }
        persister.request(5, WORLD, True, [0, 1])
        status = persisted(persister, 5)
        assert status["written"] == [5] and status["committed"] == [5], status
    finally:
        persister.close()
    tier = DurableTier(settings.url, JOB, settings.storage_options)
    assert tier.committed_steps() == [5]
    # Each durable shard is the memory shard, byte for byte, and verifies.
    for rank, shard in scan_memory(memory)[5].items():
        data, meta = tier.read_shard(5, rank)
        assert data == shard.meta_path.with_suffix(".data").read_bytes()[: len(data)]
        verify(data, meta, job_id=JOB, world_size=WORLD, rank=rank, step=5)


def test_unchecksummed_shards_never_leave_the_node(tmp_path: Path) -> None:
    """A copy-complete meta whose worker died before adding the checksum: nothing can
    verify its data, so it is not persisted (tests/test_persist_trust.py has more)."""
    memory = tmp_path / "memory"
    save_steps(memory, [3])
    for path in memory.glob("rank-*-slot-*.meta"):  # as when a worker dies right after save()
        path.write_text(json.dumps({**json.loads(path.read_text()), "checksum": None}))
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    persister = DurablePersister(memory, settings, workers_alive=lambda: False)
    try:
        persister.request(3, WORLD, True, [0, 1])
        assert "have no checksum" in persisted(persister, 3)["failed"]["3"]
    finally:
        persister.close()
    assert DurableTier(settings.url, JOB).steps() == {}


def test_a_step_gone_from_memory_or_corrupt_fails_and_is_never_committed(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    save_steps(memory, [1, 2])
    # Corrupt rank 1's step 2 in place (its meta keeps the old checksum).
    slot = next(s for s in scan_memory(memory)[2].values() if s.rank == 1)
    data = slot.meta_path.with_suffix(".data")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    persister = DurablePersister(memory, settings, commit_timeout=2.0)
    try:
        persister.request(9, WORLD, True, [0, 1])
        assert "no step >= 9 saved by ranks [0, 1]" in persisted(persister, 9)["failed"]["9"]
        persister.request(2, WORLD, True, [0, 1])
        assert "does not match its checksum" in persisted(persister, 2)["failed"]["2"]
    finally:
        persister.close()
    assert DurableTier(settings.url, JOB).committed_steps() == []


def test_commit_waits_for_the_other_nodes_shards_then_gives_up(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    save_steps(memory, [7])  # ranks 0 and 1; the job has 4: ranks 2 and 3 never arrive
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    persister = DurablePersister(memory, settings, commit_timeout=1.5)
    try:
        persister.request(7, 4, True, [0, 1])
        status = persisted(persister, 7)
    finally:
        persister.close()
    assert status["written"] == [7] and "not every rank's shard" in status["failed"]["7"]
    assert DurableTier(settings.url, JOB).committed_steps() == []


def test_a_request_waiting_on_a_killed_nodes_shards_gives_way_to_the_next(
    tmp_path: Path,
) -> None:
    """The committing node waits for the other node's shards of step 7; that node's agent
    was killed, so the controller fails the request and asks for step 8. The waiting
    request stops at once, without a failure of its own (the controller has counted it),
    and step 8 commits once the other node's new agent has written its shards (before,
    step 8 waited behind step 7's whole commit timeout)."""
    memory = tmp_path / "memory"
    save_steps(memory, [7, 8], memory_keep=2)  # this node's ranks 0 and 1 of a 4-rank job
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    persister = DurablePersister(memory, settings, commit_timeout=600.0)
    tier = DurableTier(settings.url, JOB)
    try:
        persister.request(7, 4, True, [0, 1])
        wait_for(lambda: persister.status().written == (7,), timeout=60)
        persister.request(8, 4, True, [0, 1])
        wait_for(lambda: persister.status().written == (7, 8), timeout=60)
        for rank in (2, 3):  # the other node's successor writes its shards
            data, meta = tier.read_shard(8, rank - 2)
            tier.write_shard(8, rank, data, {**meta, "rank": rank})
        status = persisted(persister, 8)
    finally:
        persister.close()
    assert status["committed"] == [8] and status["failed"] == {}, status
    assert tier.committed_steps() == [8]


def test_the_requested_step_is_held_while_the_training_loop_keeps_saving(tmp_path: Path) -> None:
    """Two ranks save every step into two slots as fast as they can; the agent asks for
    the first step >= 300 (ahead of the loop): it stays out of rotation until durable."""
    memory = tmp_path / "memory"
    agent_writes = {"TRAINGUARD_CHECKPOINT_CONFIG": '{"durableWriter": "agent"}'}
    ckpts = [
        Checkpointer(
            memory_dir=str(memory),
            rank=rank,
            world_size=WORLD,
            job_id=JOB,
            durable_url="",
            memory_keep=2,
            environ=agent_writes,
        )
        for rank in range(WORLD)
    ]
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    persister = DurablePersister(memory, settings)
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set() and step < 3000:
            step += 1
            for rank, ckpt in enumerate(ckpts):
                ckpt.save(step, state(step, rank))

    loop = threading.Thread(target=train)
    loop.start()
    try:
        persister.request(300, WORLD, True, [0, 1])
        status = persisted(persister, 300)
    finally:
        stop.set()
        loop.join()
        persister.close()
        for ckpt in ckpts:
            ckpt.close()
    assert status["committed"] == [300], status
    tier = DurableTier(settings.url, JOB)
    for rank in range(WORLD):
        data, _ = tier.read_shard(300, rank)
        assert data[: 64 * 16 * 4] == state(300, rank)["w"].numpy().tobytes()
    assert not (memory / "hold.json").exists(), "released once written"


def test_settings_come_from_the_jobs_checkpoint_config() -> None:
    raw = json.dumps({"durableUrl": "s3://b/p", "durableKeep": 5, "storageOptions": {"a": 1}})
    assert DurableSettings.from_config_json(raw, "j") == DurableSettings(
        "s3://b/p", "j", 5, {"a": 1}
    )
    assert DurableSettings.from_config_json(json.dumps({"durableUrl": None}), "j") is None
    assert DurableSettings.from_config_json("not json", "j") is None


def test_a_fenced_agent_writes_nothing_that_lasts(tmp_path: Path) -> None:
    """A node the controller may have declared lost (no request from it for its fence
    time, agent/lease.py) neither writes a shard nor commits: a step asked for just
    before a partition never reaches the durable tier from it."""
    memory = tmp_path / "memory"
    save_steps(memory, [3, 4])
    settings = DurableSettings(str(tmp_path / "durable"), JOB)
    fenced: list[str | None] = [None]
    persister = DurablePersister(memory, settings, fence=lambda: fenced[0])
    try:
        persister.request(3, WORLD, True, [0, 1])
        assert persisted(persister, 3)["committed"] == [3]  # in good standing
        fenced[0] = "fenced: no request from the controller for 4.2s"
        persister.request(4, WORLD, True, [0, 1])
        failed = persisted(persister, 4)["failed"]["4"]
        assert failed == "step 4: not written: fenced: no request from the controller for 4.2s"
    finally:
        persister.close()
    tier = DurableTier(settings.url, JOB)
    assert tier.committed_steps() == [3] and sorted(tier.steps()) == [3]
