"""`DataCache`: a rank's batches by step number, from the node's memory-mapped cache.

Batch ``step`` is the global batch at that position of the sequence; a rank gets its
rows, ``[rank * G / world, (rank + 1) * G / world)``, from the cache (the node's reader
fills it ahead of every rank, see `reader`), so a restarted, replaced or renumbered rank
finds its next batch there without reading the source. Its position (``state_dict``) goes
in the checkpoint; a rollback to an older step finds the batches behind in the cache too
(at least ``lookback`` steps, more as room allows).

Where: ``<memory tier's node directory>/data/<name>-<fingerprint>`` under trainguard
(``/dev/shm/trainguard-<uid>/<job>/<node>/...`` locally), removed with the memory tier when the
job ends; else ``/dev/shm/trainguard-data-<uid>/<TORCHELASTIC_RUN_ID or "local">/...``,
which nothing removes (`DataCache.directory`).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainguard.checkpoint.config import MEMORY_DIR_ENV
from trainguard.checkpoint.tier_dir import SHM, private_dir
from trainguard.data.plan import DemandBoard, cover
from trainguard.data.reader import Election, Settings, open_layout
from trainguard.data.slots import Key, SlotFile
from trainguard.data.source import IterableSource, MapSource, Source, concat_rows, slice_rows

__all__ = ["DataCache"]

POLL = 0.001


class DataCache:
    """Batches of ``source`` by step, through the node's shared cache.

    ``source``: a map-style dataset (``len`` and ``[i]``: samples read on ``workers``
    threads, collated with ``collate_fn``, default torch's ``default_collate``; ``shuffle``
    with ``seed + epoch``), or an iterable (a ``DataLoader``) whose n-th item is global
    batch n, ``global_batch`` rows. A batch is a tensor or a dict/tuple/list of tensors
    whose first dimension is the batch's rows.

    ``max_bytes``: the node's cache size (slots of one batch each, sized by the first
    batch or ``slot_bytes``); ``ahead``: steps prefetched past each rank's position;
    ``lookback``: steps kept behind it at least; ``timeout``: seconds to wait for a batch.
    """

    def __init__(
        self,
        source: Any,
        global_batch: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        workers: int = 4,
        name: str = "data",
        max_bytes: int = 512 << 20,
        slot_bytes: int | None = None,
        ahead: int = 8,
        lookback: int = 16,
        directory: str | os.PathLike[str] | None = None,
        timeout: float = 600.0,
    ) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, not {global_batch}")
        if ahead < 1 or lookback < 0 or workers < 1:
            raise ValueError("ahead and workers must be >= 1, lookback >= 0")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"name {name!r}: letters, digits, - and _ only")
        self.global_batch, self.timeout = global_batch, timeout
        self._make_source: Callable[[], Source]
        if _is_map_style(source):
            self._make_source = lambda: MapSource(
                source, global_batch, shuffle=shuffle, seed=seed, collate_fn=collate_fn,
                workers=workers,
            )  # fmt: skip
        else:
            self._make_source = lambda: IterableSource(source, global_batch)
        self._direct = self._make_source()  # a corrupt slot's rows, read here
        digest = hashlib.sha256(self._direct.fingerprint().encode()).hexdigest()[:12]
        root = Path(directory) if directory is not None else _default_root()
        self.directory = root / f"{name}-{digest}"
        private_dir(self.directory)
        self._board = DemandBoard(self.directory / "board")
        self._slots: SlotFile | None = None
        self.step = 0
        self._reader = Election(
            self.directory,
            self._make_source(),
            Settings(max_bytes, slot_bytes, ahead, lookback, workers),
        )
        self._reader_started = False
        self._publish(self.step)
        _at_thread_exit(self._reader.finish)

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in an epoch of a map-style source (the last partial batch dropped)."""
        return self._direct.steps_per_epoch if isinstance(self._direct, MapSource) else None

    def rows(self, step: int) -> Key:
        """This rank's rows of global batch ``step`` at the current rank and world size."""
        rank, world = _rank_world()
        if self.global_batch % world:
            raise ValueError(f"global_batch {self.global_batch} is not a multiple of world {world}")
        per = self.global_batch // world
        return Key(step, rank * per, (rank + 1) * per)

    def batch(self, step: int) -> Any:
        """This rank's rows of global batch ``step``: from the cache, waiting for the node's
        reader if it is not there yet (a corrupt slot is read from the source instead)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        key = self._publish(step)
        deadline = time.monotonic() + self.timeout
        while True:
            found, bad = self._from_cache(key)
            if not self._reader_started:
                # after the first look: a restart's first batch waits for no thread start
                self._reader_started = True
                self._reader.start()
            if found is not None:
                self._publish(step + 1)  # where the reader prefetches from next
                return found
            if bad >= 0:  # never used: the reader checks and empties it
                self._publish(step, bad)
                found = next(iter(self._direct.read([key])))[1]
                self._publish(step + 1)
                return found
            error = self.directory / "error"
            if error.exists():
                reason = error.read_text(encoding="utf-8")
                raise RuntimeError(f"data cache reader failed: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {step} not in the data cache after {self.timeout} s")
            time.sleep(POLL)

    def __iter__(self) -> Iterator[Any]:
        """Batches from `step` on; `step` counts the ones taken."""
        while True:
            batch = self.batch(self.step)
            self.step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position (a DCP ``Stateful``): the next step `__iter__` takes."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"data cache state: step must be an int >= 0, not {step!r}")
        self.step = step
        self._publish(step)

    def close(self) -> None:
        """Stop reading (another rank of the node takes over) and leave the board."""
        self._reader.close()
        self._board.leave(_local_index())
        self._board.close()
        if self._slots is not None:
            self._slots.close()
        self._direct.close()
        self._reader.source.close()

    def __enter__(self) -> DataCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _publish(self, step: int, bad_slot: int | None = None) -> Key:
        key = self.rows(step)
        self._board.publish(_local_index(), step, key, bad_slot)
        return key

    def _from_cache(self, key: Key) -> tuple[Any, int]:
        """(the batch, -1), (None, a corrupt slot) or (None, -1): not there (yet)."""
        if self._slots is None:
            self._slots = open_layout(self.directory)
            if self._slots is None:
                return None, -1
        pieces = cover(key, self._slots.holding(key.step))
        if pieces is None:
            return None, -1
        parts = []
        for piece, slot in pieces:
            batch, why = self._slots.read(slot, piece)
            if batch is None:
                return None, slot if why == "corrupt" else -1
            lo, hi = max(key.lo, piece.lo) - piece.lo, min(key.hi, piece.hi) - piece.lo
            parts.append(
                batch if (lo, hi) == (0, piece.hi - piece.lo) else slice_rows(batch, lo, hi)
            )
        return concat_rows(parts), -1


def _at_thread_exit(callback: Callable[[], None]) -> None:
    """``callback`` when the interpreter exits, before the thread pools' own exit hooks
    (``threading._register_atexit``, which ``concurrent.futures`` uses; the callbacks
    run last registered first); ``atexit`` where it is missing."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(callback)
    except RuntimeError:  # missing, or the interpreter already shutting down
        atexit.register(callback)


def _is_map_style(source: Any) -> bool:
    import torch.utils.data

    if isinstance(source, torch.utils.data.IterableDataset | torch.utils.data.DataLoader):
        return False
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


def _default_root() -> Path:
    memory = os.environ.get(MEMORY_DIR_ENV)
    if memory:
        return Path(memory).parent / "data"
    run = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return private_dir(SHM / f"trainguard-data-{os.getuid()}") / run


def _local_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) % 256


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
