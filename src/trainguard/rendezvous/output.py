"""The store service's own output (``logs/rendezvous.log``), bounded.

torch's store server writes a line to stderr for each malformed message a client sends
it, and a client can send those as fast as it likes. :func:`capture_output` puts a pipe
in place of this process's stdout and stderr (so the C++ side's lines go through it too)
and copies each line to the log the process was started with, at most one line of a
kind (the line with its digits taken out) every :data:`~trainguard.netlimits.NOTE_INTERVAL`
seconds, saying how many more there were. The log is rotated once past ``max_bytes``
(copied to ``NAME.1``, truncated): it holds at most twice that.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from trainguard.agent.logcap import _regular_file_of, copy_truncate
from trainguard.netlimits import NOTE_INTERVAL

__all__ = ["LOG_MAX_BYTES", "capture_output", "kind_of"]

LOG_MAX_BYTES = 4 << 20
MAX_LINE = 4096
_DIGITS = re.compile(rb"[0-9a-fx]*[0-9][0-9a-fx]*")


def kind_of(line: bytes) -> bytes:
    """What makes lines alike: the line without its numbers (times, ports, sizes)."""
    return _DIGITS.sub(b"#", line[:200])


def capture_output(max_bytes: int = LOG_MAX_BYTES) -> Callable[[], None]:
    """Route this process's stdout and stderr through a rate-limited, capped copier (see
    the module doc). Call once, early; call what it returns at the end, to have the last
    lines written (the process's output goes back to the log, unfiltered)."""
    sys.stdout.flush()
    sys.stderr.flush()
    target = os.dup(2)
    path = _regular_file_of(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    copier = threading.Thread(
        target=_copy, args=(read_end, target, path, max_bytes), daemon=True, name="tg-output"
    )
    copier.start()

    def finish() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(target, 1)  # the pipe's last writers gone: the copier reads to its end
        os.dup2(target, 2)
        copier.join(2.0)

    return finish


def _copy(read_end: int, target: int, path: object, max_bytes: int) -> None:
    said: dict[bytes, tuple[float, int]] = {}  # kind -> when said, how many unsaid since
    with os.fdopen(read_end, "rb") as pipe:
        for raw in iter(lambda: pipe.readline(MAX_LINE), b""):
            line = raw if raw.endswith(b"\n") else raw + b"\n"
            kind, now = kind_of(line), time.monotonic()
            when, unsaid = said.get(kind, (-float("inf"), 0))
            if now - when < NOTE_INTERVAL:
                said[kind] = (when, unsaid + 1)
                continue
            if len(said) > 4096:
                said.clear()
            said[kind] = (now, 0)
            if unsaid:
                line = line[:-1] + f" ({unsaid} more like it since)\n".encode()
            with contextlib.suppress(OSError):
                os.write(target, line)
                if path is not None and os.fstat(target).st_size > max_bytes:
                    copy_truncate(path, 1)  # type: ignore[arg-type]
