"""``trainguard run``'s console: what the user sees of a job in the terminal.

Two streams: ``out`` gets the workers' lines (every rank's, prefixed by its agent; a
share of them, :mod:`trainguard.platform.throttle`) and, on a terminal, the live line
(:mod:`trainguard.observe.live`); ``err`` gets the controller's ``[trainguard]`` lines.
Every worker line also goes to the job's ``console.log`` (capped like a rank's log).
One lock keeps lines whole across the agents' pump threads and the loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from trainguard.agent.logcap import RotatingFile
from trainguard.observe.live import LiveLine
from trainguard.observe.terminal import safe_bytes, safe_cell, silence
from trainguard.platform.follow import LineSource, line_batches
from trainguard.platform.throttle import LineThrottle
from trainguard.wire.logs import LogLimits

__all__ = ["Console"]


class Console:
    """One job's terminal output; see the module docstring."""

    def __init__(self, job_id: str, out: TextIO, err: TextIO) -> None:
        self.job_id = job_id
        self.out = out
        self.err = err
        self.live: LiveLine | None = None  # the live line on ``out``, once started
        self._lock = threading.Lock()
        self._log: RotatingFile | None = None
        self._gone: list[TextIO] = []  # streams whose reader went away
        self._terminal = LineThrottle()  # worker lines to the terminal: a share of them

    def start_live(self) -> None:
        """Show the live line on ``out`` (a terminal) from now on."""
        self.live = LiveLine(self.out)

    @contextlib.contextmanager
    def copied_to(self, path: Path, limits: LogLimits) -> Iterator[None]:
        """Every worker line also goes to ``path`` while inside."""
        with contextlib.closing(RotatingFile(path, limits)) as log:
            self._log = log
            try:
                yield
            finally:
                with self._lock:
                    self._log = None

    def end(self) -> None:
        """The count of lines the terminal did not get, last; the live line closed."""
        self._say_lines_not_shown(final=True)
        if self.live is not None:
            self.live.close()

    def pump(self, stream: LineSource) -> None:
        """Copy an agent's console (every rank's lines, prefixed) to ours and to the log."""
        try:
            for block in line_batches(stream):  # one write per block of lines, not per line
                with self._lock:
                    lines = block.count(b"\n") + (not block.endswith(b"\n"))
                    shown = _first_lines(block, self._terminal.admit_many(lines), lines)
                    if shown:
                        self._show(self.out, safe_bytes(shown))  # shown, never obeyed
                    if self._log is not None:  # the file gets all
                        self._log.write(block)
                        self._log.flush()
                    self._say_lines_not_shown(locked=True)
        except (OSError, ValueError):
            pass  # the agent's pipe was closed under us at shutdown

    def say(self, message: str, locked: bool = False) -> None:
        """A line to the user (``err``); ``locked``: the caller holds the output lock.
        One line: control characters in it, a newline included (a worker's error quoted
        in an event), are shown as escapes (observe/terminal.py)."""
        message = safe_cell(message)
        with contextlib.nullcontext() if locked else self._lock:
            self._show(self.err, f"[trainguard] {message}\n")

    def _show(self, stream: TextIO, text: str) -> None:
        """Write ``text`` to the console (above the live line, if there is one). The
        caller holds the output lock. A console that is gone (``trainguard run | head``:
        the reader stopped; a closed terminal) is no reason to stop the job: its writes
        are dropped from then on, and the job and its record go on to the end."""
        if stream in self._gone:
            return
        try:
            if self.live is not None:
                self.live.above(stream, text)
            else:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError):
            self._gone.append(stream)
            silence(stream)

    def _say_lines_not_shown(self, locked: bool = False, final: bool = False) -> None:
        """How many worker lines the terminal did not get lately (see throttle.py)."""
        with contextlib.nullcontext() if locked else self._lock:
            held = self._terminal.note_due(final)
            if held:
                self.say(f"{held} lines not shown; see trainguard logs {self.job_id}", locked=True)


def _first_lines(block: bytes, count: int, lines: int) -> bytes:
    """The first ``count`` of the ``lines`` lines of ``block``."""
    if count >= lines:
        return block
    rest = block.split(b"\n", count)[-1]
    return block[: len(block) - len(rest)]
