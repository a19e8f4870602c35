"""Where worker output lives, and the tailer that follows it.

Layout under the job's log directory (shared by every agent of the job on one
machine; each global rank belongs to exactly one agent at a time)::

    DIR/attempt-{n}/rank-{R}/stdout.log   what the worker wrote, per attempt
    DIR/attempt-{n}/rank-{R}/stderr.log
    DIR/attempt-{n}/rank-{R}/error.json   torch elastic's error file, if any
    DIR/rank-{R}.log                      every attempt of rank R, appended,
                                          "=== trainguard: attempt {n} ===" first

The agent's console (its stdout) gets every line of its workers as
``[rank{R}]: line``. No torch import here.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

ATTEMPT_MARKER = "=== trainguard: attempt {attempt} ==="
STREAMS = ("stdout", "stderr")

LineHook = Callable[[int, str, str, float], None]
"""``on_line(rank, stream, line, t)``: a worker line (no newline), read at unix time ``t``."""

_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class LogLayout:
    """Paths of the job's log directory ``root``."""

    root: Path

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / f"attempt-{attempt}"

    def rank_dir(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / f"rank-{rank}"

    def stdout(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "stdout.log"

    def stderr(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "stderr.log"

    def stream(self, attempt: int, rank: int, stream: str) -> Path:
        return self.rank_dir(attempt, rank) / f"{stream}.log"

    def error_file(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "error.json"

    def combined(self, rank: int) -> Path:
        """The human log of ``rank`` across all attempts."""
        return self.root / f"rank-{rank}.log"


class Console:
    """Worker lines prefixed with their rank, each in one write + flush.

    Several agents may share one terminal; whole-line writes keep their lines
    from interleaving mid-line. A broken console (closed pipe) is dropped
    silently: losing the echo must not stop the agent.
    """

    def __init__(self, stream: BinaryIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, rank: int, line: bytes) -> None:
        data = b"[rank%d]: %s\n" % (rank, line)
        with self._lock:
            if self._broken:
                return
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True


@dataclass
class _Followed:
    """One worker stream being followed."""

    local_rank: int
    rank: int
    stream: str
    path: Path
    file: BinaryIO | None = None
    pending: bytes = b""
    done: bool = False
    finishing: bool = False  # its process has exited: read to the end, then stop


class LogTailer:
    """Follows the stdout/stderr files of one attempt's workers on this node.

    Every complete line goes to the rank's combined log, to the console and to
    ``on_line``. A partial last line is held until its newline arrives, or until
    the worker is known to have exited (:meth:`finish_rank`) or the tailer is
    stopped; :meth:`stop` drains everything before it returns.
    """

    def __init__(
        self,
        layout: LogLayout,
        attempt: int,
        ranks: Mapping[int, int],
        *,
        interval: float,
        console: Console | None = None,
        on_line: LineHook | None = None,
        max_line_bytes: int = 1024 * 1024,
    ) -> None:
        """``ranks`` maps local rank -> global rank; ``interval`` is the poll period (s)."""
        self._layout = layout
        self._attempt = attempt
        self._ranks = dict(ranks)
        self.interval = interval  # may change while it runs (an armed injection reads faster)
        self._console = console
        self._on_line = on_line
        self._max_line = max_line_bytes
        self._followed = [
            _Followed(local, rank, stream, layout.stream(attempt, rank, stream))
            for local, rank in sorted(self._ranks.items())
            for stream in STREAMS
        ]
        self._combined: dict[int, BinaryIO] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hook_failed = False
        self._thread = threading.Thread(
            target=self._run, name=f"trainguard-tail-attempt-{attempt}", daemon=True
        )

    def start(self) -> None:
        """Write the attempt marker to each combined log and start following."""
        self._layout.root.mkdir(parents=True, exist_ok=True)
        marker = ATTEMPT_MARKER.format(attempt=self._attempt).encode() + b"\n"
        for rank in sorted(self._ranks.values()):
            log = open(self._layout.combined(rank), "ab")  # noqa: SIM115 - closed by _run
            log.write(marker)
            log.flush()
            self._combined[rank] = log
        self._thread.start()

    def finish_rank(self, local_rank: int) -> None:
        """The worker has exited: read its files to the end and flush its partial line."""
        with self._lock:
            for followed in self._followed:
                if followed.local_rank == local_rank:
                    followed.finishing = True

    def follow(self, local_rank: int, rank: int, paths: Mapping[str, Path]) -> None:
        """Also follow a new process of ``local_rank`` (an in-process restart's replacement)
        whose ``stdout``/``stderr`` files are ``paths``."""
        with self._lock:
            if rank not in self._combined:
                log = open(self._layout.combined(rank), "ab")  # noqa: SIM115 - closed by _run
                self._combined[rank] = log
            self._followed += [
                _Followed(local_rank, rank, stream, paths[stream]) for stream in STREAMS
            ]

    def stop(self, timeout: float) -> bool:
        """Drain every file and stop; False if the drain did not end within ``timeout``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                final = self._stop.is_set()
                self._pass(final)
                if final:
                    return
                self._stop.wait(self.interval)
        except Exception:
            logger.exception("log tailer for attempt %d failed", self._attempt)
        finally:
            for followed in self._followed:
                if followed.file is not None:
                    followed.file.close()
            for log in self._combined.values():
                log.close()

    def _pass(self, final: bool) -> None:
        with self._lock:
            followed_now = [(f, f.finishing) for f in self._followed]
        for followed, finishing in followed_now:
            if followed.done:
                continue
            ending = final or finishing
            self._read(followed, to_eof=ending)
            if ending:
                if followed.pending:
                    self._emit(followed, followed.pending)
                    followed.pending = b""
                followed.done = True
                if followed.file is not None:
                    followed.file.close()
                    followed.file = None
        with self._lock:
            logs = list(self._combined.values())
        for log in logs:
            log.flush()

    def _read(self, followed: _Followed, to_eof: bool) -> None:
        if followed.file is None:
            try:
                followed.file = open(followed.path, "rb", buffering=0)  # noqa: SIM115
            except FileNotFoundError:
                return
        budget = self._max_line * 4
        while to_eof or budget > 0:
            chunk = followed.file.read(_READ_CHUNK)
            if not chunk:
                return
            budget -= len(chunk)
            *lines, followed.pending = (followed.pending + chunk).split(b"\n")
            for line in lines:
                self._emit(followed, line)
            if len(followed.pending) > self._max_line:  # no newline in sight: cut it
                self._emit(followed, followed.pending)
                followed.pending = b""

    def _emit(self, followed: _Followed, line: bytes) -> None:
        t = time.time()
        self._combined[followed.rank].write(line + b"\n")
        if self._console is not None:
            self._console.write_line(followed.rank, line)
        if self._on_line is not None:
            try:
                self._on_line(followed.rank, followed.stream, line.decode(errors="replace"), t)
            except Exception:
                if not self._hook_failed:
                    logger.exception("on_line hook failed (further failures not logged)")
                self._hook_failed = True
