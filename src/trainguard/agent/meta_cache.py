"""Memory-tier metas (small JSON files) read again only when their file changed.

The agent looks at its memory tier's metas often: the replica pusher on every commit,
the status on every poll. A meta is written whole and renamed in (a new file each
time), so a meta whose inode, mtime and size are those of the last read is the one
read: a ``stat`` answers for it, not an open, a read and a parse. Callers get the
parsed value itself: they must not change it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["MetaCache"]

Version = tuple[int, int, int]
"""A file's (inode, mtime in ns, size)."""


def _version(st: os.stat_result) -> Version:
    return st.st_ino, st.st_mtime_ns, st.st_size


class MetaCache:
    """The parsed JSON of the files it was asked for, by path (each caller names a file
    one way: a string or a :class:`~pathlib.Path`), and their versions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str | Path, tuple[Version, Any]] = {}

    def read(self, path: str | Path) -> tuple[os.stat_result, Any]:
        """``path``'s status and parsed JSON (its version's: read under one open file).
        :class:`OSError` when it cannot be read, :class:`ValueError` when not JSON."""
        st = os.stat(path)
        with self._lock:
            hit = self._held.get(path)
        if hit is not None and hit[0] == _version(st):
            return st, hit[1]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            value = json.loads(_read_all(fd, st.st_size))
        finally:
            os.close(fd)
        with self._lock:
            self._held[path] = (_version(st), value)
        return st, value

    def forget_except(self, paths: set[str] | set[Path]) -> None:
        """Drop what is held of files not in ``paths`` (those gone from a scan)."""
        with self._lock:
            for path in self._held.keys() - paths:
                del self._held[path]


def _read_all(fd: int, size: int) -> bytes:
    """Every byte of the file ``fd`` (``size`` of them, as it said)."""
    chunks = []
    while chunk := os.read(fd, max(size + 1, 4096)):
        chunks.append(chunk)
    return b"".join(chunks)
