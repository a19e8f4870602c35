"""Timeouts and intervals of the resilient wrapper, with their defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.collectives import resolve_choice

__all__ = ["ResilientConfig"]


@dataclass(frozen=True)
class ResilientConfig:
    """How the wrapper polls, waits and times out (seconds)."""

    poll_interval: float = 0.05
    """How often the watcher thread reads ``attempt.json`` while training (a newer
    attempt is seen within this long: half of it on average)."""
    join_poll_interval: float = 0.02
    """How often a joining rank checks the attempt's barrier (and for a newer attempt)."""
    barrier_timeout: float = 300.0
    """Joining an attempt that ``attempt.json`` does not describe (torchrun env only)."""
    collective_timeout: float = 1800.0
    """Timeout of every collective once joined (torch's gloo default)."""
    backend: str | None = None
    """``auto`` (CPU tensors over gloo, CUDA tensors over NCCL where CUDA is there),
    ``gloo`` (both over gloo: ranks sharing a GPU) or ``nccl``; None reads
    ``$TRAINGUARD_BACKEND`` (default ``auto``). See :mod:`trainguard.collectives`."""
    cuda_check_timeout: float = 30.0
    """A survivor's CUDA check (a small kernel and a synchronize) before it rejoins."""

    def __post_init__(self) -> None:
        resolve_choice(self.backend)  # a bad name fails here, not at the first join
        for name in (
            "poll_interval",
            "join_poll_interval",
            "barrier_timeout",
            "collective_timeout",
            "cuda_check_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ResilientConfig.{name} must be > 0, got {getattr(self, name)}")
