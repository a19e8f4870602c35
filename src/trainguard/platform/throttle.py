"""How many worker lines ``trainguard run`` copies to the terminal.

Every rank's lines reach the terminal through the runner, and a terminal is slow: a rank
that prints 40 MB would hold the runner (and, through the agents' pipes, their log
readers) for as long as the terminal takes to scroll it. The terminal gets a token bucket
of lines; what it does not get is counted and said now and then
(``[trainguard] 12345 lines not shown; see trainguard logs JOB``). The files (console.log,
each rank's log) still get every line, within their caps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

__all__ = ["BURST_LINES", "LINES_PER_SECOND", "NOTE_EVERY_SECONDS", "LineThrottle"]

LINES_PER_SECOND: Final = 200.0
"""Lines a second the terminal gets once a burst is spent."""
BURST_LINES: Final = 1000
"""Lines the terminal gets at once (a start's warnings from every rank, a traceback)."""
NOTE_EVERY_SECONDS: Final = 2.0
"""How often, at most, the count of lines not shown is said."""


class LineThrottle:
    """A token bucket of lines, and the count of lines it held back.

    Not thread-safe: the runner calls it under its output lock.
    """

    def __init__(
        self,
        rate: float = LINES_PER_SECOND,
        burst: int = BURST_LINES,
        note_every: float = NOTE_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not rate > 0 or burst < 1 or not note_every >= 0:
            raise ValueError(f"bad throttle: rate={rate!r} burst={burst!r} every={note_every!r}")
        self.rate = rate
        self.burst = burst
        self.note_every = note_every
        self._clock = clock
        self._tokens = float(burst)
        self._filled_at = clock()
        self._held = 0  # lines held back since the last note
        self.held_total = 0  # lines held back in all
        self._noted_at = self._filled_at

    def admit(self) -> bool:
        """Whether the next line goes to the terminal (False: it is counted instead)."""
        return self.admit_many(1) == 1

    def admit_many(self, lines: int) -> int:
        """How many of the next ``lines`` lines go to the terminal, the first ones (the
        rest are counted instead)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._filled_at) * self.rate)
        self._filled_at = now
        admitted = min(lines, int(self._tokens))
        self._tokens -= admitted
        self._held += lines - admitted
        self.held_total += lines - admitted
        return admitted

    def note_due(self, final: bool = False) -> int:
        """Lines held back since the last note, when a note is due (at most every
        ``note_every`` seconds, or ``final``), else 0; the count restarts after a note."""
        now = self._clock()
        if self._held == 0 or (not final and now - self._noted_at < self.note_every):
            return 0
        held, self._held, self._noted_at = self._held, 0, now
        return held
