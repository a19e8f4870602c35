"""Log files with a size cap: rotated, the newest few old ones kept, so disk use is bounded.

Two ways, by who writes the file:

- a file this process writes (each rank's ``rank-{R}.log``, written by the agent's log
  tailer; the job's ``console.log``, written by ``trainguard run``): :class:`RotatingFile`
  renames it to ``NAME.1`` (``NAME.1`` to ``NAME.2``, ...) before a write would take it
  past the cap, and opens a new one. Nothing is lost.
- a file another process holds open with ``O_APPEND`` (the agent's own log, its stderr,
  opened by ``trainguard run``): :func:`copy_truncate` copies it to ``NAME.1`` and
  truncates it in place; the writer's next write lands at the new end, offset 0. A write
  that falls between the copy and the truncate is lost; :class:`CappedStderrHandler` does
  both under the logging lock, so only output that bypasses ``logging`` can fall there.

Either way a file and its ``keep`` rotations hold at most ``max_bytes * (keep + 1)``
bytes (plus one write, for a single write bigger than the cap). The raw per-attempt
stdout/stderr files of the workers are a spool that the tailer empties as it reads
(:mod:`trainguard.agent.logs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import BinaryIO, Final

from trainguard.wire.logs import LogLimits

__all__ = [
    "AGENT_LOG_LIMITS",
    "CappedStderrHandler",
    "RotatingFile",
    "copy_truncate",
    "rotated",
    "shift_rotations",
]

AGENT_LOG_LIMITS: Final = LogLimits(max_bytes_per_rank=16 * 1024 * 1024, keep=1)
"""The agent's own log (its stderr): rotated at 16 MiB, one old file kept."""


def rotated(path: Path, index: int) -> Path:
    """``path``'s ``index``-th rotation: ``NAME.1`` is the newest."""
    return path.with_name(f"{path.name}.{index}")


def shift_rotations(path: Path, keep: int) -> None:
    """Make room for a new ``NAME.1``: ``NAME.i`` becomes ``NAME.i+1`` and the oldest
    past ``keep`` is removed. ``path`` itself is left where it is."""
    rotated(path, keep).unlink(missing_ok=True)
    for index in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(rotated(path, index), rotated(path, index + 1))


class RotatingFile:
    """A binary log file this process appends to, rotated by rename at ``max_bytes``.

    Thread-safe; :meth:`write` writes through its buffer, :meth:`flush` to the file.
    """

    def __init__(self, path: Path, limits: LogLimits) -> None:
        self.path = path
        self.max_bytes = limits.max_bytes_per_rank
        self.keep = limits.keep
        self._lock = threading.Lock()
        self._file = self._open()
        self._size = os.fstat(self._file.fileno()).st_size

    def _open(self) -> BinaryIO:
        return open(self.path, "ab")  # closed by close() or the next rotation

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._size > 0 and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._size += len(data)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        if self.keep > 0:
            shift_rotations(self.path, self.keep)
            os.replace(self.path, rotated(self.path, 1))
        else:
            self.path.unlink(missing_ok=True)
        self._file = self._open()
        self._size = 0


def copy_truncate(path: Path, keep: int) -> None:
    """Rotate a file that another process appends to (``O_APPEND``): copy it to ``NAME.1``
    (``keep`` > 0), then truncate it to 0 in place. Writes between the two are lost."""
    if keep > 0:
        shift_rotations(path, keep)
        shutil.copyfile(path, rotated(path, 1))
    os.truncate(path, 0)


class CappedStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Logging to stderr that keeps stderr's file (when it is one) under ``limits``: past
    the cap, the file is copied to ``NAME.1`` and truncated, under the handler's lock.

    Where stderr is not a regular file (a terminal, a pipe, a container's log), it only
    logs: whoever reads it bounds it.
    """

    def __init__(self, limits: LogLimits = AGENT_LOG_LIMITS) -> None:
        import sys  # the stream at construction time, as logging.StreamHandler does

        super().__init__(sys.stderr)
        self._limits = limits
        self._path = _regular_file_of(2)

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if self._path is None:
            return
        try:
            if os.fstat(2).st_size > self._limits.max_bytes_per_rank:
                copy_truncate(self._path, self._limits.keep)
        except OSError:
            self._path = None  # cannot rotate it: stop trying, keep logging


def _regular_file_of(fd: int) -> Path | None:
    """The path of the regular file open on ``fd`` (Linux), else None."""
    try:
        if not os.path.isfile(f"/proc/self/fd/{fd}"):
            return None
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
