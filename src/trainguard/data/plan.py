"""The node's consumers (one entry per local rank, in a small shared file) and the pure
decisions made from them: which keys to prefetch, which slots cover a key, which slot to
overwrite."""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainguard.data.slots import Key
from trainguard.platform import procs

__all__ = ["Consumer", "DemandBoard", "cover", "victim", "wanted"]

ENTRY = struct.Struct("<qqqqqd")  # pid, step, lo, hi, report, updated (epoch seconds)
# A corrupt-slot report: (count of reports) * REPORTS + slot + 1, kept until the next one,
# so that the reader sees each report once however soon the rank publishes again.
REPORTS = 1 << 32
ENTRIES = 256
# A consumer whose process is gone keeps its lookback this long (its replacement's restart).
KEEP_DEAD_SECONDS = 120.0


@dataclass(frozen=True)
class Consumer:
    pid: int
    step: int
    lo: int
    hi: int
    bad_slot: int  # the slot it last found corrupt, -1: none
    updated: float
    alive: bool
    report: int = 0  # changes with each report


class DemandBoard:
    """Where each local rank says which rows of which step it needs next."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < ENTRY.size * ENTRIES:
                os.ftruncate(fd, ENTRY.size * ENTRIES)
            self._map = mmap.mmap(fd, ENTRY.size * ENTRIES)
        finally:
            os.close(fd)

    def publish(self, index: int, step: int, key: Key, bad_slot: int | None = None) -> None:
        """Rank ``index`` needs ``key`` of ``step`` next; ``bad_slot``: it found that slot
        corrupt (else the last report stays)."""
        offset = index * ENTRY.size
        report = ENTRY.unpack_from(self._map, offset)[4]
        if bad_slot is not None:
            report = (report // REPORTS + 1) * REPORTS + bad_slot + 1
        ENTRY.pack_into(self._map, offset, os.getpid(), step, key.lo, key.hi, report, time.time())

    def leave(self, index: int) -> None:
        ENTRY.pack_into(self._map, index * ENTRY.size, 0, 0, 0, 0, 0, 0.0)

    def consumers(self) -> list[Consumer]:
        found = []
        now = time.time()
        for pid, step, lo, hi, report, updated in ENTRY.iter_unpack(self._map):
            if pid <= 0:
                continue
            alive = procs.alive(pid)
            if alive or now - updated < KEEP_DEAD_SECONDS:
                bad = report % REPORTS - 1
                found.append(Consumer(pid, step, lo, hi, bad, updated, alive, report))
        return found

    def close(self) -> None:
        self._map.close()


def cover(key: Key, index: Mapping[Key, int]) -> list[tuple[Key, int]] | None:
    """Slots whose rows of ``key.step``, in order, make up ``key``'s rows exactly (an
    exact slot first; else pieces, e.g. two ranks' slices for a rank of a smaller world),
    or None."""
    if key in index:
        return [(key, index[key])]
    pieces = sorted(k for k in index if k.step == key.step and k.lo < key.hi and k.hi > key.lo)
    found, at = [], key.lo
    while at < key.hi:
        starting = [k for k in pieces if k.lo <= at < k.hi]
        if not starting:
            return None
        best = max(starting, key=lambda k: k.hi)
        found.append((best, index[best]))
        at = best.hi
    return found


def wanted(consumers: Sequence[Consumer], ahead: int) -> list[Key]:
    """The keys to have in the cache, nearest first: each live consumer's next ``ahead``."""
    keys: list[Key] = []
    for distance in range(ahead):
        for c in consumers:
            key = Key(c.step + distance, c.lo, c.hi)
            if c.alive and key not in keys:
                keys.append(key)
    return keys


def victim(
    index: Mapping[Key, int],
    free: Sequence[int],
    consumers: Sequence[Consumer],
    ahead: int,
    lookback: int,
) -> int | None:
    """The slot to overwrite: an empty one (``free``), else one of ``index`` (the slots
    held, by key) that no consumer may need (outside every consumer's
    ``[step - lookback, step + ahead)`` for its rows), the oldest first and then the
    farthest ahead; None when every slot is needed."""
    if free:
        return free[-1]

    def needed(key: Key) -> bool:
        return any(
            c.step - lookback <= key.step < c.step + ahead and key.lo < c.hi and key.hi > c.lo
            for c in consumers
        )

    low = min((c.step for c in consumers), default=0)
    best: tuple[int, int] | None = None  # (rank: lower is better, slot)
    for key, slot in index.items():
        rank = key.step - low if key.step < low else (1 << 62) - key.step
        if (best is None or rank < best[0]) and not needed(key):
            best = (rank, slot)
    return None if best is None else best[1]
