"""Users' regular expressions, compiled with RE2: matching is linear in the line's length.

Every pattern a spec gives (log rules' ``logPattern`` and ``stopPattern``,
``progressPattern``) runs on every output line of every rank, in the agent's log reader.
A backtracking engine (Python's ``re``) can take hours on one line for a pattern such as
``(a+)+$``; RE2 (``google-re2``) never backtracks, so no pattern and no line can stall the
reader. What RE2 cannot run in linear time it does not compile: backreferences (``\\1``),
lookaround (``(?=``, ``(?!``, ``(?<=``, ``(?<!``), possessive quantifiers (``*+``) and
atomic groups. Such a pattern is refused where the spec is checked, with RE2's reason.

Semantics otherwise follow ``re``: :meth:`Pattern.match` is anchored at the start of the
line (``re.match``), ``(?i)`` and named groups (``(?P<name>...)``) work, and group 1 is
the first capture group. ``\\d``, ``\\w``, ``\\s`` and ``\\b`` are ASCII-only in RE2, and
``\\Z`` is written ``\\z``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final, Protocol, cast

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

__all__ = [
    "MAX_PATTERN_MEMORY",
    "LineStartRegex",
    "Match",
    "Pattern",
    "RegexError",
    "Spans",
    "compile_at_line_starts",
    "compile_regex",
    "match_line",
]

MAX_PATTERN_MEMORY: Final = 8 * 1024 * 1024
"""RE2's memory budget for one compiled pattern (bytes); a larger program is refused."""

_HINTS: Final = (
    ("invalid perl operator: (?=", "lookahead is not supported"),
    ("invalid perl operator: (?!", "lookahead is not supported"),
    ("invalid perl operator: (?<=", "lookbehind is not supported"),
    ("invalid perl operator: (?<!", "lookbehind is not supported"),
    ("invalid perl operator: (?>", "atomic groups are not supported"),
    ("invalid escape sequence: \\Z", "write \\z for the end of the line"),
)
"""RE2's message prefixes for Python-only syntax, and what to tell the user."""


class Match(Protocol):
    """The part of ``re.Match`` trainguard uses."""

    def group(self, index: int | str = 0, /) -> str | None: ...


class Pattern(Protocol):
    """The part of ``re.Pattern`` trainguard uses."""

    @property
    def pattern(self) -> str: ...

    @property
    def groups(self) -> int: ...

    def match(self, text: str) -> Match | None: ...


class RegexError(ValueError):
    """A pattern RE2 does not compile; the message is RE2's reason."""


def compile_regex(pattern: str) -> Pattern:
    """``pattern`` compiled by RE2; :class:`RegexError` says why not (one line)."""
    if not isinstance(pattern, str):
        raise RegexError(f"must be a string, got {type(pattern).__name__}")
    return cast(Pattern, _compile(pattern))


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, never_nl: bool = False) -> Any:
    options = re2.Options()
    options.log_errors = False  # RE2 would print every refused pattern to stderr
    options.max_mem = MAX_PATTERN_MEMORY
    options.never_nl = never_nl
    try:
        return re2.compile(pattern, options)
    except re2.error as err:
        raise RegexError(_reason(pattern, err)) from None


def compile_at_line_starts(pattern: str) -> LineStartRegex:
    """``pattern`` as it runs on a block of lines (:mod:`trainguard.monitor.lines`):
    anchored at any line's start (``(?m)^``), and never matching a newline (RE2's
    ``never_nl``), so no match runs from one line into the next. Only for a pattern
    that :func:`compile_regex` compiles."""
    return LineStartRegex(_compile(f"(?m)^(?:{pattern})", True))


Spans = Sequence[tuple[int, int]]
"""A match's ``(start, end)`` byte offsets: the whole match, then each group's
(``(-1, -1)``: the group took no part)."""


class LineStartRegex:
    """A compiled block pattern, matched on bytes and answering with spans.

    google-re2's ``finditer`` builds a match object and a generator per match, four times
    the cost of RE2's own call; this calls the extension's ``Match`` directly (google-re2
    1.x), and the public API where that is not there."""

    def __init__(self, compiled: Any) -> None:
        self.groups: int = compiled.groups
        self._compiled = compiled
        regexp = getattr(compiled, "_regexp", None)
        anchors = getattr(re2, "_Anchor", None)
        self._raw = None if regexp is None or anchors is None else regexp.Match
        if anchors is not None:
            self._anchors = (anchors.UNANCHORED, anchors.ANCHOR_START)

    def spans(self, text: bytes, pos: int, endpos: int, anchored: bool = False) -> Spans | None:
        """The first match in ``text[pos:endpos]`` (``anchored``: one at ``pos`` only)."""
        if self._raw is not None:
            spans: Spans = self._raw(self._anchors[anchored], text, pos, endpos)
            return None if spans[0][0] < 0 else spans
        find = self._compiled.match if anchored else self._compiled.search
        found = find(text, pos, endpos)
        return None if found is None else [found.span(i) for i in range(self.groups + 1)]

    def each_line(self, text: bytes, endpos: int) -> list[Spans]:
        """Every match in ``text[:endpos]`` (whole lines), at most one per line, in order:
        after a match, the next search starts at the next line. One call of RE2 per
        matching line and little Python around it (a block's lines mostly all match)."""
        found: list[Spans] = []
        next_line, pos = text.find, 0
        if self._raw is None:
            while pos <= endpos and (spans := self.spans(text, pos, endpos)) is not None:
                found.append(spans)
                pos = next_line(b"\n", spans[0][1]) + 1  # the next line's start; 0: none
                if pos == 0:
                    break
            return found
        raw, unanchored = self._raw, self._anchors[0]
        while pos <= endpos:
            spans = raw(unanchored, text, pos, endpos)
            if spans[0][0] < 0:
                break
            found.append(spans)
            pos = next_line(b"\n", spans[0][1]) + 1
            if pos == 0:
                break
        return found


def _reason(pattern: str, err: Exception) -> str:
    raw = err.args[0] if err.args else str(err)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    hint = next((hint for prefix, hint in _HINTS if text.startswith(prefix)), "")
    escape = "invalid escape sequence: \\"
    if (text.startswith(escape) and text[len(escape) : len(escape) + 1].isdigit()) or (
        text.startswith("invalid perl operator: (?P") and "(?P=" in pattern
    ):
        hint = "backreferences are not supported"
    elif text.startswith("bad repetition operator: ") and text.endswith("+"):
        hint = "possessive quantifiers are not supported"
    if hint:
        return f"RE2 (linear-time matching) cannot compile it: {text}; {hint}"
    return f"invalid regular expression: {text}"


class _AsciiMatch:
    """A match made on an ASCII line's bytes, its groups given back as ``str``."""

    __slots__ = ("_found",)

    def __init__(self, found: Any) -> None:
        self._found = found

    def group(self, index: int | str = 0, /) -> str | None:
        value = self._found.group(index)
        return None if value is None else cast(bytes, value).decode("ascii")


def match_line(pattern: Pattern, line: str) -> Match | None:
    """``pattern.match(line)``. An ASCII line (most log lines) is matched as its bytes,
    the same text to RE2, which matches UTF-8 bytes natively: google-re2's ``str`` path
    encodes the line and maps every span back to characters, three times the cost of
    the match itself. Any other line is matched as it is."""
    if line.isascii():
        found = cast(Any, pattern).match(line.encode("ascii"))
        return None if found is None else _AsciiMatch(found)
    return pattern.match(line)
