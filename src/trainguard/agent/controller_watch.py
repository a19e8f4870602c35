"""Whether the agent's controller is alive, and how long it has been gone.

A node agent outlives its controller for a grace period: a ``trainguard run`` killed
with SIGKILL (or a crashed one) leaves its agents and their workers training, so that
``trainguard resume`` can re-attach to them with no restart and no lost step. The agent
starts out watching its parent (the controller that launched it); ``POST /attach``
hands it to the controller that resumed the job. A controller is a pid *and* its start
time (``/proc/<pid>/stat`` field 22), so a reused pid is not mistaken for it; one that
has ended but is not reaped yet (a zombie) is gone.

When the controller has been gone for ``grace`` seconds with nobody attaching,
:meth:`ControllerWatch.expired` says why, and the agent shuts its workers down and
exits. A grace of 0 is the old behaviour: the agent dies with its parent
(``PR_SET_PDEATHSIG``).

Nothing here ticks: :meth:`ControllerWatch.wait` sleeps on a pidfd of the controller
(Linux 5.3 and later), so the controller's end is seen the moment it happens, an
attach wakes the sleeper at once, and a live controller costs no wake-up at all. Only
where a pidfd cannot be had does it look every :data:`POLL_INTERVAL`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from trainguard.platform.procs import proc_stat
from trainguard.wakeup import Wakeup

__all__ = ["ENDED", "POLL_INTERVAL", "ControllerWatch", "start_ticks"]

ENDED = frozenset("ZX")
"""``/proc/<pid>/stat`` states of a process that has ended (not yet reaped, or being)."""
POLL_INTERVAL = 0.2
"""Seconds between looks at the controller where no pidfd tells of its end."""


def start_ticks(pid: int) -> int | None:
    """``pid``'s start time in clock ticks after boot; None when there is no such process."""
    stat = proc_stat(pid)
    return None if stat is None else stat[1]


class ControllerWatch:
    """See the module docstring. Thread-safe: the API attaches, the main loop checks."""

    def __init__(
        self,
        pid: int,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
        wakeup: Wakeup | None = None,
    ) -> None:
        """``wakeup``: what :meth:`wait` sleeps on (:meth:`attach` wakes it)."""
        self.grace = grace
        self.wakeup = wakeup or Wakeup()
        self._clock = clock
        self._lock = threading.Lock()
        self._pid, self._start = pid, start_ticks(pid)
        self._gone_since: float | None = None
        self._pidfd: tuple[int, int | None, int] | None = None  # (pid, start, its pidfd)

    @property
    def pid(self) -> int:
        with self._lock:
            return self._pid

    def attach(self, pid: int, start: int | None) -> None:
        """A controller took the job over (``POST /attach``)."""
        with self._lock:
            self._pid, self._start = pid, start
            self._gone_since = None
        self.wakeup.wake()

    def alive(self) -> bool:
        with self._lock:
            pid, start = self._pid, self._start
        stat = proc_stat(pid)
        if stat is None or stat[0] in ENDED:
            return False
        return start is None or stat[1] == start

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

    def wait(self, timeout: float | None = None) -> None:
        """Sleep until something :meth:`expired` answers may have changed: the
        controller's process ended, another controller attached, the grace ran out,
        :attr:`wakeup` was woken (or caught a signal), or ``timeout`` (None: no limit)."""
        with self._lock:
            pid, start, gone_since = self._pid, self._start, self._gone_since
        fds: tuple[int, ...] = ()
        if gone_since is not None:  # its pidfd stays readable: sleep out the grace
            limit: float | None = max(0.0, gone_since + self.grace - self._clock())
        elif (fd := self._fd(pid, start)) is not None:
            limit, fds = None, (fd,)
        else:
            limit = POLL_INTERVAL
        if timeout is not None:
            limit = timeout if limit is None else min(limit, timeout)
        self.wakeup.wait(limit, fds)

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd[2])
            self._pidfd = None

    def _fd(self, pid: int, start: int | None) -> int | None:
        """A pidfd of controller ``(pid, start)``, opened once (None: none can be had, or
        the pid is another process's now)."""
        if self._pidfd is not None and self._pidfd[:2] == (pid, start):
            return self._pidfd[2]
        self.close()
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None
        if start is not None and start_ticks(pid) != start:  # reused: not the controller
            os.close(fd)
            return None
        self._pidfd = (pid, start, fd)
        return fd
