"""Whether the agent's controller is alive, and how long it has been gone.

A node agent outlives its controller for a grace period: a ``trainguard run`` killed
with SIGKILL (or a crashed one) leaves its agents and their workers training, so that
``trainguard resume`` can re-attach to them with no restart and no lost step. The agent
starts out watching its parent (the controller that launched it); ``POST /attach``
hands it to the controller that resumed the job. A controller is a pid *and* its start
time (``/proc/<pid>/stat`` field 22), so a reused pid is not mistaken for it.

When the controller has been gone for ``grace`` seconds with nobody attaching,
:meth:`ControllerWatch.expired` says why, and the agent shuts its workers down and
exits. A grace of 0 is the old behaviour: the agent dies with its parent
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from trainguard.platform.procs import proc_stat

__all__ = ["ControllerWatch", "start_ticks"]


def start_ticks(pid: int) -> int | None:
    """``pid``'s start time in clock ticks after boot; None when there is no such process."""
    stat = proc_stat(pid)
    return None if stat is None else stat[1]


class ControllerWatch:
    """See the module docstring. Thread-safe: the API attaches, the main loop checks."""

    def __init__(self, pid: int, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._pid, self._start = pid, start_ticks(pid)
        self._gone_since: float | None = None

    @property
    def pid(self) -> int:
        with self._lock:
            return self._pid

    def attach(self, pid: int, start: int | None) -> None:
        """A controller took the job over (``POST /attach``)."""
        with self._lock:
            self._pid, self._start = pid, start
            self._gone_since = None

    def alive(self) -> bool:
        with self._lock:
            pid, start = self._pid, self._start
        now_start = start_ticks(pid)
        return now_start is not None and (start is None or now_start == start)

    def expired(self) -> str | None:
        """Why the agent should shut down (its controller is gone, grace over), or None."""
        alive = self.alive()
        with self._lock:
            if alive:
                self._gone_since = None
                return None
            now = self._clock()
            if self._gone_since is None:
                self._gone_since = now
            if now - self._gone_since < self.grace:
                return None
            return (
                f"controller (pid {self._pid}) gone for {now - self._gone_since:.0f} s and "
                f"nobody attached within the grace period ({self.grace:g} s)"
            )

    def gone_for(self) -> float | None:
        """Seconds since the controller was first seen gone (None: it is alive)."""
        with self._lock:
            return None if self._gone_since is None else self._clock() - self._gone_since
