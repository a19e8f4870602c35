"""A worker's stdout or stderr file, read by the agent's tailer and kept small on disk.

The worker appends to the file through its own ``O_APPEND`` descriptor; the agent cannot
reopen it or make it block. So the tailer, once it has read a part, gives that part's disk
space back:

- by punching it out (``fallocate(FALLOC_FL_PUNCH_HOLE)``: ext4, xfs, btrfs, tmpfs). Nothing
  the worker writes is lost; the file keeps its length (a hole where the read part was,
  read back as zero bytes) while its blocks are freed. A finished worker's file is then
  truncated (nobody writes to it any more).
- where the filesystem cannot punch, by truncating the file to 0 once the tailer has caught
  up with the writer (the worker's next write lands at offset 0). A write that lands between
  the tailer's last look at the size and the truncate is lost: a few microseconds, and only
  for a stream that wrote more than the trim size.

A worker that writes faster than the tailer reads has all but the newest part of its
unread output skipped (:meth:`Spool.skip`): disk use stays bounded, and the newest lines
(a traceback at the end of a flood) are kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Final, cast

__all__ = ["Spool", "punch_hole"]

logger = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02
_NEWLINE_WITHIN: Final = 1024 * 1024  # a skip ends at a line start found this close


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        function = libc.fallocate
    except (OSError, AttributeError):  # not Linux / glibc
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


_FALLOCATE = _fallocate()


def punch_hole(fd: int, length: int) -> bool:
    """Free the disk blocks of ``fd``'s first ``length`` bytes, keeping its size and its
    later bytes where they are; False where the filesystem (or the OS) cannot."""
    if _FALLOCATE is None or length <= 0:
        return _FALLOCATE is not None
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    return _FALLOCATE(fd, mode, 0, length) == 0


class Spool:
    """One worker stream file, followed from its start (see the module docstring).

    ``trim``: read bytes are given back once this many have piled up; ``max_unread``: an
    unread backlog past this is skipped but for its newest ``tail`` bytes.
    """

    def __init__(self, path: Path, *, trim: int, max_unread: int, tail: int) -> None:
        self.path = path
        self.trim = trim
        self.max_unread = max_unread
        self.tail = tail
        self.file: BinaryIO | None = None
        self._freed = 0  # bytes before this offset have been given back
        self._can_punch = True
        self._writable = True

    def open(self) -> bool:
        """Open the file if it exists (never creates it); whether it is open."""
        if self.file is None:
            try:
                # Read-write: truncating needs it; the worker's descriptor is its own.
                self.file = open(self.path, "r+b", buffering=0)  # noqa: SIM115
            except PermissionError:
                self._writable = self._can_punch = False
                try:
                    self.file = open(self.path, "rb", buffering=0)  # noqa: SIM115
                except FileNotFoundError:
                    return False
            except FileNotFoundError:
                return False
        return True

    def read(self, size: int) -> bytes:
        assert self.file is not None
        return self.file.read(size)

    def unread(self) -> int:
        """Bytes written and not read yet (from the file's size)."""
        assert self.file is not None
        size = os.fstat(self.file.fileno()).st_size
        position = self.file.tell()
        if size < position:  # truncated by someone else: read it again from the start
            self.file.seek(0)
            self._freed = 0
            return size
        return size - position

    def release(self) -> None:
        """Give back the disk space of what has been read, once ``trim`` bytes piled up."""
        if self.file is None or not self._writable:
            return
        position = self.file.tell()
        if position - self._freed < self.trim:
            return
        if self._can_punch:
            if punch_hole(self.file.fileno(), position):
                self._freed = position
                return
            self._can_punch = False
            logger.info("%s: cannot punch holes; truncating it when read instead", self.path)
        if self.unread() == 0:
            self._truncate()  # a write landing just now is lost (see the module docstring)

    def skip(self) -> tuple[int, bytes]:
        """Skip the unread backlog but its newest ``tail`` bytes (from a line's start);
        returns how many bytes were skipped, and, where the file had to be truncated to
        free them, the kept bytes (else the file position is at them)."""
        assert self.file is not None
        fd = self.file.fileno()
        position = self.file.tell()
        size = os.fstat(fd).st_size
        start = max(position, size - self.tail)
        head = os.pread(fd, min(self.tail, _NEWLINE_WITHIN), start)
        newline = head.find(b"\n")
        if start > position and newline >= 0:
            start += newline + 1  # the line cut by ``start`` goes with the skipped part
        if self._can_punch and self._writable and punch_hole(fd, start):
            self.file.seek(start)
            self._freed = start
            return start - position, b""
        self._can_punch = False
        kept = os.pread(fd, size - start, start)
        self._truncate()  # what lands between the two reads and this is lost
        return start - position, kept

    def finish(self, keep_up_to: int) -> None:
        """The worker is gone and every byte is read: truncate the file past
        ``keep_up_to`` bytes (all of it is in the rank's log), and close it."""
        if self.file is None:
            return
        if self.file.tell() > keep_up_to:
            self._truncate()
        self.file.close()
        self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def _truncate(self) -> None:
        if self.file is None or not self._writable:
            return
        try:
            os.ftruncate(self.file.fileno(), 0)
        except OSError as exc:
            self._writable = False
            logger.warning("cannot truncate %s (%s); it grows unbounded", self.path, exc)
            return
        self.file.seek(0)
        self._freed = 0
