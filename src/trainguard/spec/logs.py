"""``spec.trainguard.logs``: how much of each rank's output is kept on disk."""

from __future__ import annotations

from pydantic import Field

from trainguard.spec.fields import SpecModel
from trainguard.wire.logs import (
    DEFAULT_KEEP,
    DEFAULT_MAX_BYTES_PER_RANK,
    MAX_KEEP,
    MAX_MAX_BYTES_PER_RANK,
    MIN_MAX_BYTES_PER_RANK,
)

__all__ = ["LogOptions"]


class LogOptions(SpecModel):
    """Each rank's log is rotated before it passes ``maxBytesPerRank``; the newest ``keep``
    old files are kept. The job's console.log is capped the same way."""

    max_bytes_per_rank: int = Field(
        default=DEFAULT_MAX_BYTES_PER_RANK,
        ge=MIN_MAX_BYTES_PER_RANK,
        le=MAX_MAX_BYTES_PER_RANK,
        description="trainguard extension: bytes of a rank's log file (rank-R.log) before it "
        "is rotated (1 MiB to 1 TiB; default 100 MiB). A rank then uses at most "
        "maxBytesPerRank x (keep + 1) on disk, plus its current attempt's stdout/stderr "
        "spool (at most one maxBytesPerRank more, when it writes faster than the agent reads).",
    )
    keep: int = Field(
        default=DEFAULT_KEEP,
        ge=0,
        le=MAX_KEEP,
        description="trainguard extension: rotated files kept per log (rank-R.log.1 is the "
        "newest; 0 to 100; default 2).",
    )
