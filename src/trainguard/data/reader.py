"""The node's one prefetching reader: a thread in whichever of the node's processes holds
the cache's lock file (``flock``; the kernel frees it when that process dies, and another
process's election thread takes over within ``ELECT_INTERVAL``).

Why a thread in a rank and not a process of its own: a process of the ranks' would be
killed with them (the agent stops a worker's process group), and the agent's own code
should not run user datasets. A thread reads while its rank trains: sample reads run on a
thread pool (``workers``), which overlaps I/O and anything that releases the GIL
(torch, numpy, tokenizers in Rust); a pure-Python transform is better done in a
DataLoader's worker processes, passed as an iterable source.

The reader's loop: read the board, take the nearest key not in the cache (each live
consumer's next ``ahead`` steps), read it from the source, and write it over a slot that no
consumer needs (`plan.victim`); a slot a consumer reported corrupt is checked and emptied.
Its layout (slot size and count) is fixed by the first batch it reads: a slot holds that
batch with a quarter to spare; a larger batch is stored in row pieces.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.atomic import write_text_atomic
from trainguard.data.plan import DemandBoard, cover, victim, wanted
from trainguard.data.slots import HEADER_BYTES, Key, SlotFile, encode_meta, tensors_of
from trainguard.data.source import Source, rows_of, slice_rows

__all__ = ["Election", "Settings", "open_layout"]

logger = logging.getLogger(__name__)
ELECT_INTERVAL = 0.1
IDLE_WAIT = 0.003
MAX_SLOTS = 4096


@dataclass(frozen=True)
class Settings:
    max_bytes: int
    slot_bytes: int | None
    ahead: int
    lookback: int
    workers: int


def open_layout(directory: Path) -> SlotFile | None:
    """The node's slot file once a reader has laid it out, else None."""
    try:
        layout = json.loads((directory / "layout.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return SlotFile(directory / "slots", int(layout["slot_bytes"]), int(layout["count"]))


def _create_layout(directory: Path, settings: Settings, sample_bytes: int) -> SlotFile:
    wanted_bytes = HEADER_BYTES + sample_bytes + sample_bytes // 4
    slot_bytes = settings.slot_bytes or -(-wanted_bytes // 4096) * 4096
    count = min(MAX_SLOTS, settings.max_bytes // slot_bytes)
    if count < 2:
        raise ValueError(
            f"max_bytes {settings.max_bytes} holds fewer than 2 slots of {slot_bytes} bytes"
        )
    for stale in ("slots", "slots.steps"):  # a reader that died before its layout.json
        (directory / stale).unlink(missing_ok=True)
    slots = SlotFile(directory / "slots", slot_bytes, count, create=True)
    layout = json.dumps({"slot_bytes": slot_bytes, "count": count})
    write_text_atomic(directory / "layout.json", layout, mode=0o644)
    logger.info("data cache %s: %d slots of %d bytes", directory, count, slot_bytes)
    return slots


class Election(threading.Thread):
    """Tries the node's reader lock every ``ELECT_INTERVAL``; holding it, reads until
    ``stop``. A reader's error is written to ``<directory>/error`` for every consumer."""

    def __init__(self, directory: Path, source: Source, settings: Settings) -> None:
        super().__init__(name="trainguard-data-reader", daemon=True)
        self.directory, self.source, self.settings = directory, source, settings
        self.stop = threading.Event()
        self._reports: dict[int, int] = {}  # each consumer's last corrupt-slot report seen
        self._lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.stop.wait(ELECT_INTERVAL)
                continue
            try:
                self._serve()
            except Exception as exc:  # every consumer of the node raises it
                if self.stop.is_set() or "interpreter shutdown" in str(exc):
                    return  # stopped in a read, not the source's fault
                logger.exception("data cache reader failed")
                # whole or absent: consumers poll for the file and read it at once
                error = f"{type(exc).__name__}: {exc}"
                write_text_atomic(self.directory / "error", error, mode=0o644)
                return
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                self.source.close()

    def close(self) -> None:
        self.finish()
        os.close(self._lock_fd)

    def finish(self) -> None:
        """Stop reading (also at the interpreter's exit, before its thread pools stop:
        a thread inside torch when the interpreter finalizes aborts the process)."""
        self.stop.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(5.0)

    def _serve(self) -> None:
        settings = self.settings
        board = DemandBoard(self.directory / "board")
        slots = open_layout(self.directory)
        held = _Held(slots)
        try:
            while not self.stop.is_set():
                consumers = board.consumers()
                if slots is not None:
                    self._check_reported(slots, held, consumers)
                live = [c for c in consumers if c.alive]
                missing = [k for k in wanted(live, settings.ahead) if cover(k, held.index) is None]
                if not missing:
                    self.stop.wait(IDLE_WAIT)
                    continue
                for key, batch in self.source.read(missing[: max(1, settings.workers)]):
                    if self.stop.is_set():
                        return
                    for piece, meta, parts in _pieces(key, batch, slots):
                        if slots is None:
                            slots = _create_layout(self.directory, settings, _size(meta, parts))
                            held = _Held(slots)
                        slot = self._free_slot(board, held)
                        if slot is None:
                            return
                        held.drop(slot)
                        slots.write(slot, piece, meta, parts)
                        held.put(slot, piece)
        finally:
            board.close()
            if slots is not None:
                slots.close()

    def _free_slot(self, board: DemandBoard, held: _Held) -> int | None:
        settings = self.settings
        while not self.stop.is_set():
            consumers = board.consumers()
            found = victim(held.index, held.free, consumers, settings.ahead, settings.lookback)
            if found is not None:
                return found
            self.stop.wait(IDLE_WAIT)
        return None

    def _check_reported(self, slots: SlotFile, held: _Held, consumers: Any) -> None:
        for c in consumers:
            if c.bad_slot < 0 or self._reports.get(c.pid) == c.report:
                continue
            self._reports[c.pid] = c.report
            key = held.key_of.get(c.bad_slot)
            if key is not None and slots.read(c.bad_slot, key)[1] == "corrupt":
                logger.warning("data cache slot %d (%s) is corrupt: emptied", c.bad_slot, key)
                slots.invalidate(c.bad_slot)
                held.empty(c.bad_slot)


class _Held:
    """The reader's view of the slots (it is their one writer): key by slot, slot by key,
    the empty ones."""

    def __init__(self, slots: SlotFile | None) -> None:
        self.key_of: dict[int, Key] = {}
        self.index: dict[Key, int] = {}
        self.free: list[int] = []
        if slots is not None:
            for slot, head in enumerate(slots.headers()):
                if head is None:
                    self.free.append(slot)
                else:
                    self.put(slot, head.key)
            self.free.reverse()

    def put(self, slot: int, key: Key) -> None:
        self.key_of[slot], self.index[key] = key, slot

    def drop(self, slot: int) -> None:
        """``slot`` is about to be written: neither held nor free."""
        key = self.key_of.pop(slot, None)
        if key is not None:
            self.index.pop(key, None)
        elif slot in self.free:
            self.free.remove(slot)

    def empty(self, slot: int) -> None:
        self.drop(slot)
        self.free.append(slot)


def _size(meta: bytes, parts: list[torch.Tensor]) -> int:
    return len(meta) + sum(int(part.numel()) for part in parts)


def _pieces(
    key: Key, batch: Any, slots: SlotFile | None
) -> Iterator[tuple[Key, bytes, list[torch.Tensor]]]:
    """``key``'s batch as pieces that fit a slot: the whole batch, else halves of its rows
    (and so on); raises ValueError when one row does not fit."""
    tensors: list[Any] = []
    meta, parts = encode_meta(tensors_of(batch, tensors), tensors)
    if slots is None or _size(meta, parts) <= slots.slot_bytes - HEADER_BYTES:
        yield key, meta, parts
        return
    rows = rows_of(batch)
    if rows < 2:
        raise ValueError(
            f"one row of batch {key.step} ({_size(meta, parts)} bytes) does not fit a slot of "
            f"{slots.slot_bytes - HEADER_BYTES} bytes: raise slot_bytes"
        )
    half = rows // 2
    yield from _pieces(Key(key.step, key.lo, key.lo + half), slice_rows(batch, 0, half), slots)
    yield from _pieces(Key(key.step, key.lo + half, key.hi), slice_rows(batch, half, rows), slots)
