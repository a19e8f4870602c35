"""A resilient worker sees a new attempt (and a spare its assignment) as the file is
renamed into place, where inotify is there: long before its poll interval would."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.filewatch import DirWatch
from trainguard.resilient.identity import resolve_identity
from trainguard.resilient.protocol import (
    ATTEMPT_ENV,
    SPARE_ID_ENV,
    ResilientAttempt,
    SpareAssignment,
    write_attempt,
    write_spare,
)
from trainguard.resilient.watcher import AttemptWatcher

NEVER = 120.0  # a poll interval no test waits out: only the inotify wake can be in time
PATIENCE = 30.0  # generous: shared, noisy machines


def _attempt(number: int) -> ResilientAttempt:
    return ResilientAttempt(
        attempt=number,
        master_addr="127.0.0.1",
        master_port=29500,
        world_size=2,
        barrier_timeout_seconds=60.0,
    )


def _forget_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_identity sets these in os.environ: restored after the test. (delenv alone
    records nothing for a name that is not set, and the value set later would leak.)"""
    for name in ("RANK", "ROLE_RANK", "LOCAL_RANK", ATTEMPT_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def inotify(tmp_path: Path) -> None:
    watch = DirWatch.open([tmp_path])
    if watch is None:
        pytest.skip("inotify is not available here")
    watch.close()


@pytest.fixture
def watcher_parts(tmp_path: Path) -> Iterator[tuple[AttemptWatcher, list[int]]]:
    aborted: list[int] = []
    write_attempt(tmp_path, _attempt(0))
    watcher = AttemptWatcher(tmp_path, NEVER, aborted.append)
    try:
        yield watcher, aborted
    finally:
        watcher.stop()


@pytest.mark.usefixtures("inotify")
def test_a_newer_attempt_aborts_the_armed_one_as_it_is_written(
    tmp_path: Path, watcher_parts: tuple[AttemptWatcher, list[int]]
) -> None:
    watcher, aborted = watcher_parts
    assert watcher.wait_newer_than(-1, PATIENCE)  # attempt 0, read at the start
    watcher.arm(0)
    assert not watcher.wait_newer_than(0, 0.2)
    threading.Timer(0.1, write_attempt, (tmp_path, _attempt(1))).start()
    assert watcher.wait_newer_than(0, PATIENCE)
    deadline = time.monotonic() + PATIENCE
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted == [0]  # once, with the attempt it was armed for
    write_attempt(tmp_path, _attempt(2))  # disarmed by the abort: no second call
    assert watcher.wait_newer_than(1, PATIENCE)
    assert aborted == [0]


def test_without_inotify_the_file_is_polled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DirWatch, "open", classmethod(lambda cls, dirs: None))
    aborted: list[int] = []
    write_attempt(tmp_path, _attempt(0))
    watcher = AttemptWatcher(tmp_path, 0.02, aborted.append)
    try:
        watcher.arm(0)
        write_attempt(tmp_path, _attempt(1))
        assert watcher.wait_newer_than(0, PATIENCE)
    finally:
        watcher.stop()
    assert aborted == [0]


@pytest.mark.usefixtures("inotify")
def test_stop_wakes_the_watcher_at_once(tmp_path: Path) -> None:
    watcher = AttemptWatcher(tmp_path, NEVER, lambda attempt: None)
    began = time.monotonic()
    watcher.stop()
    assert time.monotonic() - began < PATIENCE


@pytest.mark.usefixtures("inotify")
def test_a_spare_takes_its_assignment_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SPARE_ID_ENV, "0")
    _forget_identity(monkeypatch)
    assignment = SpareAssignment(rank=3, local_rank=1, attempt=4)
    threading.Timer(0.1, write_spare, (tmp_path, 0, assignment)).start()
    identity = resolve_identity(tmp_path, NEVER)
    assert (identity.rank, identity.local_rank, identity.first_attempt) == (3, 1, 4)
    assert identity.spare_id == 0


def test_a_spare_without_inotify_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DirWatch, "open", classmethod(lambda cls, dirs: None))
    monkeypatch.setenv(SPARE_ID_ENV, "1")
    _forget_identity(monkeypatch)
    threading.Timer(
        0.1, write_spare, (tmp_path, 1, SpareAssignment(rank=2, local_rank=0, attempt=1))
    ).start()
    assert resolve_identity(tmp_path, 0.02).rank == 2
