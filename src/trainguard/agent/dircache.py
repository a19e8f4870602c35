"""What a reader makes of a directory of small files, read again only once it may differ.

Every status the agent serves carries what its workers left in two directories (their
heartbeats, their events), and the controller asks twice a second while most of the
time nothing there has changed. :class:`DirCache` keeps the last result with a stamp of
the directory and of each file in it (modification and change times, size, inode):

- a file created, removed or renamed into place (a heartbeat) changes the directory's
  stamp; a line appended (an event) changes its file's;
- a stamp less than :data:`RACY_SECONDS` old is not trusted (a file system's clock is
  coarse: a write within the same tick as the read would leave it unchanged), so a
  directory written to just now is read every time, as before.

It is safe from several threads (a result is replaced whole); a directory that cannot be
listed is handed to the reader as it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["RACY_SECONDS", "DirCache"]

RACY_SECONDS = 0.1
"""A stamp younger than this may hide a change made in the same clock tick."""

T = TypeVar("T")
_Stamp = tuple[int, int, int, int]


class DirCache(Generic[T]):
    """``read(directory)``, cached while the directory's stamps stay the same."""

    def __init__(self, read: Callable[[Path], T]) -> None:
        self._read = read
        # (directory, its stamp, its names, their stamps, what read made of it)
        self._last: tuple[Path, _Stamp, tuple[str, ...], tuple[_Stamp | None, ...], T] | None
        self._last = None

    def get(self, directory: Path) -> T:
        last = self._last
        stamp = _stamp(directory)
        if stamp is None:
            return self._read(directory)
        if last is not None and last[0] == directory and last[1] == stamp:
            names = last[2]
        else:
            try:
                names = tuple(sorted(os.listdir(directory)))
            except OSError:
                return self._read(directory)
        stamps = tuple(_stamp(directory / name) for name in names)
        if last is not None and (last[0], last[1], last[2], last[3]) == (
            directory,
            stamp,
            names,
            stamps,
        ):
            return last[4]
        value = self._read(directory)
        racy = time.time_ns() - int(RACY_SECONDS * 1e9)
        if max(max(s[0], s[1]) for s in (stamp, *(s for s in stamps if s is not None))) < racy:
            self._last = (directory, stamp, names, stamps, value)
        else:
            self._last = None
        return value


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
