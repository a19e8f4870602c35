"""The job's doorbell (platform/doorbell.py): an ask written by another terminal wakes the
controller's loop at once, and a ring with no controller to hear it does nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainguard.platform.book import ReportBook
from trainguard.platform.doorbell import DOORBELL, Doorbell, ring


def test_a_ring_wakes_the_loop_and_a_closed_doorbell_is_gone(tmp_path: Path) -> None:
    book = ReportBook()
    bell = Doorbell.open(tmp_path, book.wake)
    assert bell is not None
    assert stat.S_ISFIFO((tmp_path / DOORBELL).stat().st_mode)
    assert not book.wait(0)
    assert ring(tmp_path)
    assert book.wait(60), "the ring did not wake the loop"  # woken, not timed out
    for _ in range(3):  # a burst of rings: the loop looks again, no more is owed
        ring(tmp_path)
    bell.close()
    assert not (tmp_path / DOORBELL).exists()
    assert not ring(tmp_path)


def test_a_ring_without_a_controller_does_nothing(tmp_path: Path) -> None:
    assert not ring(tmp_path)  # no doorbell
    assert not ring(tmp_path / "missing")  # no job directory
    os.mkfifo(tmp_path / DOORBELL, 0o600)  # left by a controller that died
    assert not ring(tmp_path)  # no reader: does not block, writes nothing


def test_a_new_controller_takes_over_a_doorbell_left_behind(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / DOORBELL, 0o600)
    book = ReportBook()
    bell = Doorbell.open(tmp_path, book.wake)
    assert bell is not None
    try:
        assert ring(tmp_path) and book.wait(60)
    finally:
        bell.close()


def test_no_doorbell_where_something_else_has_its_name(tmp_path: Path) -> None:
    (tmp_path / DOORBELL).write_text("not a pipe")
    assert Doorbell.open(tmp_path, lambda: None) is None
    assert not ring(tmp_path)
    assert (tmp_path / DOORBELL).read_text() == "not a pipe"  # left as it was
    (tmp_path / DOORBELL).unlink()
    (tmp_path / DOORBELL).symlink_to(tmp_path / "elsewhere")
    assert Doorbell.open(tmp_path, lambda: None) is None  # a link is not followed
    assert Doorbell.open(tmp_path / "missing", lambda: None) is None
