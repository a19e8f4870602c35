"""Training progress read from worker output: the step of each completed-step line.

The default pattern recognises the usual "a step has finished" lines, with the step
keyword as the first word of the line (after an optional log prefix)::

    Batch 41 Loss: 2.3, Speed: 812.5 samples/sec      -> 41   (the example's format)
    Step 41/1000 ...   step: 41   step=41   Iteration 41   iter 41
    [rank0]: Step 41   2024-05-01 12:00:00,123 INFO Step 41   INFO:__main__:step 41

A log prefix is any run of bracketed fields (``[...]``), timestamps (a digit followed
by digits and ``-:.,/T+Z``), log levels (DEBUG, INFO, WARN, WARNING, ERROR,
CRITICAL, optionally followed by ``:logger:`` as in logging's default format) and
the separators ``|``, ``:``, ``-`` and spaces. Lines that merely mention a step are
not progress: ``Resumed from checkpoint at step 40``, ``Completed checkpoint at
step 40``, ``Starting step 41``, ``Epoch 1 Step 41`` and ``steps: 400`` do not
match. Matching is case-insensitive and anchored at the line start (``re.match``), like
the log rules.

A custom pattern is a regex in RE2 syntax (:mod:`trainguard.monitor.regex`: linear time,
no backreferences or lookaround) whose first capture group is the step.
"""

from __future__ import annotations

from typing import Final

from trainguard.monitor.lines import LineMatch, LinePattern
from trainguard.monitor.regex import RegexError, match_line

__all__ = ["DEFAULT_PROGRESS_PATTERN", "ProgressMatcher"]

_LOG_PREFIX = (
    r"(?:[\s|:-]*"
    r"(?:\[[^\]\n]*\]"  # [rank0], [2024-05-01 12:00:00], [INFO]
    r"|\d[\d:.,/T+Z-]*"  # 2024-05-01, 12:00:00,123, 1714567890.5
    r"|(?:debug|info|warn(?:ing)?|error|critical)\b(?::[\w.]*:)?"  # INFO, INFO:__main__:
    r"))*"  # RE2 runs this in linear time on any line (no backtracking)
)

DEFAULT_PROGRESS_PATTERN: Final = (
    r"(?i)" + _LOG_PREFIX + r"[\s|:-]*(?:batch|step|iter(?:ation)?)(?:\s*[:=#]\s*|\s+)(\d+)\b"
)
"""Completed-step lines whose first word is Batch, Step, Iter or Iteration, then the step."""


class ProgressMatcher:
    """Extracts the training step from a worker output line."""

    def __init__(self, pattern: str = DEFAULT_PROGRESS_PATTERN) -> None:
        """``pattern``: a regex (RE2, anchored like ``re.match``) whose first capture group
        is the step."""
        try:
            self._lines = LinePattern(pattern)
        except RegexError as err:
            raise ValueError(f"progress pattern {pattern!r}: {err}") from None
        self._regex = self._lines.line
        if self._regex.groups < 1:
            raise ValueError(f"progress pattern {pattern!r}: needs a capture group for the step")
        self.pattern = pattern

    def match(self, line: str) -> int | None:
        """The step of a completed-step line, or None for any other line."""
        found = match_line(self._regex, line)
        return None if found is None else _step(found.group(1))

    def newest(self, block: bytes) -> int | None:
        """The step of the last completed-step line of ``block`` (whole lines, valid
        UTF-8: :func:`~trainguard.monitor.lines.scannable`), or None."""
        step = _step_of(self._lines.last_line(block))  # mostly the last line is one
        if step is not None:
            return step
        steps = [s for found in self._lines.matches(block) if (s := _step_of(found)) is not None]
        return steps[-1] if steps else None

    def oldest(self, block: bytes) -> int | None:
        """The step of the first completed-step line of ``block``, or None."""
        return next(
            (s for found in self._lines.matches(block) if (s := _step_of(found)) is not None),
            None,
        )

    def __repr__(self) -> str:
        return f"ProgressMatcher({self.pattern!r})"


def _step(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _step_of(found: LineMatch | None) -> int | None:
    return None if found is None else _step(found.group)
