"""How much of each rank's output the agent keeps on disk (the spec's ``trainguard.logs``).

Shared by the spec (where a user's values are checked), the controller (which sends them
with every attempt) and the agent (which enforces them: :mod:`trainguard.agent.logcap`).
"""

from __future__ import annotations

from typing import Final

from pydantic import Field

from trainguard.wire.base import Wire

__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_MAX_BYTES_PER_RANK",
    "MAX_KEEP",
    "MAX_MAX_BYTES_PER_RANK",
    "MIN_MAX_BYTES_PER_RANK",
    "LogLimits",
]

MIB: Final = 1024 * 1024
DEFAULT_MAX_BYTES_PER_RANK: Final = 100 * MIB
MIN_MAX_BYTES_PER_RANK: Final = 1 * MIB
"""At least one whole line (the tailer cuts lines at 1 MiB) fits in a file."""
MAX_MAX_BYTES_PER_RANK: Final = 1024 * 1024 * MIB  # 1 TiB
DEFAULT_KEEP: Final = 2
MAX_KEEP: Final = 100


class LogLimits(Wire):
    """A rank's log file is rotated when it would pass ``max_bytes_per_rank``; the newest
    ``keep`` rotated files are kept beside it."""

    max_bytes_per_rank: int = Field(
        default=DEFAULT_MAX_BYTES_PER_RANK, ge=MIN_MAX_BYTES_PER_RANK, le=MAX_MAX_BYTES_PER_RANK
    )
    keep: int = Field(default=DEFAULT_KEEP, ge=0, le=MAX_KEEP)
