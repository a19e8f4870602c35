"""``trainguard run``'s live line: one line at the bottom of the terminal that says where
the job is, redrawn every turn of the loop::

    trainguard │ step 41/1000 │ 12.3 steps/s │ ETA 1m18s │ restarts 0 │ no faults

and after a fault its last part reads ``last fault WorkerCrash rank 3 (node-1) 12s ago``.
It is cut to the terminal's width, so it never wraps.

Where its output goes. In a local run every rank's line reaches the terminal through
this process: a worker writes to files, its agent tails them and writes each line,
prefixed, to its stdout, a pipe that the runner copies to ours
(:meth:`Console.pump <trainguard.platform.console.Console.pump>`); the events
go to stderr (``[trainguard] ...``). No other process writes to the terminal, so the
runner draws the live line itself: every line, stdout's or stderr's, goes through
:meth:`LiveLine.above`, which erases the live line, writes the line and draws the live
line again under it (one write when both are on stdout). The lines are shown with their
control characters as escapes (:mod:`trainguard.observe.terminal`): a worker's ``\r`` or
escape sequence can neither erase the live line nor its own rank prefix.

Only on a terminal. :func:`live_wanted` says no when stdout is not one (piped output
stays byte for byte as without it), for ``TERM=dumb``, and ``trainguard run --no-live``
turns it off; ``NO_COLOR`` keeps it but drops its colours (rich's own rule). rich is
imported only when the line is drawn.

Where its values come from: the controller, at each
:meth:`~trainguard.platform.local_platform.LocalPlatform.record` (the current attempt's
progress, the restarts, the turn's ``Fault`` events). The total steps, for the ETA, are
not on the wire: they come from the lines drawn above it that say ``Step 41/1000``
(also ``Iteration``, ``Batch``, ``iter``); without one the ETA is ``-``.

The text is a pure function of its values (:func:`live_text`), and so is the rate
(:func:`steps_per_second`).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TextIO

from trainguard.control.events import Event, EventKind
from trainguard.observe.terminal import safe_text

if TYPE_CHECKING:
    from trainguard.control.controller import JobController

__all__ = [
    "LastFault",
    "LiveLine",
    "LiveView",
    "StepSeen",
    "live_text",
    "live_wanted",
    "steps_per_second",
]

RATE_WINDOW = 30.0  # seconds of steps the rate is taken over
STALL_SECONDS = 10.0  # no new step for this long: the rate is 0 (a hang shows as one)
REDRAW_INTERVAL = 0.2  # the line is rendered at most this often (faults: at once)
SEPARATOR = " │ "
ASCII_SEPARATOR = " | "  # for a terminal whose encoding has no box drawing
# Erase the line the cursor is on and go to its start.
ERASE = "\r\x1b[2K"
# "Step 41/1000", "iteration: 41 / 1000", "[rank0]: Batch 41/1000 Loss ...": the total.
_TOTAL = re.compile(r"(?i)\b(?:step|iter(?:ation)?|batch)\s*[:=#]?\s*\d+\s*/\s*(\d+)\b")


@dataclass(frozen=True)
class LastFault:
    """The newest fault of the job, as the line shows it."""

    type: str
    time: float
    rank: int | None = None
    node: str | None = None


@dataclass(frozen=True)
class LiveView:
    """What the line shows; None: not known (yet)."""

    now: float
    step: int | None = None
    total: int | None = None
    rate: float | None = None  # steps per second
    restarts: int = 0
    last_fault: LastFault | None = None


@dataclass(frozen=True)
class StepSeen:
    """A step and when it was seen."""

    time: float
    step: int


def live_text(view: LiveView, separator: str = SEPARATOR) -> str:
    """The line for ``view``, e.g. ``trainguard │ step 41/1000 │ 12.3 steps/s │ ETA 1m18s
    │ restarts 1 │ last fault WorkerCrash rank 3 (node-1) 12s ago``."""
    step = "-" if view.step is None else str(view.step)
    if view.total is not None:
        step += f"/{view.total}"
    rate = "-" if view.rate is None else _rate(view.rate)
    eta = "-"
    if view.step is not None and view.total is not None and view.rate:
        eta = _duration(max(0, view.total - view.step) / view.rate)
    parts = [
        "trainguard",
        f"step {step}",
        f"{rate} steps/s",
        f"ETA {eta}",
        f"restarts {view.restarts}",
        _fault(view.last_fault, view.now),
    ]
    return separator.join(parts)


def steps_per_second(
    samples: Sequence[StepSeen], now: float, stall: float = STALL_SECONDS
) -> float | None:
    """Steps per second from the first sample to the last (the caller keeps a window);
    None with fewer than two; 0 once no new step came for ``stall`` seconds."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    if now - last.time > stall:
        return 0.0
    if last.time <= first.time or last.step < first.step:
        return None
    return (last.step - first.step) / (last.time - first.time)


def live_wanted(stream: TextIO) -> bool:
    """Whether to draw the line on ``stream``: a terminal, and not ``TERM=dumb``."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        return False
    return tty and os.environ.get("TERM") != "dumb"


def _encodes(stream: TextIO, text: str) -> bool:
    """Whether ``stream`` can take ``text`` (one with no encoding takes any)."""
    encoding = getattr(stream, "encoding", None)
    if encoding is None:
        return True
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _fault(fault: LastFault | None, now: float) -> str:
    if fault is None:
        return "no faults"
    where = []
    if fault.rank is not None:
        where.append(f"rank {fault.rank}")
    if fault.node is not None:
        where.append(f"({fault.node})" if where else fault.node)
    text = " ".join(["last fault", fault.type, *where])
    return f"{text} {_duration(max(0.0, now - fault.time))} ago"


def _rate(rate: float) -> str:
    if rate >= 100:
        return f"{rate:.0f}"
    if rate >= 0.1 or rate == 0:
        return f"{rate:.1f}"
    return f"{rate:.3f}"


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 100 * 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class LiveLine:
    """The live line on ``stream`` (a terminal); see the module docstring.

    Thread-safe: the loop calls :meth:`update`, the console threads :meth:`above`.
    """

    def __init__(
        self, stream: TextIO, *, window: float = RATE_WINDOW, width: int | None = None
    ) -> None:
        """``width``: the terminal's columns (default: asked each time it is drawn)."""
        from rich.console import Console  # only when a line is drawn

        self._stream = stream
        self._console = Console(
            file=stream, width=width, highlight=False, markup=False, emoji=False
        )
        self._window = window
        self._lock = threading.Lock()
        self._rendered = ""  # the line as drawn: ANSI, no newline
        self._rendered_at = 0.0
        self._closed = False
        self._unicode = _encodes(stream, SEPARATOR + "…")
        self._attempt: int | None = None
        self._samples: deque[StepSeen] = deque()
        self._step: int | None = None
        self._total: int | None = None
        self._last_fault: LastFault | None = None

    def update(self, controller: JobController, events: Sequence[Event], now: float) -> None:
        """Take the controller's news of this turn (``events``: the turn's), and redraw."""
        faulted = False
        for event in events:
            if event.kind == EventKind.FAULT:
                kind = str(event.data.get("type", "fault"))
                self._last_fault = LastFault(kind, event.time, event.rank, event.node)
                faulted = True
        attempt = controller.current
        if attempt is not None:
            if attempt.number != self._attempt:
                self._attempt = attempt.number
                self._samples.clear()  # a new attempt's steps are counted afresh
            progress = attempt.watch.progress
            if progress is not None:
                self._sample(StepSeen(progress.first_time, progress.first_step))
                self._sample(StepSeen(progress.time, progress.step))
                self._step = progress.step
        with self._lock:
            if self._closed or (not faulted and now - self._rendered_at < REDRAW_INTERVAL):
                return
            view = LiveView(
                now,
                self._step,
                self._total,
                steps_per_second(self._samples, now),
                controller.restarts,
                self._last_fault,
            )
            separator = SEPARATOR if self._unicode else ASCII_SEPARATOR
            try:
                self._rendered = self._render(live_text(view, separator), view)
                self._rendered_at = now
                self._stream.write(ERASE + self._rendered)
                self._stream.flush()
            except (OSError, ValueError):  # the terminal went away: the job goes on
                self._closed = True

    def above(self, stream: TextIO, text: str) -> None:
        """Write ``text`` (whole lines) to ``stream`` above the live line, its control
        characters shown as escapes."""
        text = safe_text(text)
        found = _TOTAL.search(text)
        with self._lock:
            if found is not None and (total := int(found.group(1))) > 0:
                self._total = total
            if self._closed or not self._rendered:
                stream.write(text)
                stream.flush()
                return
            end = "" if text.endswith("\n") else "\n"
            if stream is self._stream:
                stream.write(ERASE + text + end + self._rendered)
                stream.flush()
                return
            self._stream.write(ERASE)
            self._stream.flush()
            stream.write(text + end)
            stream.flush()
            self._stream.write(self._rendered)
            self._stream.flush()

    def close(self) -> None:
        """Erase the line; from now on :meth:`above` only writes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._rendered:
                with contextlib.suppress(OSError, ValueError):  # the terminal went away
                    self._stream.write(ERASE)
                    self._stream.flush()

    def _sample(self, sample: StepSeen) -> None:
        samples = self._samples
        if samples and sample.time <= samples[-1].time:
            return
        samples.append(sample)
        while len(samples) > 2 and samples[1].time <= sample.time - self._window:
            samples.popleft()

    def _render(self, plain: str, view: LiveView) -> str:
        from rich.text import Text

        text = Text(plain, style="bold")
        if view.last_fault is not None:
            text.highlight_regex(r"last fault .*", "red")
        width = max(1, self._console.width - 1)  # never the last column: no wrap
        overflow: Literal["ellipsis", "crop"] = "ellipsis" if self._unicode else "crop"
        with self._console.capture() as captured:
            self._console.print(text, end="", no_wrap=True, overflow=overflow, width=width)
        return captured.get()
