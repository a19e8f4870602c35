"""The Checkpointer's background thread: checksums, commits, durable writes, slot preparation.

``save()`` hands each snapshot to :class:`Background` as a :class:`Snapshot` (checksum it,
re-commit its meta with the checksum, write it to the durable tier when due; for a
non-blocking CUDA save, commit it first once its copies are done) and, after a save of a
new size, a :class:`Prepare` of each other slot (one task a slot: the next save waits for
its own slot only). A task's slots stay *busy* until it is done, so a save never writes
into a slot the thread still reads. Rank 0 also commits durable steps once every rank's
shard is there. A failure is kept and raised from the next ``save()`` or ``wait()`` as
:class:`CheckpointError`. The checksum runs in 16 MiB chunks, a slot's pre-faulting in
64 MiB chunks, and both wait between chunks while a ``save()`` copies
(:meth:`Background.copying`): the copy does not share the memory bandwidth, or a busy
host's core, with them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.copying import CopyDone, on_device
from trainguard.checkpoint.memory import MemoryTier
from trainguard.checkpoint.room import no_room
from trainguard.checkpoint.shard import checksum
from trainguard.control.events import EventKind
from trainguard.monitor import worker_events

if TYPE_CHECKING:
    from trainguard.checkpoint.durable import DurableTier

__all__ = ["Background", "CheckpointError", "Prepare", "Snapshot"]

log = logging.getLogger(__name__)

COMMIT_POLL_INTERVAL = 0.5
"""Seconds between rank 0's checks for the other ranks' durable shards."""
SLOW_SLOT_WAIT = 0.1
"""A save() that waits longer than this for its slot logs a warning."""


class CheckpointError(RuntimeError):
    """Background checkpoint work failed (raised from the next ``save()`` or ``wait()``)."""


@dataclass(frozen=True)
class Snapshot:
    """Checksum (and maybe persist) the snapshot in ``slot``; commit it first if ``copy``
    is given (a non-blocking CUDA save: the copy-complete meta waits for the copies)."""

    step: int
    slot: int
    meta: dict[str, Any]
    durable: bool
    copy: CopyDone | None = None

    @property
    def slots(self) -> tuple[int, ...]:
        return (self.slot,)


@dataclass(frozen=True)
class Prepare:
    """Allocate, pre-fault (and page-lock) ``slots`` for snapshots of ``nbytes``."""

    slots: tuple[int, ...]
    nbytes: int
    pin: bool
    device: int | None  # the CUDA device to page-lock for (the thread's current device)


class Background:
    """One thread per Checkpointer, started by the first task."""

    def __init__(
        self,
        memory: MemoryTier,
        config: CheckpointConfig,
        durable: Callable[[], DurableTier],
    ) -> None:
        self.memory = memory
        self.config = config
        self._durable = durable
        self._queue: queue.Queue[Snapshot | Prepare | None] = queue.Queue()
        self._cond = threading.Condition()
        self._busy: dict[int, int] = {}  # slot -> background tasks still reading it
        self._pending = 0  # tasks queued or running
        self._commits: dict[int, float] = {}  # rank 0: step -> deadline of its durable commit
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._not_copying = threading.Event()  # clear while save() copies (see copying())
        self._not_copying.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def submit(self, task: Snapshot | Prepare) -> None:
        """Queue ``task``; its slots stay busy until it is done."""
        with self._cond:
            for slot in task.slots:
                self._busy[slot] = self._busy.get(slot, 0) + 1
            self._pending += 1
        self._start()
        self._queue.put(task)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """While save() copies into a slot: the background checksum and slot preparation
        pause between their chunks, so the copy has the memory bandwidth (and, on a busy
        host, the core) to itself."""
        self._not_copying.clear()
        try:
            yield
        finally:
            self._not_copying.set()

    def _pause(self) -> None:
        self._not_copying.wait()

    def wait_for_slot(self, slot: int, step: int) -> None:
        """Block until no task reads ``slot`` (raises a background failure)."""
        start = time.monotonic()
        with self._cond:
            while self._busy.get(slot, 0) and self._error is None:
                self._cond.wait()
        waited = time.monotonic() - start
        if waited > SLOW_SLOT_WAIT:
            log.warning(
                "Checkpointer.save(%d) waited %.2f s for background work on its memory slot; "
                "checkpoint less often or keep more memory snapshots", step, waited,
            )  # fmt: skip
        self.raise_error()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every task and durable commit is done (``TimeoutError`` after
        ``timeout`` seconds); re-raises a background failure as CheckpointError."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._pending == 0 and not self._commits, timeout=timeout
            )
        self.raise_error()
        if not done:
            raise TimeoutError(f"Checkpointer.wait: background work not done after {timeout} s")

    def raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"checkpoint background work failed: {error}") from error

    def stop(self, timeout: float | None = None) -> None:
        """End the thread after the tasks already queued."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name=f"trainguard-checkpoint-rank{self.config.rank}", daemon=True
            )
            self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                task = self._queue.get(timeout=COMMIT_POLL_INTERVAL if self._commits else None)
            except queue.Empty:
                self._guarded(self._retry_commits)
                continue
            if task is None:
                return
            try:
                self._guarded(functools.partial(self._run_task, task))
            finally:
                with self._cond:
                    for slot in task.slots:
                        self._busy[slot] -= 1
                    self._pending -= 1
                    self._cond.notify_all()
            self._guarded(self._retry_commits)

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:
            log.error("checkpoint background work failed: %s", exc, exc_info=True)
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _run_task(self, task: Snapshot | Prepare) -> None:
        if isinstance(task, Prepare):
            # A thread's current CUDA device is 0 until set: page-lock for the rank's own.
            with on_device(task.device):
                for slot in task.slots:
                    try:
                        self.memory.prepare_slot(slot, task.nbytes, task.pin, self._pause)
                    except OSError as exc:
                        if not no_room(exc):
                            raise
                        # Not an error: the save that needs the slot meets it (room.py).
                        log.warning("memory slot %d not prepared: %s", slot, exc)
                        return
            return
        if task.copy is not None:  # a non-blocking save: commit once its copies are done
            task.copy.wait()
            if not self._commit(task.slot, task.meta):
                return
        self._persist(task)

    def _commit(self, slot: int, meta: dict[str, Any]) -> bool:
        """Write ``slot``'s meta; False when the memory tier has no room for it (not an
        error: that snapshot is not offered, or stays copy-complete; see room.py)."""
        try:
            self.memory.commit(slot, meta)
        except OSError as exc:
            if not no_room(exc):
                raise
            log.warning("memory slot %d: meta of step %s not written: %s", slot, meta["step"], exc)
            return False
        return True

    def _persist(self, task: Snapshot) -> None:
        with self.memory.data(task.slot, task.meta["nbytes"]) as data:
            meta = {**task.meta, "checksum": checksum(data, self._pause)}
            if not self._commit(task.slot, meta) or not task.durable:
                return
            started = time.monotonic()
            self._durable().write_shard(task.step, self.config.rank, data, meta)
        log.info(
            "checkpoint step %d: rank %d's shard (%d bytes) written to %s in %.2f s",
            task.step, self.config.rank, meta["nbytes"], self.config.durable_url,
            time.monotonic() - started,
        )  # fmt: skip
        if self.config.rank == 0:
            with self._cond:
                self._commits[task.step] = time.monotonic() + self.config.commit_timeout

    def _retry_commits(self) -> None:
        """Rank 0: commit durable steps whose every shard is present; prune; give up late."""
        for step in sorted(self._commits):
            tier = self._durable()
            try:
                committed = tier.commit(step, self.config.world_size)
                if committed:
                    log.info("checkpoint step %d committed to %s", step, self.config.durable_url)
                    worker_events.emit(
                        EventKind.CHECKPOINT_COMMITTED,
                        f"step {step} committed to durable storage",
                        step=step,
                        url=self.config.durable_url,
                    )
                    pruned = tier.prune(self.config.durable_keep)
                    if pruned:
                        log.info("pruned durable checkpoint steps %s", pruned)
                elif time.monotonic() > self._commits[step]:
                    log.warning(
                        "checkpoint step %d not committed to %s: not every rank's shard arrived "
                        "within %.0f s", step, self.config.durable_url, self.config.commit_timeout,
                    )  # fmt: skip
                    committed = True  # give up on it
            except Exception as exc:
                committed = True  # not retried
                with self._cond:
                    self._error = exc  # before the commit leaves the pending set
                raise
            finally:
                if committed:
                    with self._cond:
                        self._commits.pop(step, None)
                        self._cond.notify_all()
