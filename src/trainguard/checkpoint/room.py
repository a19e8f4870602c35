"""A full memory tier: training goes on, and the tier is tried again later.

A ``/dev/shm`` with no room left (ENOSPC, or EDQUOT) used to fail the save, so the worker
crashed, restarted, restored, failed its first save again: every restart of the budget
burnt in seconds on the same error, and the job failed with it. Room in ``/dev/shm``
is the machine's, not the training's fault, and a restart does not make any. So a
:class:`~trainguard.checkpoint.Checkpointer` whose memory tier is full does not raise:

- the save that met it returns False (no snapshot of that step), loudly: an error in
  the log and a ``CheckpointMemoryFull`` event on the job's timeline (rank, step,
  directory, the error), once per spell of no room;
- saves are not even tried for :data:`RETRY_SECONDS` (they return False at once), then
  the tier is tried again; the first save that fits ends the spell (logged);
- the snapshots already in the tier and the durable checkpoints stay as they were. The
  durable tier is written from the memory snapshots, so while the tier is full no new
  checkpoint is made: a fault then restarts the job from the newest one before.

Restoring is not affected; preparing the slots after a restore meets the same rule.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

from trainguard.control.events import EventKind
from trainguard.monitor import worker_events

__all__ = ["RETRY_SECONDS", "MemoryRoom", "no_room"]

log = logging.getLogger(__name__)

RETRY_SECONDS = 60.0
"""After the memory tier was full, saves skip it this long before it is tried again."""

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def no_room(exc: BaseException) -> bool:
    """Whether ``exc`` says the memory tier's file system has no room left."""
    return isinstance(exc, OSError) and exc.errno in _NO_ROOM


class MemoryRoom:
    """Whether this rank's memory tier is worth trying (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        rank: int,
        retry_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.retry_seconds = RETRY_SECONDS if retry_seconds is None else retry_seconds
        self._clock = clock
        self._retry_at: float | None = None  # None: no spell of no room

    @property
    def full(self) -> bool:
        """Whether saves skip the tier now (it was full less than the retry time ago)."""
        return self._retry_at is not None and self._clock() < self._retry_at

    def no_room(self, step: int | None, exc: OSError) -> None:
        """The tier had no room for ``step`` (None: preparing slots after a restore)."""
        first = self._retry_at is None
        self._retry_at = self._clock() + self.retry_seconds
        if not first:
            log.debug("memory tier %s still full: %s", self.directory, exc)
            return
        what = "slots after the restore" if step is None else f"step {step}"
        message = (
            f"rank {self.rank}: the memory tier {self.directory} is full "
            f"({errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc})"
            f": {what} not saved; training goes on without new snapshots, the tier is tried "
            f"again every {self.retry_seconds:g} s (free room in it, or lower memoryKeep)"
        )
        log.error("%s", message)
        worker_events.emit(
            EventKind.CHECKPOINT_MEMORY_FULL,
            message,
            step=step,
            directory=self.directory,
            error=str(exc),
        )

    def fits(self, step: int) -> None:
        """A save into the tier worked; ends a spell of no room."""
        if self._retry_at is not None:
            self._retry_at = None
            log.warning("rank %d: the memory tier has room again (step %d)", self.rank, step)
