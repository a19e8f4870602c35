"""How long checkpoint saves block training, told to the job's timeline in batches.

Rank 0 reports its saves' blocking times as one ``CheckpointSaved`` worker event at most
every :data:`REPORT_EVERY` seconds (and on close): a save every step would otherwise be
an event every step. The metrics turn each batch into histogram observations
(``trainguard_checkpoint_save_blocking_seconds``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from trainguard.control.events import EventKind
from trainguard.monitor import worker_events

__all__ = ["REPORT_EVERY", "SaveTimes"]

REPORT_EVERY = 10.0
MAX_BATCH = 256  # saves per event (beyond: the newest are kept)


class SaveTimes:
    """Collects one rank's save blocking times; reports them when ``enabled`` (rank 0)."""

    def __init__(
        self, enabled: bool, tier: str = "memory", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.enabled = enabled
        self.tier = tier
        self._clock = clock
        self._seconds: list[float] = []
        self._saves = 0
        self._step: int | None = None
        self._reported_at = clock()

    def add(self, step: int, seconds: float) -> None:
        if not self.enabled:
            return
        self._saves += 1
        self._step = step
        self._seconds = [*self._seconds[-(MAX_BATCH - 1) :], round(seconds, 6)]
        if self._clock() - self._reported_at >= REPORT_EVERY:
            self.flush()

    def flush(self) -> None:
        """Report what was collected since the last report (nothing when nothing was)."""
        self._reported_at = self._clock()
        if not self._seconds:
            return
        times, saves, self._seconds, self._saves = self._seconds, self._saves, [], 0
        worker_events.emit(
            EventKind.CHECKPOINT_SAVED,
            f"{saves} {self.tier} checkpoint saves up to step {self._step}: training blocked "
            f"{statistics.median(times):.3f} s (median), {max(times):.3f} s at most",
            tier=self.tier,
            step=self._step,
            saves=saves,
            blocking_seconds=times,
        )
