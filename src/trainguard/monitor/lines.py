"""A user's pattern run on a block of lines at once, with the semantics of a line at a time.

The log tailer hands the monitor what a worker wrote since its last look: a block of whole
lines, each ending in a newline. Calling Python per line (decode it, then one RE2 call
per pattern) costs more than the matching; here one RE2 search over the block finds the
next line the pattern matches, so Python runs only per *matching* line, and not at all
for a pattern that matches none.

The block pattern is ``(?m)^(?:PATTERN)`` compiled with RE2's ``never_nl``: it starts at
a line's start and never reads a newline, so it matches at the start of a line exactly
when ``re.match(PATTERN, line)`` does on that line alone (``^`` and ``$`` are that line's
start and end; ``\\b`` sees a newline as a non-word character, as it sees the end of
text). A pattern whose meaning needs the line alone (``\\A``, ``\\z``, ``\\C``, or
multi-line mode switched off with ``(?-m)``) is matched a line at a time instead.

A block is matched as UTF-8: one that is not (a worker printed invalid bytes) is matched as
its lines decoded with ``errors="replace"`` would be (:func:`scannable`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import NamedTuple

from trainguard.monitor.regex import (
    LineStartRegex,
    RegexError,
    Spans,
    compile_at_line_starts,
    compile_regex,
    match_line,
)

__all__ = [
    "BlockScans",
    "LineMatch",
    "LinePattern",
    "line_at",
    "line_pattern",
    "scannable",
    "split_lines",
]

# Where the block pattern could differ from the line pattern (conservative: a literal
# backslash before A, C or z also sends a pattern to the line-at-a-time path).
_NEEDS_ONE_LINE = re.compile(r"\\[ACz]|\(\?[a-zA-Z]*-[a-zA-Z]*m")


class LineMatch(NamedTuple):
    """A line a pattern matched: its offset in the block, and its first group's text
    (None when the pattern has no group or the group took no part)."""

    start: int
    group: str | None


def scannable(block: bytes) -> bytes:
    """``block`` as valid UTF-8: itself, or, where a worker wrote invalid bytes, each
    line decoded with ``errors="replace"`` (a newline never is part of a bad sequence,
    so decoding the block at once gives the same)."""
    if block.isascii():
        return block
    try:
        block.decode()
    except UnicodeDecodeError:
        return block.decode(errors="replace").encode()
    return block


def line_at(block: bytes, start: int) -> str:
    """The line of ``block`` that begins at ``start``, without its newline."""
    end = block.find(b"\n", start)
    return block[start : None if end < 0 else end].decode(errors="replace")


def split_lines(block: bytes) -> list[bytes]:
    """``block``'s lines, without their newlines."""
    return block[:-1].split(b"\n") if block else []


class LinePattern:
    """A pattern (RE2, anchored like ``re.match``) to run on every line of a block."""

    def __init__(self, pattern: str) -> None:
        """:class:`~trainguard.monitor.regex.RegexError` if RE2 does not compile it."""
        self.pattern = pattern
        self.line = compile_regex(pattern)  # a line at a time; refuses what RE2 cannot run
        self.groups = self.line.groups
        self._block: LineStartRegex | None = None  # None: a line at a time
        if not _NEEDS_ONE_LINE.search(pattern):
            try:
                self._block = compile_at_line_starts(pattern)
            except RegexError:  # the wrapper took it past RE2's memory budget
                self._block = None

    def matches(self, block: bytes, end: int | None = None) -> Iterator[LineMatch]:
        """The lines of ``block[:end]`` (:func:`scannable`, whole lines; ``end`` a line's
        start, None: all) that the pattern matches, in order."""
        stop = len(block) if end is None else end
        if self._block is None:
            yield from self._one_by_one(block, stop)
            return
        search, last, pos = self._block.spans, stop - 1, 0  # last: the last line's newline
        while pos <= last:
            spans = search(block, pos, last)
            if spans is None:
                return
            start = spans[0][0]
            yield LineMatch(start, _group(block, spans) if self.groups else None)
            pos = block.find(b"\n", spans[0][1]) + 1  # the next line's start
            if pos == 0:
                return

    def scan(self, block: bytes, end: int | None = None) -> list[LineMatch]:
        """All of :meth:`matches` at once (cheaper per line than taking them one by one)."""
        stop = len(block) if end is None else end
        if self._block is None:
            return list(self._one_by_one(block, stop))
        found = self._block.each_line(block, stop - 1)
        if not self.groups:
            return [LineMatch(spans[0][0], None) for spans in found]
        return [LineMatch(spans[0][0], _group(block, spans)) for spans in found]

    def last_line(self, block: bytes) -> LineMatch | None:
        """``block``'s last line, if the pattern matches it."""
        if not block:
            return None
        start = block.rfind(b"\n", 0, len(block) - 1) + 1
        if self._block is None:
            return next(self._one_by_one(block, len(block), start), None)
        spans = self._block.spans(block, start, len(block) - 1, anchored=True)
        if spans is None:
            return None
        return LineMatch(start, _group(block, spans) if self.groups else None)

    def _one_by_one(self, block: bytes, stop: int, start: int = 0) -> Iterator[LineMatch]:
        while start < stop:
            end = block.find(b"\n", start)
            end = len(block) if end < 0 else end
            found = match_line(self.line, block[start:end].decode(errors="replace"))
            if found is not None:
                yield LineMatch(start, found.group(1) if self.groups else None)
            start = end + 1

    def __repr__(self) -> str:
        return f"LinePattern({self.pattern!r})"


class BlockScans:
    """The patterns run on one block so far: rules that share a pattern (HyperPod's
    example has two on ``.*Loss:.*``) share its scan."""

    def __init__(self, block: bytes) -> None:
        self.block = block  # :func:`scannable`
        self._scans: dict[tuple[str, int | None], list[LineMatch]] = {}

    def lines(self, pattern: LinePattern, end: int | None = None) -> list[LineMatch]:
        """The lines of ``block[:end]`` that ``pattern`` matches (see
        :meth:`LinePattern.matches`)."""
        key = (pattern.pattern, end)
        if key not in self._scans:
            self._scans[key] = pattern.scan(self.block, end)
        return self._scans[key]

    def first(self, pattern: LinePattern) -> LineMatch | None:
        """The first line of the block that ``pattern`` matches."""
        if (pattern.pattern, None) in self._scans:
            return next(iter(self._scans[pattern.pattern, None]), None)
        return next(pattern.matches(self.block), None)


@functools.lru_cache(maxsize=256)
def line_pattern(pattern: str) -> LinePattern:
    """:class:`LinePattern` of ``pattern``, cached (rules compile theirs once)."""
    return LinePattern(pattern)


def _group(block: bytes, spans: Spans) -> str | None:
    start, end = spans[1]
    return None if start < 0 else block[start:end].decode(errors="replace")
