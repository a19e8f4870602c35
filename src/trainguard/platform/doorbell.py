"""A job's doorbell: another process tells the job's controller to read its asks now.

A controller with nothing in motion turns every 2 s (quiet polls, :mod:`trainguard.control.pace`),
and it reads the asks another terminal writes to the store (``trainguard stop``,
``delete``, ``scale``, ``node replace``) at its turns. The store rings the job's
doorbell when it commits an ask (``Store.request``, ``set_capacity``,
``request_replace``): a named pipe (FIFO) ``doorbell`` in the job's directory, which the
controller holds open. A byte in it wakes the drive loop, which reads the asks from
the store as at any turn. The byte says nothing else, so nothing in it is trusted: it
costs a turn at most. The directory is the job's (private), and only its owner can ring.
With no controller holding the doorbell (the job ended; it has none yet), a ring finds
no reader and does nothing: the ask waits in the store for the next controller.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["DOORBELL", "Doorbell", "ring"]

logger = logging.getLogger(__name__)

DOORBELL = "doorbell"
"""The doorbell's name in the job's directory."""


def ring(job_dir: Path) -> bool:
    """Ring the doorbell of the job in ``job_dir``; whether a controller holds it."""
    try:  # no reader: ENXIO; no doorbell: ENOENT; something else there: not a FIFO
        fd = os.open(job_dir / DOORBELL, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        with contextlib.suppress(BlockingIOError):  # full: it is ringing already
            os.write(fd, b"!")
        return True
    finally:
        os.close(fd)


class Doorbell:
    """The controller's end: a thread that waits on the FIFO and calls ``on_ring`` for
    each ring (a burst of rings: once or a few times)."""

    def __init__(self, path: Path, fd: int, on_ring: Callable[[], None]) -> None:
        self.path = path
        self._fd = fd
        self._on_ring = on_ring
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tg-doorbell", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, job_dir: Path, on_ring: Callable[[], None]) -> Doorbell | None:
        """The doorbell in ``job_dir`` (made if missing; one left by a controller before
        is taken over); None, with a debug line, where a FIFO cannot be made or opened
        (the asks are then read at the loop's turns only)."""
        path = job_dir / DOORBELL
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(path, 0o600)
            # Read and write: the FIFO then never reads as ended between two rings.
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            logger.debug("no doorbell at %s (%s): asks are read at each turn", path, exc)
            return None
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            logger.debug("no doorbell: %s is not a FIFO", path)
            return None
        return cls(path, fd, on_ring)

    def close(self) -> None:
        """Stop answering and remove the doorbell (a later ring does nothing)."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.write(self._fd, b"!")  # wakes the thread's read, which sees it closing
        self._thread.join(5.0)
        if not self._thread.is_alive():
            os.close(self._fd)

    def _run(self) -> None:
        while True:
            try:
                os.read(self._fd, 4096)
            except OSError as exc:
                logger.debug("doorbell %s: %s", self.path, exc)
                return
            if self._closing:
                return
            self._on_ring()
