"""A full memory tier (ENOSPC) is no reason to crash the worker (issue 38): every restart
used to fail on the same error in seconds. The save is skipped, loudly, and the tier is
tried again later (checkpoint/room.py). A real 1 MiB tmpfs plays the full /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import Checkpointer, room

FILLER = 200 * 1024  # with one 400 KB snapshot's slot there is no room for a second


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "shm"
    mount.mkdir()
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _events(directory: Path) -> list[dict[str, object]]:
    path = directory / "rank-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_full_memory_tier_skips_saves_and_training_goes_on(
    small_shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events"
    events.mkdir()
    monkeypatch.setenv("TRAINGUARD_EVENT_DIR", str(events))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(room, "RETRY_SECONDS", 2.0)
    filler = small_shm / "filler"
    filler.write_bytes(b"x" * FILLER)
    tier = str(small_shm / "tier")
    state = {"w": torch.arange(100_000, dtype=torch.float32)}  # 400 KB
    with Checkpointer(memory_dir=tier, job_id="full", memory_keep=2, environ={}) as ckpt:
        assert ckpt.save(1, state)  # the first slot fits
        ckpt.wait()
        assert not ckpt.save(2, state)  # the second does not: skipped, not raised
        [full] = [e for e in _events(events) if e["kind"] == "CheckpointMemoryFull"]
        assert "is full (ENOSPC: cannot allocate" in str(full["message"])
        assert full["data"] == {  # type: ignore[comparison-overlap]
            "step": 2,
            "directory": tier,
            "error": full["data"]["error"],  # type: ignore[index]
        }
        assert not ckpt.save(3, state)  # not tried again before the retry time
        time.sleep(2.1)
        assert not ckpt.save(4, state)  # tried again: still full, no second event
        assert len([e for e in _events(events) if e["kind"] == "CheckpointMemoryFull"]) == 1
        filler.unlink()  # room again
        time.sleep(2.1)
        assert ckpt.save(5, state)
        ckpt.wait()
    # A restart keeping 3 snapshots: the restore works; readying the third slot after it
    # meets no room, and that is no crash.
    restored = {"w": torch.zeros(100_000)}
    with Checkpointer(memory_dir=tier, job_id="full", memory_keep=3, environ={}) as ckpt:
        assert ckpt.load_latest(restored) == 5
        assert torch.equal(restored["w"], state["w"])
        assert not ckpt.save(6, state)
