"""The memory tier: one rank's snapshots in pre-faulted shared-memory slot files.

Each rank owns ``keep`` slots in the tier's directory (on ``/dev/shm``, owned by the node
agent, so the files outlive a crashed worker): ``rank-<R>-slot-<i>.data`` (the tensor
bytes, mapped once, allocated with ``posix_fallocate`` and pre-faulted with
``MADV_POPULATE_WRITE``, then reused) and ``rank-<R>-slot-<i>.meta`` (the shard meta).

A slot's meta is its commit, and it changes only by ``rename`` of a complete file:

1. :meth:`MemoryTier.begin` unlinks the meta of the slot about to be overwritten
   (the oldest), *before* any byte of it changes;
2. the caller copies the tensors into :meth:`MemoryTier.buffer`;
3. :meth:`MemoryTier.commit` writes the meta without a checksum (*copy-complete*);
4. in the background, the checksum is computed and the meta re-written with it.

Consistency argument: the data file is a shared mapping of tmpfs, so every byte the
copy wrote is in the page cache the moment the copy returns and survives the process
(not the node: the memory tier never outlives its node). A meta, with or without a
checksum, exists only for a slot whose copy finished, because the meta is unlinked
before a slot is reused and written only after the copy. Hence a copy-complete meta
names complete data, and a slot torn by a crash mid-copy has no meta and is never
offered. Checksums then guard against corruption of the memory after the fact: a shard
with one is loaded only if its data matches it; a copy-complete shard, which nothing can
verify, only by its writer (the same rank within the same attempt, recorded as the meta's
``writer``; see :func:`~trainguard.checkpoint.shard.unchecked_refusal`). Any other
reader, a restarted rank in a later attempt included, falls back to an older step. Shards
leave the node (replicas, durable tier) only with a checksum.

Holding a step for the durable tier (when the node agent persists, ``hold=True``): each
rank then has one slot more than ``keep``, and one slot is kept out of rotation: the one
with the smallest step at or after the step named in the directory's ``hold.json``
(``{"from_step": N}``, written by the agent while it waits to persist that step), else the
newest snapshot whose meta is flagged ``"persist": true``. So a step the agent is about
to copy is never overwritten under it, however fast the training loop saves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.checkpoint import host_memory
from trainguard.checkpoint.files import hold_from
from trainguard.checkpoint.shard import ShardInvalid, check_identity, encode_meta, layout_of
from trainguard.checkpoint.state import Layout
from trainguard.checkpoint.tier_dir import open_private, private_dir, user_root

__all__ = ["MemoryShard", "MemoryTier", "default_memory_dir"]

log = logging.getLogger(__name__)

GROWTH = 1.0625
"""A slot that must grow gets this much headroom beyond the size asked for."""
MIN_SLOT_BYTES = 1 << 16


def default_memory_dir(environ: Mapping[str, str] | None = None) -> str:
    """``/dev/shm/trainguard-<uid>/<TORCHELASTIC_RUN_ID or "local">`` (outside trainguard)."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID") or "local"
    return str(user_root() / run_id)


Pause = Callable[[], None]
"""Called between chunks of background work on a slot; blocks while a save copies."""

Skipped = Callable[[str, "int | None", str], None]
"""Told of a shard :meth:`MemoryTier.shards` skips: its meta file, its step (None: not
known), and why."""


@dataclass(frozen=True)
class MemoryShard:
    """A loadable shard found in the memory tier."""

    slot: int
    step: int
    meta: dict[str, Any]


class _Slot:
    """One slot file, mapped read-write (once first used) for the life of the tier.

    An existing file is mapped by the first :meth:`open` or :meth:`ensure`, not when the
    slot is looked at: a restarted rank maps the slot it restores from at once, and leaves
    the others to be mapped (and pre-faulted) in the background.
    ``pinned``: the mapping is page-locked for CUDA copies (:mod:`.host_memory`); it is
    unregistered before it is unmapped, and a slot that grows is registered again.
    """

    def __init__(self, data_path: str) -> None:
        self.data_path = data_path
        self.fd = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o600)
        self.capacity = os.fstat(self.fd).st_size
        self.map: mmap.mmap | None = None
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self.pin_failed = False  # page-locking this mapping failed: not tried again

    def open(self, pause: Pause | None = None) -> None:
        """Map (and pre-fault) the file as it is, if it is not yet mapped."""
        if self.map is None and self.capacity:
            self._map(pause)

    def ready(self, nbytes: int, pin: bool) -> bool:
        """Whether the slot holds ``nbytes`` pre-faulted (and page-locked, if ``pin``)."""
        locked = self.pinned or self.pin_failed or not pin
        return self.capacity >= nbytes and self.map is not None and locked

    def ensure(self, nbytes: int, pin: bool = False, pause: Pause | None = None) -> bool:
        """Grow (and pre-fault) the slot to hold ``nbytes``, page-lock it if ``pin``;
        returns whether it did anything. ``pause``: see :func:`host_memory.populate`."""
        if self.ready(nbytes, pin):
            return False
        if self.capacity >= nbytes:
            self.open(pause)
        if self.capacity < nbytes or self.map is None:
            size = max(MIN_SLOT_BYTES, int(nbytes * GROWTH) // 4096 * 4096 + 4096)
            self._unmap()
            try:
                os.posix_fallocate(self.fd, 0, size)  # ENOSPC here, not SIGBUS during a copy
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot allocate {size} bytes for memory slot {self.data_path}"
                ) from exc
            self.capacity = size
            self._map(pause)
        if pin and not self.pinned and self.buffer is not None:
            self.pinned = host_memory.register(self.buffer.data_ptr(), self.capacity)
            self.pin_failed = not self.pinned
        return True

    def _map(self, pause: Pause | None = None) -> None:
        self.map = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        if not host_memory.populate(self.buffer.data_ptr(), self.capacity, pause):
            self.buffer = None  # older kernel: pre-fault at map time instead
            self.map.close()
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, self.capacity, flags=flags)
            self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)

    def _unmap(self) -> None:
        if self.pinned and self.buffer is not None:
            host_memory.unregister(self.buffer.data_ptr())
        self.pinned = self.pin_failed = False
        self.buffer = None
        if self.map is not None:
            # Views of the mapping still alive (a caller's tensor or memoryview) keep it
            # open; it is then unmapped when the last of them goes away.
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


class MemoryTier:
    """One rank's memory slots in ``directory``."""

    def __init__(
        self,
        directory: str,
        *,
        rank: int,
        world_size: int,
        job_id: str,
        keep: int,
        hold: bool = False,
    ):
        if keep < 1:
            raise ValueError(f"memory keep must be >= 1, got {keep}")
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.keep = keep
        self.hold = hold
        self.slots = keep + 1 if hold else keep
        self._flagged: dict[int, bool] = {}  # slot -> its meta asks to be persisted
        private_dir(directory)  # 0700, this user's own (tier_dir.py)
        self._slots: dict[int, _Slot] = {}
        self._steps: dict[int, int] | None = None  # slot -> committed step (writable slots)

    def _prefix(self, slot: int) -> str:
        return os.path.join(self.directory, f"rank-{self.rank}-slot-{slot}")

    def meta_path(self, slot: int) -> str:
        return self._prefix(slot) + ".meta"

    def data_path(self, slot: int) -> str:
        return self._prefix(slot) + ".data"

    def _slot(self, index: int) -> _Slot:
        if index not in self._slots:
            self._slots[index] = _Slot(self.data_path(index))
        return self._slots[index]

    # -- listing ----------------------------------------------------------------------

    def _slot_indexes(self) -> list[int]:
        pattern = re.compile(rf"rank-{self.rank}-slot-(\d+)\.meta$")
        found = set(range(self.slots))
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                match = pattern.match(name)
                if match:
                    found.add(int(match.group(1)))
        return sorted(found)

    def read_meta(self, slot: int) -> dict[str, Any] | None:
        """The meta of ``slot``; None if it has none (empty, being written, or torn)."""
        try:
            return self._meta(slot)
        except ShardInvalid as exc:
            log.warning("memory tier: skipping %s: %s", self.meta_path(slot), exc)
            return None

    def _meta(self, slot: int) -> dict[str, Any] | None:
        """The meta of ``slot``, None if there is none; ShardInvalid: it is not one."""
        try:
            with open(self.meta_path(slot), "rb") as file:
                meta = json.loads(file.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ShardInvalid(f"unreadable meta ({exc})") from None
        if not isinstance(meta, dict):
            raise ShardInvalid("the meta is not a JSON object")
        return meta

    def shards(self, skipped: Skipped | None = None) -> dict[int, MemoryShard]:
        """Step -> shard for every slot whose meta belongs to this job and rank.

        Cheap (no checksum): foreign, malformed or short shards are skipped, each told to
        ``skipped`` (default: logged); the checksum (or, without one, the writer) is
        checked by the Checkpointer on the step actually restored.
        """
        found: dict[int, MemoryShard] = {}
        for slot in self._slot_indexes():
            try:
                meta = self._meta(slot)
            except ShardInvalid as exc:
                self._skip(skipped, slot, None, exc)
                continue
            if meta is None:
                continue
            try:
                check_identity(
                    meta, job_id=self.job_id, world_size=self.world_size, step=None, rank=self.rank
                )
                layout = layout_of(meta)
                size = os.path.getsize(self.data_path(slot))
                if size < layout.nbytes:
                    raise ShardInvalid(f"data has {size} bytes, meta says {layout.nbytes}")
            except (ShardInvalid, OSError) as exc:
                step = meta.get("step")
                self._skip(skipped, slot, step if isinstance(step, int) else None, exc)
                continue
            step = int(meta["step"])
            if step not in found or slot < found[step].slot:
                found[step] = MemoryShard(slot, step, meta)
        return found

    def _skip(self, skipped: Skipped | None, slot: int, step: int | None, why: Exception) -> None:
        where = self.meta_path(slot)
        if skipped is not None:
            skipped(where, step, str(why))
        else:
            log.warning(
                "memory tier: skipping %s (step %s, rank %d): %s", where, step, self.rank, why
            )

    def data(self, slot: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of ``slot``'s data (a view of the mapping)."""
        mapped = self._slot(slot)
        mapped.open()
        if mapped.map is None or mapped.capacity < nbytes:
            raise ShardInvalid(
                f"{self.data_path(slot)} holds {mapped.capacity} bytes, not {nbytes}"
            )
        return memoryview(mapped.map)[:nbytes]

    def buffer(self, slot: int) -> torch.Tensor:
        """``slot``'s data as a flat uint8 tensor sharing the mapping."""
        mapped = self._slot(slot)
        mapped.open()
        if mapped.buffer is None:
            raise ShardInvalid(f"{self.data_path(slot)} is empty")
        return mapped.buffer

    # -- writing ----------------------------------------------------------------------

    def choose_slot(self, step: int) -> int:
        """Where a snapshot of ``step`` goes: a slot holding ``>= step``, a free one, the
        oldest; never the held slot (see the module docstring)."""
        if self._steps is None:
            self._steps = {}
            for slot in range(self.slots):
                meta = self.read_meta(slot)
                if meta is not None and isinstance(meta.get("step"), int):
                    self._steps[slot] = meta["step"]
                    self._flagged[slot] = meta.get("persist") is True
        steps = {s: held for s, held in self._steps.items() if s < self.slots}
        held_slot = self._held_slot(steps)
        candidates = [slot for slot in range(self.slots) if slot != held_slot]
        for slot in candidates:
            if slot in steps and steps[slot] >= step:  # a redundant or abandoned snapshot
                return slot
        for slot in candidates:
            if slot not in steps:
                return slot
        return min(candidates, key=lambda slot: steps[slot])

    def _held_slot(self, steps: dict[int, int]) -> int | None:
        if not self.hold:
            return None
        start = hold_from(self.directory)
        if start is not None:
            wanted = [(held, slot) for slot, held in steps.items() if held >= start]
            if wanted:
                return min(wanted)[1]
        flagged = [(held, slot) for slot, held in steps.items() if self._flagged.get(slot)]
        return max(flagged)[1] if flagged else None

    def begin(self, slot: int, nbytes: int, pin: bool = False) -> tuple[torch.Tensor, bool]:
        """Uncommit ``slot`` and make it hold ``nbytes`` (page-locked if ``pin``); returns
        its buffer to copy into, and whether the slot had to be prepared first."""
        self.drop(slot)
        mapped = self._slot(slot)
        prepared = mapped.ensure(nbytes, pin)
        assert mapped.buffer is not None
        return mapped.buffer, prepared

    def unready(self, nbytes: int, pin: bool = False) -> list[int]:
        """The slots that would need preparing for ``nbytes``; those that must grow are
        uncommitted now (their data is about to be replaced).

        The main thread calls this; :meth:`prepare_slot` of each may then run in the
        background, as long as nothing else uses those slots meanwhile.
        """
        unready = []
        for slot in range(self.slots):
            mapped = self._slot(slot)
            if not mapped.ready(nbytes, pin):
                if mapped.capacity < nbytes:
                    self.drop(slot)
                unready.append(slot)
        return unready

    def prepare_slot(
        self, slot: int, nbytes: int, pin: bool = False, pause: Pause | None = None
    ) -> None:
        """Allocate, pre-fault (and page-lock) one slot listed by :meth:`unready`
        (``pause``: see :func:`host_memory.populate`)."""
        self._slots[slot].ensure(nbytes, pin, pause)

    def prepare(self, nbytes: int, pin: bool = False) -> None:
        """Allocate and pre-fault (and page-lock) every slot to ``nbytes`` now.

        Keeps committed slots: a slot that must grow is uncommitted first.
        """
        for slot in self.unready(nbytes, pin):
            self.prepare_slot(slot, nbytes, pin)

    def reserve(self, slot: int, step: int) -> None:
        """Count ``slot`` as holding ``step`` (its commit is on the way) when choosing slots."""
        if self._steps is not None:
            self._steps[slot] = step

    def commit(self, slot: int, meta: dict[str, Any]) -> None:
        """Make ``slot`` loadable with ``meta`` (tmp file + rename)."""
        path = self.meta_path(slot)
        tmp = f"{path}.tmp"
        with open_private(tmp) as file:
            file.write(encode_meta(meta))
        os.replace(tmp, path)
        if self._steps is not None and isinstance(meta.get("step"), int):
            self._steps[slot] = meta["step"]
            self._flagged[slot] = meta.get("persist") is True

    def drop(self, slot: int) -> None:
        """Make ``slot`` unloadable (its data may be overwritten from now on)."""
        if self._steps is not None:
            self._steps.pop(slot, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.meta_path(slot))

    def drop_newer_than(self, step: int) -> None:
        """Drop shards newer than ``step``: they belong to a timeline that was abandoned."""
        for slot in self._slot_indexes():
            meta = self.read_meta(slot)
            if meta is not None and isinstance(meta.get("step"), int) and meta["step"] > step:
                log.info("memory tier: dropping step %d (newer than %d)", meta["step"], step)
                self.drop(slot)

    def load(self, shard: MemoryShard, layout: Layout) -> torch.Tensor:
        """The buffer of ``shard`` (no copy), for :func:`~trainguard.checkpoint.state.restore`."""
        return self.buffer(shard.slot)[: layout.nbytes]

    def close(self) -> None:
        """Unmap the slots; the files stay (the agent owns the directory)."""
        for mapped in self._slots.values():
            mapped.close()
        self._slots.clear()

    def remove(self) -> None:
        """Delete this rank's slot files, then the directory once no rank has any left
        (the last rank of the node to call this removes it). After :meth:`close`."""
        for slot in self._slot_indexes():
            for path in (self.data_path(slot), self.meta_path(slot), f"{self.meta_path(slot)}.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        with contextlib.suppress(OSError):  # another rank's files are still there
            os.rmdir(self.directory)
