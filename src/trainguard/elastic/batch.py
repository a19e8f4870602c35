"""The per-rank batch and gradient-accumulation steps that keep the global batch fixed.

At any world size, one optimizer step sees ``per_rank * accumulation_steps *
world_size == global_batch`` samples, so the loss curve does not depend on how many
ranks the job has at the moment. The learning rate is kept as it is (the global batch
does not change; HyperPod's recipes keep it at every scale too); a script that wants
another rule changes its optimizer's learning rate itself after a restart.

Uneven splits (some ranks a sample more, HyperPod's ``small*k + large*(W-k)``) are
refused on purpose: data-parallel training averages the ranks' gradients with equal
weights, so a rank's samples would count for more or less than another's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BatchSplit", "batch_split"]


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's ``global_batch`` samples are split at ``world_size``."""

    global_batch: int
    world_size: int
    per_rank: int
    """Samples in each rank's micro-batch."""
    accumulation_steps: int
    """Micro-batches each rank accumulates before the optimizer steps."""

    @property
    def micro_step(self) -> int:
        """Samples the whole world takes in one micro-batch: ``per_rank * world_size``."""
        return self.per_rank * self.world_size


def batch_split(global_batch: int, world_size: int, max_per_rank: int | None = None) -> BatchSplit:
    """The split of ``global_batch`` over ``world_size`` ranks with the fewest accumulation
    steps whose micro-batch is at most ``max_per_rank`` (a rank's memory limit) (pure).

    Raises ValueError when ``global_batch`` is not a multiple of ``world_size``, naming
    the nearest world sizes that would do.
    """
    _check_positive("global_batch", global_batch)
    _check_positive("world_size", world_size)
    if max_per_rank is not None:
        _check_positive("max_per_rank", max_per_rank)
    share, rest = divmod(global_batch, world_size)
    if rest:
        raise ValueError(
            f"batch_split: a global batch of {global_batch} cannot be split evenly over "
            f"{world_size} ranks ({global_batch} % {world_size} = {rest}); "
            f"{_nearest_world_sizes(global_batch, world_size)}"
        )
    steps = 1 if max_per_rank is None else _fewest_steps(share, max_per_rank)
    return BatchSplit(global_batch, world_size, share // steps, steps)


def _fewest_steps(share: int, max_per_rank: int) -> int:
    """The smallest divisor ``d`` of ``share`` with ``share // d <= max_per_rank``."""
    least = -(-share // max_per_rank)
    divisors: set[int] = set()
    for small in range(1, math.isqrt(share) + 1):
        if share % small == 0:
            divisors.update((small, share // small))
    return min(d for d in divisors if d >= least)


def _nearest_world_sizes(global_batch: int, world_size: int) -> str:
    below = next(
        size for size in range(min(world_size, global_batch), 0, -1) if global_batch % size == 0
    )
    above = next(
        (size for size in range(world_size + 1, global_batch + 1) if global_batch % size == 0),
        None,
    )
    if above is None:
        return f"the nearest world size that can take it is {below}"
    return f"the nearest world sizes that can take it are {below} and {above}"


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"batch_split: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"batch_split: {name} must be >= 1, got {value}")
