"""The agent's cache of its workers' heartbeat and event directories (issue 41): every
change is seen at the next read, however soon, and an unchanged directory is not read
again. Real files, written the way workers write them (trainguard.heartbeat renames a
file into place; a worker's events are appended lines)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trainguard.agent.dircache import RACY_SECONDS, DirCache
from trainguard.control.events import EventKind
from trainguard.monitor.heartbeat import read_heartbeats
from trainguard.monitor.worker_events import EVENT_DIR_ENV, emit, read_events


def test_changes_are_seen_at_once_and_a_quiet_directory_is_not_read_again(
    tmp_path: Path,
) -> None:
    reads: list[Path] = []

    def names(directory: Path) -> dict[str, bytes]:
        reads.append(directory)
        return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}

    cache = DirCache(names)
    assert cache.get(tmp_path) == {}
    (tmp_path / "tmp").write_bytes(b"1")
    os.rename(tmp_path / "tmp", tmp_path / "rank-0.json")  # a heartbeat, renamed in
    assert cache.get(tmp_path) == {"rank-0.json": b"1"}
    with open(tmp_path / "rank-0.json", "ab") as f:  # appended in the same instant
        f.write(b"2")
    assert cache.get(tmp_path) == {"rank-0.json": b"12"}
    (tmp_path / "rank-0.json").unlink()
    assert cache.get(tmp_path) == {}

    time.sleep(RACY_SECONDS * 2)  # no longer just written: trusted from now on
    cache.get(tmp_path)
    before = len(reads)
    assert [cache.get(tmp_path) for _ in range(3)] == [{}, {}, {}]
    assert len(reads) == before
    (tmp_path / "rank-1.json").write_bytes(b"3")
    assert cache.get(tmp_path) == {"rank-1.json": b"3"}


def test_the_workers_files_read_through_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beats, events = tmp_path / "heartbeats", tmp_path / "events"
    beats.mkdir()
    events.mkdir()
    beat_cache, event_cache = DirCache(read_heartbeats), DirCache(read_events)
    assert beat_cache.get(beats) == {} and event_cache.get(events) == []
    (beats / "tmp").write_text('{"step": 3, "time": 1.0}')
    os.rename(beats / "tmp", beats / "rank-0")
    monkeypatch.setenv(EVENT_DIR_ENV, str(events))
    monkeypatch.setenv("RANK", "1")
    emit(EventKind.CHECKPOINT_SAVED, "saved step 3", step=3)  # appended, as a worker does
    assert beat_cache.get(beats) == read_heartbeats(beats) != {}
    assert event_cache.get(events) == read_events(events) != []
    assert beat_cache.get(tmp_path / "missing") == {}
