"""Text from workers made safe to show on a terminal.

A worker's output is not trainguard's to trust: a line of it written to the terminal as is
could clear the screen, set the window title, write the clipboard (OSC 52), or use
``\\r`` and an erase to wipe the ``[rankR]:`` prefix and pass for one of trainguard's own
lines (``[trainguard] ... JobSucceeded``). :func:`safe_text` shows every control
character instead of letting the terminal act on it, so what a worker wrote is always
read as text, after its rank's prefix:

- C0 controls (but tab and newline), DEL and C1 controls become escapes: ``\\x1b``,
  ``\\r``, ``\\x07``, ``\\x7f``, ``\\x9b``;
- Unicode's line and paragraph separators and the bidirectional overrides and isolates,
  which reorder or break what is shown, become ``\\u202e`` and the like;
- bytes that are not UTF-8 (:func:`safe_bytes`) become ``\\xff``; valid UTF-8 text is
  kept as it is.

Only what is shown is changed: the log files on disk keep every byte the worker wrote.
"""

from __future__ import annotations

import os
import re
from typing import TextIO

__all__ = ["safe_bytes", "safe_cell", "safe_text", "silence"]

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\r": "\\r", "\x0b": "\\v", "\x0c": "\\f", "\b": "\\b"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(text: str) -> str:
    """``text`` with every control character shown as an escape (tabs and newlines kept)."""
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(_escape, text)


def safe_cell(text: str) -> str:
    """:func:`safe_text` on one line: a newline is shown as ``\\n`` too (a table's cell)."""
    return safe_text(text).replace("\n", "\\n")


def safe_bytes(data: bytes) -> str:
    """:func:`safe_text` of ``data`` decoded as UTF-8 (a byte that is not: ``\\xff``)."""
    return safe_text(data.decode("utf-8", errors="backslashreplace"))


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at ``/dev/null``: its reader went away (a
    closed pipe), and what is still buffered, or the flush at exit, must not fail again."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return  # not a file (a test's StringIO), or closed already
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
