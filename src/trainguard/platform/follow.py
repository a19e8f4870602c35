"""A file another process appends to, read line by line as a stream (``tail -F``'s
reading half): a resumed controller follows what an adopted agent writes to its
orphaned console (:func:`trainguard.agent.logs.orphaned_console`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

__all__ = ["FollowedFile", "LineSource", "line_batches"]

POLL_SECONDS = 0.2


class LineSource(Protocol):
    """What a console pump reads: an agent's stdout pipe, or a followed file."""

    def readline(self) -> bytes: ...


BATCH_BYTES = 64 * 1024


def line_batches(source: LineSource, size: int = BATCH_BYTES) -> Iterator[bytes]:
    """``source``'s lines, a block of whole lines (each with its newline) at a time until
    its end: from a pipe (a source with ``read1``), the complete lines of each read of up
    to ``size`` bytes, so a burst costs its reader one wake-up and no Python per line;
    from any other source, a line at a time. A last line without a newline comes at the
    end, as it is."""
    read1 = getattr(source, "read1", None)
    if read1 is None:
        yield from iter(source.readline, b"")
        return
    pending = b""
    while chunk := read1(size):
        data = pending + chunk
        cut = data.rfind(b"\n") + 1
        pending = data[cut:]
        if cut:
            yield data[:cut]
    if pending:
        yield pending


class FollowedFile:
    """``readline()`` returns each complete line of ``path`` as it is written, waiting
    for the file to appear and to grow; ``b""`` once ``stop`` is set and the file is
    read to its end."""

    def __init__(self, path: Path, stop: threading.Event) -> None:
        self.path = path
        self._stop = stop
        self._file: BinaryIO | None = None
        self._pending = b""

    def readline(self) -> bytes:
        while True:
            if self._file is None:
                try:
                    self._file = self.path.open("rb")
                except FileNotFoundError:
                    if self._stop.wait(POLL_SECONDS):
                        return b""
                    continue
            chunk = self._file.readline()
            if chunk:
                self._pending += chunk
                if self._pending.endswith(b"\n"):
                    line, self._pending = self._pending, b""
                    return bytes(line)
                continue
            if self._stop.is_set():  # stopped, and read to the end: done
                self._file.close()
                return b""
            self._stop.wait(POLL_SECONDS)
