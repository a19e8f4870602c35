"""What the training function sees of the current attempt: :class:`Run`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainguard.resilient.group import AttemptInterrupted
from trainguard.resilient.protocol import StateSource

__all__ = ["Progress", "Run"]


@dataclass
class Progress:
    """How far this process's in-memory state is: ``steps`` completed steps, if any."""

    has_state: bool = False
    steps: int = 0


class Run:
    """One attempt of the training function.

    Steps are numbered from 0. The function runs steps ``start_step``, ``start_step + 1``,
    ... and calls :meth:`completed` right after each step's optimizer update. The data
    position is a function of the step (and the rank): a loader that picks step ``s``'s
    samples from ``s`` alone resumes sample-exact.
    """

    def __init__(
        self,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        attempt: int,
        state_source: StateSource,
        progress: Progress,
        interrupted: Callable[[], bool],
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.attempt = attempt
        self.state_source: StateSource = state_source
        """Where this process's state came from at the start of the attempt."""
        self.start_step = progress.steps
        """The first step to run (the number of steps the state has completed)."""
        self._progress = progress
        self._interrupted = interrupted

    def completed(self, step: int) -> None:
        """Step ``step`` is done and the state is consistent (every rank holds the same).

        Call it right after the optimizer update, before any other collective of the next
        step (a loss all_reduce for logging belongs before the update, or after this call).
        Raises :class:`AttemptInterrupted` when a newer attempt has been announced, so the
        wrapper rejoins at once instead of at the next collective.
        """
        if step != self._progress.steps:
            raise ValueError(
                f"run.completed({step}): expected step {self._progress.steps} "
                f"(steps are numbered from 0, one call per step, from run.start_step)"
            )
        self._progress.steps = step + 1
        if self._interrupted():
            raise AttemptInterrupted(f"attempt {self.attempt} superseded after step {step}")
