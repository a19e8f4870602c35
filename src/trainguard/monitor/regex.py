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
from typing import Any, Final, Protocol, cast

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

__all__ = ["MAX_PATTERN_MEMORY", "Match", "Pattern", "RegexError", "compile_regex", "match_line"]

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
    return _compile(pattern)


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> Pattern:
    options = re2.Options()
    options.log_errors = False  # RE2 would print every refused pattern to stderr
    options.max_mem = MAX_PATTERN_MEMORY
    try:
        return cast(Pattern, re2.compile(pattern, options))
    except re2.error as err:
        raise RegexError(_reason(pattern, err)) from None


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
