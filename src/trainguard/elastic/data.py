"""The data position across world-size changes: each sample of an epoch used exactly once.

One number says where the job is in its epoch: ``consumed``, how many samples of the
epoch's order the whole job has taken (a global count, saved in the checkpoint). The
rest of the order is dealt in *micro-steps*: micro-step ``j`` takes the next
``per_rank * world_size`` samples, and rank ``r`` gets the ``r``-th contiguous slice of
them. After any number of complete micro-steps, the samples taken are therefore a prefix
of the order, whatever the world size was: a job that saves ``consumed``, restarts at
another size and calls `shard_indices` again neither skips nor repeats a sample.

The epoch's last micro-step may have fewer samples than the world asks for; they are
dealt as evenly as possible (slices differ by at most one sample, and a rank's slice is
empty when fewer samples than ranks are left), so every rank has the same number of
micro-steps and every sample is used. ``drop_last=True`` leaves that micro-step out.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

__all__ = ["EpochShard", "epoch_order", "shard_indices"]


def epoch_order(epoch_len: int, seed: int | None = None) -> Sequence[int]:
    """The order in which an epoch's samples are taken: ``0..epoch_len-1``, or, with a
    ``seed``, a permutation of them that is the same on every rank and every restart
    (Python's ``random.Random(seed).shuffle``: about 1 s and 40 MB per million samples).
    Use another seed per epoch (``seed + epoch``) for a new order each epoch."""
    if seed is None:
        return range(epoch_len)
    order = list(range(epoch_len))
    random.Random(seed).shuffle(order)
    return order


class EpochShard:
    """One rank's micro-batches for the rest of an epoch (built by `shard_indices`).

    Iterating gives one list of sample indices per micro-step, ``len()`` of them, the
    same number on every rank: usable as a ``DataLoader``'s ``batch_sampler`` (without
    ``drop_last=True``, the last one may be short or empty).
    """

    def __init__(
        self,
        order: Sequence[int],
        consumed: int,
        rank: int,
        world_size: int,
        per_rank: int,
        drop_last: bool,
    ) -> None:
        self.order = order
        self.consumed = consumed
        self.rank = rank
        self.world_size = world_size
        self.per_rank = per_rank
        self.micro_step = per_rank * world_size
        full, tail = divmod(len(order) - consumed, self.micro_step)
        self._len = full + (1 if tail and not drop_last else 0)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self._len):
            yield self.batch(step)

    def batch(self, step: int) -> list[int]:
        """This rank's sample indices in micro-step ``step`` (0 is the first one left)."""
        if not 0 <= step < self._len:
            raise IndexError(f"EpochShard.batch: micro-step {step} not in 0..{self._len - 1}")
        start = self.consumed + step * self.micro_step
        size = min(self.micro_step, len(self.order) - start)
        base, extra = divmod(size, self.world_size)
        offset = start + self.rank * base + min(self.rank, extra)
        return list(self.order[offset : offset + base + (1 if self.rank < extra else 0)])

    def consumed_after(self, steps: int) -> int:
        """The job's ``consumed`` once every rank has done ``steps`` micro-steps of this
        shard: the number to save in a checkpoint taken then."""
        if not 0 <= steps <= self._len:
            raise ValueError(f"EpochShard.consumed_after: {steps} not in 0..{self._len}")
        return min(self.consumed + steps * self.micro_step, len(self.order))


def shard_indices(
    epoch_len: int,
    consumed: int,
    rank: int,
    world_size: int,
    per_rank: int,
    *,
    seed: int | None = None,
    drop_last: bool = False,
) -> EpochShard:
    """``rank``'s micro-batches of ``per_rank`` samples for the rest of an epoch of
    ``epoch_len`` samples, of which the job has consumed ``consumed`` (pure).

    The order is `epoch_order` ``(epoch_len, seed)``. Every rank of the world calls it
    with the same arguments but its rank, after a restart at any world size too.
    """
    for name, value, least in (
        ("epoch_len", epoch_len, 0),
        ("consumed", consumed, 0),
        ("rank", rank, 0),
        ("world_size", world_size, 1),
        ("per_rank", per_rank, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"shard_indices: {name} must be an int, got {value!r}")
        if value < least:
            raise ValueError(f"shard_indices: {name} must be >= {least}, got {value}")
    if consumed > epoch_len:
        raise ValueError(f"shard_indices: consumed {consumed} > epoch_len {epoch_len}")
    if rank >= world_size:
        raise ValueError(f"shard_indices: rank {rank} is not in a world of {world_size}")
    return EpochShard(epoch_order(epoch_len, seed), consumed, rank, world_size, per_rank, drop_last)
