"""The Checkpointer in one process: memory tier, durable tier, bad shards, configuration."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    RankedCheckpointer,
)
from trainguard.checkpoint.config import writer_attempt
from trainguard.checkpoint.memory import default_memory_dir


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.arange(step, step + 10),
        "step": step,
        "data": {"offset": step * 7, "tag": f"s{step}"},
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64), "data": {}}


def _assert_restored(state: dict[str, Any], step: int) -> None:
    want = _state(step)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
    assert state["step"] == step and state["data"] == want["data"]


def _ckpt(memory_dir: str, attempt: int | None = None, **kwargs: Any) -> Checkpointer:
    """A Checkpointer of job-a; ``attempt``: this process's TRAINGUARD_ATTEMPT (None: unset)."""
    kwargs.setdefault("job_id", "job-a")
    environ = {} if attempt is None else {"TRAINGUARD_ATTEMPT": str(attempt)}
    return Checkpointer(memory_dir=memory_dir, environ=environ, **kwargs)


def test_memory_round_trip_and_cadence(shm: str, capsys: pytest.CaptureFixture[str]) -> None:
    with _ckpt(shm, memory_every_steps=5) as ckpt:
        assert ckpt.load_latest(_blank()) is None
        assert ckpt.save(3, _state(3)) is False
        assert ckpt.save(5, _state(5)) is True
        assert ckpt.save(7, _state(7), force=True) is True
        ckpt.wait(timeout=30)
    state = _blank()
    w = state["w"]
    with _ckpt(shm) as ckpt:
        assert ckpt.load_latest(state) == 7
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "memory"
    _assert_restored(state, 7)
    assert state["w"] is w
    assert "Restored step 7 from memory in" in capsys.readouterr().out
    assert ckpt.last_restore is not None
    assert {"plan_s", "verify_s", "copy_s", "prepare_s"} <= set(ckpt.last_restore.phases)


def test_keeps_the_newest_snapshots(shm: str) -> None:
    with _ckpt(shm, memory_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step))
        ckpt.wait(timeout=30)
        assert sorted(ckpt.memory.shards()) == [2, 3]


def _slot_of(memory_dir: str, step: int) -> Path:
    for meta in Path(memory_dir).glob("rank-0-slot-*.meta"):
        if json.loads(meta.read_text())["step"] == step:
            return meta
    raise AssertionError(f"no slot holds step {step}")


def test_corrupt_shard_is_skipped(shm: str, caplog: pytest.LogCaptureFixture) -> None:
    with _ckpt(shm) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    data = _slot_of(shm, 2).with_suffix(".data")
    with open(data, "r+b") as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0xFF]))
    state = _blank()
    with caplog.at_level(logging.WARNING), _ckpt(shm) as ckpt:
        assert ckpt.load_latest(state) == 1
    _assert_restored(state, 1)
    assert "checksum mismatch" in caplog.text and "step 2, rank 0" in caplog.text
    assert "slot" in caplog.text


def _uncheck(memory_dir: str, step: int, writer: dict[str, Any] | None = None) -> None:
    """Remove the checksum from ``step``'s meta, as a worker killed before its background
    checksum leaves it (and, given, make ``writer`` its writer; ``{}``: none recorded)."""
    meta_path = _slot_of(memory_dir, step)
    meta = json.loads(meta_path.read_text())
    meta["checksum"] = None
    if writer == {}:
        del meta["writer"]
    elif writer is not None:
        meta["writer"] = writer
    meta_path.write_text(json.dumps(meta))


def test_a_corrupt_shard_is_skipped_before_its_fit_is_judged(shm: str) -> None:
    # The plan of a restore is made before the shard's checksum is checked; a shard that
    # does not fit the state is still skipped, not reported, when its data is corrupt.
    with _ckpt(shm) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, {**_state(2), "w": torch.zeros(3)})
    _corrupt(shm, 2)
    state = _blank()
    with _ckpt(shm) as ckpt:
        assert ckpt.load_latest(state) == 1
    _assert_restored(state, 1)


def _corrupt(memory_dir: str, step: int) -> None:
    with open(_slot_of(memory_dir, step).with_suffix(".data"), "r+b") as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_copy_complete_shard_loads_for_its_writer_and_torn_shard_does_not(shm: str) -> None:
    with _ckpt(shm, attempt=3) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    assert json.loads(_slot_of(shm, 2).read_text())["writer"] == {"rank": 0, "attempt": 3}
    _uncheck(shm, 2)
    state = _blank()
    with _ckpt(shm, attempt=3) as ckpt:  # the same rank, within its attempt
        assert ckpt.load_latest(state) == 2
    _assert_restored(state, 2)
    _slot_of(shm, 2).unlink()  # as left by a crash during the copy into the slot
    with _ckpt(shm, attempt=3) as ckpt:
        assert ckpt.load_latest(_blank()) == 1


@pytest.mark.parametrize(
    ("writer", "attempt", "why"),
    [
        (
            {"rank": 1, "attempt": 0},
            0,
            "written by rank 1 in attempt 0, not by rank 0 in attempt 0",
        ),
        (
            {"rank": 0, "attempt": 0},
            1,
            "written by rank 0 in attempt 0, not by rank 0 in attempt 1",
        ),
        ({"rank": 0, "attempt": None}, None, "the attempt loading it is unknown"),
        ({}, 0, "no writer recorded"),
    ],
    ids=["another-rank", "a-later-attempt", "unknown-attempt", "no-writer"],
)
def test_corrupt_copy_complete_shard_is_not_loaded_by_another_rank_or_attempt(
    shm: str,
    writer: dict[str, Any],
    attempt: int | None,
    why: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    with _ckpt(shm, attempt=0) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    _corrupt(shm, 2)
    _uncheck(shm, 2, writer)  # only the meta's writer tells whose shard it is
    monkeypatch.setenv("TRAINGUARD_EVENT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    state = _blank()
    with caplog.at_level(logging.WARNING), _ckpt(shm, attempt=attempt) as ckpt:
        assert ckpt.load_latest(state) == 1
    _assert_restored(state, 1)
    assert f"skipping {_slot_of(shm, 1).parent}" in caplog.text and why in caplog.text
    [event] = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "CheckpointSkipped"]  # fmt: skip
    assert event["data"]["step"] == 2 and why in event["data"]["reason"]


def test_a_checksum_is_verified_even_for_the_writer(
    shm: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _ckpt(shm, attempt=0) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    _corrupt(shm, 2)
    state = _blank()
    with caplog.at_level(logging.WARNING), _ckpt(shm, attempt=0) as ckpt:
        assert ckpt.load_latest(state) == 1
    _assert_restored(state, 1)
    assert "checksum mismatch" in caplog.text


def test_the_writer_attempt_comes_from_the_environment() -> None:
    assert writer_attempt({}) is None
    assert writer_attempt({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert writer_attempt({"TRAINGUARD_ATTEMPT": "5", "TORCHELASTIC_RESTART_COUNT": "2"}) == 5
    assert writer_attempt({"TRAINGUARD_ATTEMPT": "x"}) is None


@pytest.mark.parametrize("other", [{"job_id": "job-b"}, {"world_size": 2, "rank": 1}])
def test_foreign_shard_is_skipped(
    shm: str, other: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with _ckpt(shm, **other) as ckpt:
        ckpt.save(4, _state(4))
    # Rename rank 1's files as rank 0's, so only the meta's identity gives them away.
    for path in Path(shm).iterdir():
        path.rename(path.with_name(path.name.replace("rank-1-", "rank-0-")))
    with caplog.at_level(logging.WARNING), _ckpt(shm) as ckpt:
        assert ckpt.load_latest(_blank()) is None
    assert "skipping" in caplog.text and ("job-b" in caplog.text or "world size 2" in caplog.text)


def test_durable_tier_restores_when_memory_is_gone(shm: str, tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    with _ckpt(shm, durable_url=url, durable_every_steps=2, durable_keep=2) as ckpt:
        for step in range(1, 8):
            ckpt.save(step, _state(step))
        ckpt.wait(timeout=60)
    steps = sorted(p.name for p in (tmp_path / "durable" / "job-a").iterdir())
    assert steps == ["step-0000000004", "step-0000000006"]
    for path in Path(shm).iterdir():
        path.unlink()
    state = _blank()
    with _ckpt(shm, durable_url=url) as ckpt:
        assert ckpt.load_latest(state) == 6
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "durable"
    _assert_restored(state, 6)
    # A corrupt durable shard is skipped too: the next newest committed step is used.
    blob = tmp_path / "durable" / "job-a" / "step-0000000006" / "rank-0.bin"
    raw = bytearray(blob.read_bytes())
    raw[10] ^= 1
    blob.write_bytes(bytes(raw))
    for path in Path(shm).iterdir():
        path.unlink()
    with _ckpt(shm, durable_url=url) as ckpt:
        assert ckpt.load_latest(_blank()) == 4


def test_missing_rank_shard_is_not_committed(shm: str, tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    # Rank 0 of 2 writes its shard; rank 1 never does: the step must not be committed.
    ckpt = _ckpt(shm, durable_url=url, world_size=2, rank=0, commit_timeout=0.5)
    ckpt.save(2, _state(2))
    ckpt.wait(timeout=30)
    ckpt.close()
    assert (tmp_path / "durable" / "job-a" / "step-0000000002" / "rank-0.json").exists()
    assert not (tmp_path / "durable" / "job-a" / "step-0000000002" / "COMMITTED").exists()


def test_background_failure_is_raised_from_wait(shm: str, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    ckpt = _ckpt(shm, durable_url=str(blocker / "sub"))
    ckpt.save(1, _state(1))
    with pytest.raises(CheckpointError, match="not-a-dir"):
        ckpt.wait(timeout=30)
    ckpt.save(2, _state(2))  # the error was reported once; saving goes on
    with pytest.raises(CheckpointError):
        ckpt.close(timeout=30)
    # The memory tier still holds both steps.
    with _ckpt(shm) as again:
        assert again.load_latest(_blank()) == 2


def test_close_removes_the_default_memory_directory_and_keeps_a_given_one(shm: str) -> None:
    """Regression: under plain torchrun /dev/shm/trainguard-<uid>/<run> outlived close()."""
    environ = {"TORCHELASTIC_RUN_ID": f"tg-test-{uuid.uuid4().hex[:8]}"}
    ranks = [Checkpointer(environ=environ, rank=r, world_size=2) for r in (0, 1)]
    directory = Path(ranks[0].config.memory_dir)
    assert directory == Path(default_memory_dir(environ))
    for ckpt in ranks:
        ckpt.save(1, {"w": torch.ones(8)})
    ranks[0].close()
    assert [p.name for p in directory.iterdir() if p.name.startswith("rank-0-")] == []
    assert any(directory.iterdir()), "rank 1 has not closed yet"
    ranks[1].close()
    assert not directory.exists()
    with Checkpointer(memory_dir=shm, environ={}) as given:
        given.save(1, {"w": torch.ones(8)})
    assert any(Path(shm).iterdir()), "a directory the caller names is the caller's"


def test_config_from_env_and_overrides() -> None:
    env = {
        "TRAINGUARD_CHECKPOINT_CONFIG": json.dumps(
            {
                "memoryEverySteps": 10,
                "memoryKeep": 3,
                "durableUrl": "/x",
                "durableKeep": 2,
                "durableEverySteps": None,
                "durableEverySeconds": 60,
                "replicas": 1,
            }
        ),
        "TRAINGUARD_CHECKPOINT_MEMORY_DIR": "/dev/shm/agent-dir",
        "TRAINGUARD_JOB_ID": "gpt-1a2b3c",
        "RANK": "3",
        "WORLD_SIZE": "4",
    }
    config = CheckpointConfig.from_env(env, memory_keep=5)
    assert (config.memory_every_steps, config.memory_keep, config.durable_url) == (10, 5, "/x")
    assert config.durable_every_seconds == 60 and config.durable_every_steps is None
    assert (config.memory_dir, config.job_id, config.rank, config.world_size) == (
        "/dev/shm/agent-dir", "gpt-1a2b3c", 3, 4,
    )  # fmt: skip
    assert CheckpointConfig.from_env(env, durable_url="").durable is False
    bad = {"TRAINGUARD_CHECKPOINT_CONFIG": json.dumps({"memoryKeep": 0})}
    with pytest.raises(ValueError, match=r"TRAINGUARD_CHECKPOINT_CONFIG: memoryKeep: must be"):
        CheckpointConfig.from_env(bad)
    with pytest.raises(ValueError, match="RANK='x'"):
        CheckpointConfig.from_env({"RANK": "x"})
    with pytest.raises(TypeError, match="unknown setting 'memory_kept'"):
        CheckpointConfig.from_env({}, memory_kept=1)
    default = CheckpointConfig.from_env({})
    assert default.memory_dir == f"/dev/shm/trainguard-{os.getuid()}/local"


def test_a_ranked_checkpointer_is_made_again_when_rank_or_world_changes(
    shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An elastic scaling in place: the wrapper renumbers RANK and changes WORLD_SIZE.
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ranked = RankedCheckpointer(memory_dir=shm, job_id="job-a", environ={})
    first = ranked.get()
    assert ranked.get() is first and (first.config.rank, first.config.world_size) == (2, 3)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    second = ranked.get()
    assert second is not first and (second.config.rank, second.config.world_size) == (1, 2)
    assert second.config.memory_dir == shm and second.config.job_id == "job-a"
    ranked.close()
    ranked.close()  # nothing left to close


def test_every_skipped_memory_shard_is_an_event(
    shm: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 38: only checksum skips were on the timeline; a truncated shard, a meta that
    is not one and another job's shard were skipped with a log line only."""
    with _ckpt(shm, memory_keep=4) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _state(step))
    foreign, truncated, garbage = _slot_of(shm, 2), _slot_of(shm, 3), _slot_of(shm, 4)
    meta = json.loads(foreign.read_text())
    foreign.write_text(json.dumps({**meta, "job_id": "job-b"}))
    os.truncate(truncated.with_suffix(".data"), 10)
    garbage.write_text("{not json")
    monkeypatch.setenv("TRAINGUARD_EVENT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    state = _blank()
    with _ckpt(shm, memory_keep=4) as ckpt:
        assert ckpt.load_latest(state) == 1
    _assert_restored(state, 1)
    events = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    skipped = {e["data"]["file"]: e for e in events if e["kind"] == "CheckpointSkipped"}
    assert set(skipped) == {str(foreign), str(truncated), str(garbage)}
    assert "belongs to job 'job-b'" in skipped[str(foreign)]["data"]["reason"]
    assert skipped[str(foreign)]["data"]["step"] == 2
    assert "data has 10 bytes" in skipped[str(truncated)]["data"]["reason"]
    assert skipped[str(truncated)]["data"]["step"] == 3
    assert "unreadable meta" in skipped[str(garbage)]["data"]["reason"]
    assert skipped[str(garbage)]["data"]["step"] is None
    assert all(e["data"]["tier"] == "memory" for e in skipped.values())
    assert str(garbage) in skipped[str(garbage)]["message"]
