"""The tailer's wait for a change (inotify): it wakes on a write, a new file or a poke,
and sleeps otherwise; the checksum that pauses between chunks gives the one-call digest."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from trainguard.agent.filewatch import DirWatch
from trainguard.checkpoint.files import CHECKSUM_CHUNK, checksum


def test_a_write_a_new_file_and_a_poke_wake_the_waiter_and_nothing_else_does(
    tmp_path: Path,
) -> None:
    watch = DirWatch.open([tmp_path])
    if watch is None:
        pytest.skip("inotify is not available here")
    try:
        assert watch.wait(0.05) == (False, False)  # nothing happened: the timeout
        (tmp_path / "stdout.log").write_bytes(b"a line\n")  # a new file
        assert watch.wait(5.0) == (True, False)
        with open(tmp_path / "stdout.log", "ab") as file:  # a write to it
            file.write(b"another\n")
        assert watch.wait(5.0)[0]
        assert watch.wait(0.05) == (False, False)  # the events were drained
        threading.Timer(0.05, watch.poke).start()
        began = time.monotonic()
        assert watch.wait(5.0) == (False, True)
        assert time.monotonic() - began < 4.0
    finally:
        watch.close()
    watch.poke()  # after close: a no-op, no error


def test_a_directory_that_does_not_exist_cannot_be_watched(tmp_path: Path) -> None:
    assert DirWatch.open([tmp_path / "missing"]) is None


def test_a_checksum_in_chunks_with_pauses_is_the_one_call_checksum() -> None:
    data = os.urandom(2 * CHECKSUM_CHUNK + 12345)
    pauses: list[int] = []
    assert checksum(data, lambda: pauses.append(1)) == checksum(data)
    assert len(pauses) == 3
    assert checksum(b"small", lambda: pauses.append(1)) == checksum(b"small")
