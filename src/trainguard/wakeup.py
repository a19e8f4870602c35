"""A sleep that ends when something happens, not at the next tick: a self-pipe.

A loop that watches for rare things (a signal, its owner's exit, a request to stop)
need not wake every fraction of a second to look: :meth:`Wakeup.wait` returns once
:meth:`Wakeup.wake` was called (from any thread), a signal arrived (after
:meth:`Wakeup.catch_signals`: the main thread's ``signal.set_wakeup_fd``), one of the
given file descriptors turned readable (a pidfd: that process ended), or the timeout
passed. Its caller then looks at what may have changed; a spurious return costs one
look, never a missed event.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Sequence

__all__ = ["Wakeup"]


class Wakeup:
    """See the module docstring. :meth:`wake` is thread-safe; :meth:`wait` is for one
    thread at a time."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._signals = False
        self._closed = False

    def wake(self) -> None:
        """End the current (or the next) :meth:`wait`; nothing after :meth:`close` (its
        descriptor's number may belong to another file by then)."""
        if self._closed:
            return
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            os.write(self._write, b"w")

    def catch_signals(self) -> None:
        """A signal handled by Python ends the wait too (call from the main thread; the
        handler itself still runs, in the main thread, as usual)."""
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._signals = True

    def wait(self, timeout: float | None, fds: Sequence[int] = ()) -> tuple[bool, set[int]]:
        """Sleep until woken, a signal (if caught), one of ``fds`` readable, or ``timeout``
        seconds (None: no limit); whether it was woken (or a signal came), and which of
        ``fds`` are readable (the caller drains them)."""
        poller = select.poll()  # not select(): a busy process's descriptors pass 1024
        poller.register(self._read, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = {
            fd for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000.0)
        }
        woken = self._read in ready
        if woken:
            with contextlib.suppress(OSError):
                while os.read(self._read, 4096):
                    pass
        return woken, ready & set(fds)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._signals:
            with contextlib.suppress(ValueError):  # not the main thread: leave it
                signal.set_wakeup_fd(-1)
            self._signals = False
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
