"""The :class:`Checkpointer`: snapshots into the memory tier, persistence in the background.

One background thread per Checkpointer (:mod:`.background`) takes each snapshot's
checksum, commits its memory meta, and (when due) writes the shard to the durable tier;
rank 0 then commits the step there once every rank's shard is present, and prunes old
steps. ``save()`` is called from one thread (the training loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint.background import Background, CheckpointError, Prepare, Snapshot
from trainguard.checkpoint.config import CheckpointConfig, writer_attempt
from trainguard.checkpoint.copy_plan import CopyPlan, plan_for
from trainguard.checkpoint.copying import copy_into
from trainguard.checkpoint.memory import MemoryTier, default_memory_dir
from trainguard.checkpoint.restore import Restore, Restorer
from trainguard.checkpoint.room import MemoryRoom, no_room
from trainguard.checkpoint.save_times import SaveTimes
from trainguard.checkpoint.shard import make_meta
from trainguard.checkpoint.stateful import capture

if TYPE_CHECKING:
    from trainguard.checkpoint.durable import DurableTier

__all__ = ["CheckpointError", "Checkpointer", "Restore"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Tiered checkpoints of a nested training state (see the package docstring)."""

    def __init__(
        self,
        *,
        memory_every_steps: int | None = None,
        memory_keep: int | None = None,
        memory_dir: str | None = None,
        durable_url: str | None = None,
        durable_every_steps: int | None = None,
        durable_every_seconds: float | None = None,
        durable_keep: int | None = None,
        storage_options: dict[str, Any] | None = None,
        replicas: int | None = None,
        job_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        commit_timeout: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = CheckpointConfig.from_env(
            environ,
            memory_every_steps=memory_every_steps,
            memory_keep=memory_keep,
            memory_dir=memory_dir,
            durable_url=durable_url,
            durable_every_steps=durable_every_steps,
            durable_every_seconds=durable_every_seconds,
            durable_keep=durable_keep,
            storage_options=storage_options,
            replicas=replicas,
            job_id=job_id,
            rank=rank,
            world_size=world_size,
            commit_timeout=commit_timeout,
        )
        self._environ = environ  # read again at each save and load: the attempt may change
        cfg = self.config
        # Outside trainguard the memory tier is in a directory of its own choosing, which
        # close() removes: nothing else would (an agent's directory is the agent's).
        self._owns_memory_dir = cfg.memory_dir == default_memory_dir(environ)
        if cfg.replicas:
            log.debug("checkpoint replicas (%d) are not implemented yet; ignored", cfg.replicas)
        self.memory = MemoryTier(
            cfg.memory_dir,
            rank=cfg.rank,
            world_size=cfg.world_size,
            job_id=cfg.job_id,
            keep=cfg.memory_keep,
            hold=cfg.durable_writer == "agent",
        )
        self._room = MemoryRoom(cfg.memory_dir, cfg.rank)  # a full tier is skipped a while
        self.last_restore: Restore | None = None
        self._save_times = SaveTimes(enabled=cfg.rank == 0)
        self._durable: DurableTier | None = None
        self._background = Background(self.memory, cfg, self._durable_tier)
        self._restorer = Restorer(cfg, self.memory, self._durable_tier, environ)
        self._closed = False
        self._cuda_device: int | None = None  # where the state's CUDA tensors are, once seen
        self._plan: CopyPlan | None = None  # save()'s copy plan, while the structure holds
        seconds = cfg.durable_every_seconds
        self._durable_bucket = int(time.time() // seconds) if seconds else 0

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: Any, force: bool = False, *, blocking: bool = True) -> bool:
        """Snapshot ``state`` into the memory tier if ``step`` is due (or ``force``).

        Each object of ``state`` with ``state_dict()``/``load_state_dict()`` (a model, an
        optimizer, :class:`~trainguard.checkpoint.RNGState`) is read now, through its
        ``state_dict()`` (:mod:`trainguard.checkpoint.stateful`).

        Returns once the copy is done and committed as *copy-complete* (so a crash from
        here on still restores this step on this node); the checksum and the durable
        write (if due, or ``force``) go on in the background. Returns whether it saved.

        CUDA tensors are copied on a side stream into page-locked memory. With
        ``blocking=False`` save() returns once those copies are queued: the caller's
        current stream is ordered after them (a later step cannot change a tensor before
        it is copied), and the snapshot is committed in the background when they finish.

        The first save pre-faults its own slot; the other slots are then prepared in the
        background, so that every later save runs at copy speed.

        A memory tier with no room (ENOSPC) is not an error: the save returns False, once
        loudly, and the tier is tried again a while later (:mod:`.room`).
        """
        if self._closed:
            raise RuntimeError("Checkpointer.save() after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0, got {step!r}")
        self._background.raise_error()
        if not force and step % self.config.memory_every_steps:
            return False
        if self._room.full:  # no room in the memory tier lately: not tried again yet
            return False
        started = time.perf_counter()
        self._plan, layout, tensors = plan_for(capture(state), self._plan)
        cuda = self._plan.cuda
        slot = self.memory.choose_slot(step)
        self._background.wait_for_slot(slot, step)
        with self._background.copying():
            try:
                buffer, prepared = self.memory.begin(slot, layout.nbytes, pin=cuda)
            except OSError as exc:
                if not no_room(exc):
                    raise
                self._room.no_room(step, exc)  # training goes on (checkpoint/room.py)
                return False
            copy = copy_into(self._plan.views(slot, buffer), tensors)
            if blocking:
                copy.wait()
        self._cuda_device = copy.device if copy.device is not None else self._cuda_device
        cfg = self.config
        meta = make_meta(
            layout, job_id=cfg.job_id, step=step, rank=cfg.rank, world_size=cfg.world_size,
            digest=None, attempt=writer_attempt(self._environ), entries=self._plan.entries_json,
        )  # fmt: skip
        durable = self._durable_due(step, force)
        if cfg.durable_writer == "agent":
            # The agent persists the steps the controller picks; these ask to be picked,
            # and the memory tier holds the newest of them until it is replaced.
            every = cfg.durable_every_steps
            meta["persist"] = force or bool(every and step % every == 0)
            durable = False
        if blocking:
            try:
                self.memory.commit(slot, meta)
            except OSError as exc:
                if not no_room(exc):
                    raise
                self._room.no_room(step, exc)
                return False
        else:  # committed in the background; the next save must not choose this slot
            self.memory.reserve(slot, step)
        self._background.submit(Snapshot(step, slot, meta, durable, None if blocking else copy))
        if prepared:  # a new size: ready the other slots before the saves that use them
            # One task a slot, in the order saves take free slots (choose_slot): the next
            # save waits for its own slot only, never for the ones after it.
            for other in self.memory.unready(layout.nbytes, cuda):
                if other != slot:
                    self._background.submit(Prepare((other,), layout.nbytes, cuda, copy.device))
        self._save_times.add(step, time.perf_counter() - started)
        self._room.fits(step)
        return True

    def _durable_due(self, step: int, force: bool) -> bool:
        cfg = self.config
        if not cfg.durable or cfg.durable_writer == "agent":
            return False
        due = force or (cfg.durable_every_steps is None and cfg.durable_every_seconds is None)
        if cfg.durable_every_steps and step % cfg.durable_every_steps == 0:
            due = True
        if cfg.durable_every_seconds:
            # Wall-clock buckets, not "since my last write": every rank reaches the same
            # decision without talking (except when a bucket ends between two ranks' calls;
            # that step is then never committed and is pruned later).
            bucket = int(time.time() // cfg.durable_every_seconds)
            if bucket != self._durable_bucket:
                due = True
            if due:
                self._durable_bucket = bucket
        return due

    def wait(self, timeout: float | None = None) -> None:
        """Block until background work for every saved step is done (``TimeoutError``
        after ``timeout`` seconds); re-raises a background failure as CheckpointError."""
        self._background.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish background work (see :meth:`wait`), stop the thread, unmap the slots.

        Outside trainguard, with the default memory directory
        (``/dev/shm/trainguard-<uid>/<run>``), also delete this rank's slots and the
        directory once empty: the run is over. A crashed worker never gets here, so its
        restart still finds them. A directory given by the job or by ``memory_dir`` stays.
        """
        if self._closed:
            return
        try:
            self._save_times.flush()
            self.wait(timeout)
        finally:
            self._closed = True
            self._plan = None  # its views of the slots would keep them mapped
            self._background.stop(timeout)
            if self._cuda_device is not None:  # no copy may still write into a slot
                torch.cuda.synchronize(self._cuda_device)
            self.memory.close()
            if self._owns_memory_dir:
                self.memory.remove()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring -----------------------------------------------------------------------

    def load_latest(self, state: Any) -> int | None:
        """Restore ``state`` in place from the newest step every rank can load; None if none.

        An object of ``state`` with ``state_dict()``/``load_state_dict()`` is restored into
        what its ``state_dict()`` returns now, then given it with ``load_state_dict()``.
        Each rank reads its shard from the fastest tier that has the step (memory, then
        durable) and verifies it before anything is changed; a corrupt, foreign or
        missing shard is logged and skipped, and the ranks fall back to an older step
        (:mod:`.restore`). Also pre-faults (for CUDA state, page-locks) the memory slots
        for ``state`` in the background, so the first save() runs at copy speed too.
        """
        if self._background.started:
            self.wait()
        restored = self._restorer.load(state, self._prepare)
        if restored is None:
            return None
        self.last_restore = restored
        return restored.step

    def _prepare(self, tensors: list[torch.Tensor], nbytes: int) -> None:
        """Ready the memory slots for a state of ``nbytes`` (``tensors``: page-locked if
        any is on a GPU) in the background, off the restore's path: a save waits for the
        slot it needs. Slots that must grow are uncommitted now."""
        cuda = next((t.device.index for t in tensors if t.is_cuda), None)
        try:
            slots = tuple(self.memory.unready(nbytes, pin=cuda is not None))
        except OSError as exc:
            if not no_room(exc):
                raise
            self._room.no_room(None, exc)
            return
        for slot in slots:  # a task each: a save waits only for the slot it needs
            self._background.submit(Prepare((slot,), nbytes, cuda is not None, cuda))

    def _durable_tier(self) -> DurableTier:
        if self._durable is None:
            from trainguard.checkpoint.durable import DurableTier

            assert self.config.durable_url
            self._durable = DurableTier(
                self.config.durable_url, self.config.job_id, self.config.storage_options
            )
        return self._durable
