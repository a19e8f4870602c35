"""Where batches come from: a map-style dataset (random access by sample) or an iterable
(a DataLoader, an IterableDataset, a generator) whose n-th item is global batch n; and
the row operations on a collated batch (slice, concatenate).

A map-style dataset of ``N`` samples with global batch ``G`` has ``N // G`` steps an
epoch (the last partial batch is dropped); step ``s`` is batch ``s % (N // G)`` of epoch
``s // (N // G)``, whose order is `trainguard.elastic.data.epoch_order` (``seed + epoch``
when shuffled). An iterable is read in order; reaching an earlier step means iterating
again from its start (done by the node's reader in the background, see `reader`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from trainguard.data.slots import Key
from trainguard.elastic.data import epoch_order

__all__ = ["IterableSource", "MapSource", "Source", "concat_rows", "rows_of", "slice_rows"]


class Source(Protocol):
    def fingerprint(self) -> str: ...

    def read(self, keys: Sequence[Key]) -> Iterator[tuple[Key, Any]]:
        """Each key's batch (its rows of its global batch), in order."""
        ...

    def close(self) -> None: ...


class MapSource:
    """Samples ``dataset[i]`` read on ``workers`` threads and collated."""

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        *,
        shuffle: bool,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        workers: int,
    ) -> None:
        self.dataset, self.global_batch = dataset, global_batch
        self.length = len(dataset)
        if self.length < global_batch:
            raise ValueError(f"global_batch {global_batch} > the dataset's {self.length} samples")
        self.steps_per_epoch = self.length // global_batch
        self.shuffle, self.seed, self.workers = shuffle, seed, workers
        self.collate = collate_fn or torch.utils.data.default_collate
        self._orders: dict[int, Sequence[int]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def fingerprint(self) -> str:
        return f"map:{self.length}:{self.global_batch}:{self.shuffle}:{self.seed}"

    def indices(self, key: Key) -> list[int]:
        epoch, within = divmod(key.step, self.steps_per_epoch)
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            seed = self.seed + epoch if self.shuffle else None
            self._orders[epoch] = epoch_order(self.length, seed)
        order = self._orders[epoch]
        start = within * self.global_batch
        return [order[start + row] for row in range(key.lo, key.hi)]

    def read(self, keys: Sequence[Key]) -> Iterator[tuple[Key, Any]]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="trainguard-data")
        pending: list[tuple[Key, list[Future[Any]]]] = [
            (key, [self._pool.submit(self.dataset.__getitem__, i) for i in self.indices(key)])
            for key in keys
        ]
        for key, futures in pending:
            yield key, self.collate([f.result() for f in futures])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class IterableSource:
    """``iter(iterable)``'s n-th item is global batch n (``global_batch`` rows)."""

    def __init__(self, iterable: Iterable[Any], global_batch: int) -> None:
        self.iterable, self.global_batch = iterable, global_batch
        self._iterator: Iterator[Any] | None = None
        self._next = 0

    def fingerprint(self) -> str:
        return f"iter:{type(self.iterable).__name__}:{self.global_batch}"

    def read(self, keys: Sequence[Key]) -> Iterator[tuple[Key, Any]]:
        for key in keys:
            yield key, slice_rows(self._batch(key.step), key.lo, key.hi)

    def _batch(self, step: int) -> Any:
        if self._iterator is None or step < self._next:
            self._iterator, self._next = iter(self.iterable), 0
        while True:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                raise IndexError(f"the iterable ended before batch {step}") from None
            self._next += 1
            if self._next - 1 == step:
                if rows_of(batch) != self.global_batch:
                    raise ValueError(
                        f"batch {step} has {rows_of(batch)} rows, "
                        f"global_batch is {self.global_batch}"
                    )
                return batch

    def close(self) -> None:
        self._iterator = None


def _leaves(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, tuple | list):
        for value in batch:
            yield from _leaves(value)


def rows_of(batch: Any) -> int:
    """The rows of a collated batch: its tensors' first dimension (all the same)."""
    sizes = {leaf.shape[0] if leaf.dim() else -1 for leaf in _leaves(batch)}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(f"a batch's tensors must share their first dimension (rows): {sizes}")
    return sizes.pop()


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def slice_rows(batch: Any, lo: int, hi: int) -> Any:
    return _map(batch, lambda t: t[lo:hi])


def concat_rows(parts: Sequence[Any]) -> Any:
    """Parts of one batch, in row order, as one batch."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, dict):
        return {k: concat_rows([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple | list):
        return type(first)(concat_rows([p[i] for p in parts]) for i in range(len(first)))
    return first
