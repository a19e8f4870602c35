"""Timeouts and intervals of the resilient wrapper, with their defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ResilientConfig"]


@dataclass(frozen=True)
class ResilientConfig:
    """How the wrapper polls, waits and times out (seconds)."""

    poll_interval: float = 0.1
    """How often the watcher thread reads ``attempt.json`` while training."""
    join_poll_interval: float = 0.02
    """How often a joining rank checks the attempt's barrier (and for a newer attempt)."""
    barrier_timeout: float = 300.0
    """Joining an attempt that ``attempt.json`` does not describe (torchrun env only)."""
    collective_timeout: float = 1800.0
    """Timeout of every collective once joined (torch's gloo default)."""

    def __post_init__(self) -> None:
        for name in (
            "poll_interval",
            "join_poll_interval",
            "barrier_timeout",
            "collective_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ResilientConfig.{name} must be > 0, got {getattr(self, name)}")
