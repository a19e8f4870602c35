"""Small files that other processes poll, written so that a reader finds the old file or
the whole new one, never a part (a truncate-then-write let readers see it empty)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path``: a unique temporary name beside it, created with ``mode``,
    then a rename over it. No fsync: for readers now, not for a crash's durability."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
