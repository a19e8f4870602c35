"""What the training function sees of the current attempt: :class:`Run`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainguard.elastic.batch import BatchSplit, batch_split
from trainguard.elastic.data import EpochShard, shard_indices
from trainguard.resilient.group import AttemptInterrupted
from trainguard.resilient.protocol import StateSource

__all__ = ["Fallback", "Run", "StateProgress", "TrainFunction"]


@dataclass
class StateProgress:
    """How far this process's in-memory state is: ``steps`` completed steps, if any."""

    has_state: bool = False
    steps: int = 0


class Run:
    """One attempt of the training function.

    Steps are numbered from 0. The function runs steps ``start_step``, ``start_step + 1``,
    ... and calls :meth:`completed` right after each step's optimizer update. The data
    position is a function of the step (and the rank): a loader that picks step ``s``'s
    samples from ``s`` alone resumes sample-exact.

    An elastic job's attempts may differ in ``world_size`` (and a rank in ``rank``): with
    a fixed global batch, :meth:`batch_split` and :meth:`shard` give this attempt's
    per-rank batch, accumulation steps and samples, so the job takes every sample of
    the epoch once at any size.
    """

    def __init__(
        self,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        attempt: int,
        state_source: StateSource,
        progress: StateProgress,
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

    def batch_split(self, global_batch: int, max_per_rank: int | None = None) -> BatchSplit:
        """This attempt's split of ``global_batch`` (:func:`trainguard.elastic.batch_split`
        at ``world_size``): per-rank micro-batch and accumulation steps."""
        return batch_split(global_batch, self.world_size, max_per_rank)

    def shard(self, epoch_len: int, split: BatchSplit, *, seed: int | None = None) -> EpochShard:
        """This rank's micro-batches for the rest of a one-epoch run whose every step took
        ``split.global_batch`` samples: from sample ``start_step * global_batch`` on
        (:func:`trainguard.elastic.shard_indices`). Step ``start_step + i`` takes
        micro-batches ``i * accumulation_steps`` to ``(i + 1) * accumulation_steps - 1``."""
        if split.world_size != self.world_size:
            raise ValueError(
                f"Run.shard: the split is for world size {split.world_size}, "
                f"this attempt has {self.world_size}"
            )
        consumed = self.start_step * split.global_batch
        return shard_indices(
            epoch_len, consumed, self.rank, self.world_size, split.per_rank, seed=seed
        )

    def completed(self, step: int) -> None:
        """Step ``step`` is done and the state is consistent (every rank holds the same).

        Call it right after the optimizer update, before any other collective of the next
        step (a loss all_reduce for logging belongs before the update, or after this call).
        Raises :class:`AttemptInterrupted` when a newer attempt has been announced, so the
        wrapper rejoins at once instead of at the next collective.
        """
        self._advance(step)
        self._check(step)

    def _advance(self, step: int) -> None:
        """Count ``step`` as completed (the first half of :meth:`completed`)."""
        if step != self._progress.steps:
            raise ValueError(
                f"run.completed({step}): expected step {self._progress.steps} "
                f"(steps are numbered from 0, one call per step, from run.start_step)"
            )
        self._progress.steps = step + 1

    def _check(self, step: int) -> None:
        """Raise :class:`AttemptInterrupted` once a newer attempt is announced."""
        if self._interrupted():
            raise AttemptInterrupted(f"attempt {self.attempt} superseded after step {step}")


TrainFunction = Callable[[Run], None]
"""What ``@restartable`` wraps: the training loop of one attempt."""
Fallback = Callable[[], int | None]
"""Restores the state from a checkpoint when no rank holds it; returns the number of
completed steps it holds, or None (start at step 0)."""
