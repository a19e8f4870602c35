"""Notice a worker's exit the moment it happens (Linux pidfds), not at the next poll.

:class:`ExitWatcher` waits on a pidfd per process in one thread and calls ``on_exit``
(which wakes the supervisor) as soon as any of them exits. The supervisor still reaps
and records exits itself (``Popen.poll``); the watcher only tells it when to look, so
a missed wake-up costs one poll interval, never an exit. Where pidfds do not exist
(not Linux, or an old kernel), :meth:`watch` does nothing and polling alone remains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["ExitWatcher"]


class ExitWatcher:
    """Calls ``on_exit()`` whenever a watched process exits; see the module docstring."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[int] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trainguard-exits", daemon=True)
        self._thread.start()

    @property
    def supported(self) -> bool:
        return hasattr(os, "pidfd_open")

    def watch(self, pid: int) -> None:
        """Watch ``pid`` (a child of this process) until it exits."""
        if not self.supported or self._closed:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._on_exit()  # already gone and reaped
            return
        except OSError as exc:  # ENOSYS on old kernels: polling alone
            logger.debug("no pidfd for %d: %s", pid, exc)
            return
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._pending.append(fd)
            with contextlib.suppress(OSError):  # full pipe: a wake-up is pending anyway
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"q")
        self._thread.join(2.0)

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        continue
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._on_exit()
                with self._lock:
                    pending, self._pending = self._pending, []
                for fd in pending:
                    self._selector.register(fd, selectors.EVENT_READ, fd)
        finally:
            with self._lock:
                self._closed = True
                for key in list(self._selector.get_map().values()):
                    if key.data is not None:
                        os.close(key.fd)
                for fd in self._pending:
                    os.close(fd)
                self._selector.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
