"""Wait until a file in some directories changes (Linux ``inotify``), or until poked.

The log tailer waits here between its passes instead of waking every few milliseconds
to look at its files' sizes: an idle node's tailer then sleeps until a worker writes. A
resilient worker waits here for its node's control files (``attempt.json``, replaced by a
rename), so that it sees a new attempt as it is written, not at its next poll.
``inotify`` is reached through ``ctypes`` (the standard library has no binding); where it
is missing (not Linux, no glibc, the watch limit reached, a directory that does not exist)
:func:`DirWatch.open` returns None and the caller polls as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from trainguard.wakeup import Wakeup

__all__ = ["COMMITS", "REREAD_SECONDS", "DirWatch"]

logger = logging.getLogger(__name__)

_IN_MODIFY: Final = 0x002
_IN_CLOSE_WRITE: Final = 0x008
_IN_MOVED_TO: Final = 0x080
_IN_CREATE: Final = 0x100
_IN_NONBLOCK: Final = os.O_NONBLOCK
_IN_CLOEXEC: Final = os.O_CLOEXEC
_MASK: Final = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
COMMITS: Final = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
"""A watch's events for files committed whole (written and closed, or renamed in) and new
files and directories, not each write (a memory tier's data is written through ``mmap``)."""
_DRAIN: Final = 64 * 1024
# A waiter's reread of what it watches when no change woke it: only in case inotify missed
# one (it does not, where the watch is set before the first read).
REREAD_SECONDS: Final = 1.0


def _libc() -> ctypes.CDLL | None:
    try:  # the process's own symbols, libc's among them (find_library runs ldconfig)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class DirWatch:
    """An ``inotify`` descriptor on some directories, and a :class:`Wakeup` for its waiter."""

    def __init__(self, fd: int, mask: int = _MASK) -> None:
        self._fd = fd
        self._mask = mask
        self._wakeup = Wakeup()
        self._closed = False

    @classmethod
    def open(cls, directories: Iterable[Path], mask: int = _MASK) -> DirWatch | None:
        """A watch on every one of ``directories`` (writes to, new files in and files
        renamed into them; ``mask``: other events, e.g. :data:`COMMITS`); None where one
        of them cannot be watched."""
        if _LIBC is None:
            return None
        fd = _LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        watch = cls(fd, mask)
        for directory in directories:
            if not watch.add(directory):
                watch.close()
                return None
        return watch

    def add(self, directory: Path) -> bool:
        """Also watch ``directory``; False where it cannot be watched."""
        assert _LIBC is not None
        if _LIBC.inotify_add_watch(self._fd, os.fsencode(directory), self._mask) < 0:
            error = ctypes.get_errno()
            logger.info("cannot watch %s (%s): polling instead", directory, os.strerror(error))
            return False
        return True

    def wait(self, timeout: float) -> tuple[bool, bool]:
        """Block up to ``timeout`` seconds until a file changed or :meth:`poke` was
        called (since the last wait); whether each happened: ``(changed, poked)``."""
        poked, ready = self._wakeup.wait(timeout, (self._fd,))
        if ready:
            try:
                while os.read(self._fd, _DRAIN):
                    pass
            except BlockingIOError:
                pass
        return bool(ready), poked

    def poke(self) -> None:
        """Wake the waiter (from another thread; nothing after :meth:`close`)."""
        self._wakeup.wake()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)
            self._wakeup.close()
