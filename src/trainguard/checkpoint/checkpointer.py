"""The :class:`Checkpointer`: snapshots into the memory tier, persistence in the background.

One background thread per Checkpointer (:mod:`.background`) takes each snapshot's
checksum, commits its memory meta, and (when due) writes the shard to the durable tier;
rank 0 then commits the step there once every rank's shard is present, and prunes old
steps. ``save()`` is called from one thread (the training loop).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint.agreement import agree_on_step, worst_outcome
from trainguard.checkpoint.background import Background, CheckpointError, Prepare, Snapshot
from trainguard.checkpoint.config import CheckpointConfig, writer_attempt
from trainguard.checkpoint.copy_plan import CopyPlan, plan_for
from trainguard.checkpoint.copying import copy_into, has_cuda, synchronize_devices
from trainguard.checkpoint.gather import as_tensor, gather, node_steps, shard_sources
from trainguard.checkpoint.memory import MemoryShard, MemoryTier, default_memory_dir
from trainguard.checkpoint.room import MemoryRoom, no_room
from trainguard.checkpoint.save_times import SaveTimes
from trainguard.checkpoint.shard import (
    ShardInvalid,
    make_meta,
    unchecked_refusal,
    verify,
    verify_data,
)
from trainguard.checkpoint.sharding import NotCovered, init_optimizer_state
from trainguard.checkpoint.state import Layout, StateMismatch, flatten, plan_restore
from trainguard.checkpoint.stateful import apply, capture
from trainguard.control.events import EventKind
from trainguard.monitor import worker_events

if TYPE_CHECKING:
    from trainguard.checkpoint.durable import DurableTier

__all__ = ["CheckpointError", "Checkpointer", "Restore"]

log = logging.getLogger(__name__)

MAX_CANDIDATES = 32
"""Newest steps each rank offers when the ranks agree on the step to restore."""

# A rank's outcome of readying a step's restore; the ranks act on the worst of them.
_MISMATCH, _UNAVAILABLE, _READY = 0, 1, 2


@dataclass
class _Ready:
    """A restore planned on this rank: run it once every rank is ready."""

    tier: str
    nbytes: int  # of the shard in this rank's memory slot (0: none there)
    slot: int | None
    cuda: bool
    run: Callable[[], None]


@dataclass(frozen=True)
class Restore:
    """What :meth:`Checkpointer.load_latest` restored on this rank."""

    step: int
    tier: str  # "memory" or "durable"
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Where the seconds went: ``plan_s`` (the plan of the restore), ``verify_s`` (the
    shard's checksum), ``copy_s`` (the copy into the state), ``prepare_s`` (the memory
    slots handed to the background to be readied for the next saves); the rest is finding
    and agreeing on the step."""


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
        self._timing: dict[str, float] = {}  # the restore under way: its phases (Restore)
        self._save_times = SaveTimes(enabled=cfg.rank == 0)
        self._durable: DurableTier | None = None
        self._background = Background(self.memory, cfg, self._durable_tier)
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
        missing shard is logged and skipped, and the ranks fall back to an older step.
        A memory shard whose checksum the writer never added is loaded only by its writer
        (this rank, within this attempt); for any other it is skipped the same way.
        Also pre-faults (for CUDA state, page-locks) the memory slots for ``state`` in the
        background, so the first save() runs at copy speed too.
        """
        if self._background.started:
            self.wait()
        started = time.perf_counter()
        self._timing = {}
        cfg = self.config
        attempt = writer_attempt(self._environ)
        memory = self._trusted(
            self.memory.shards(lambda where, step, why: self._skipped("memory", step, where, why)),
            attempt,
        )
        durable: list[int] = []
        if cfg.durable:
            try:
                durable = self._durable_tier().committed_steps()
            except Exception as exc:  # unreachable storage: fall back to memory alone
                log.warning("durable tier %s unusable for restore: %s", cfg.durable_url, exc)
        # Steps saved by another world size that this node holds whole (a restart with
        # fewer or more ranks here) can be resharded from memory too.
        resharded = node_steps(cfg.memory_dir, cfg.job_id, cfg.world_size)
        offer = set(memory) | set(durable) | resharded
        ready: _Ready | None = None
        captured: list[Any] = []  # the target, captured once a step is at hand
        mismatch: StateMismatch | None = None
        while True:
            step = agree_on_step(sorted(offer), cfg.world_size, MAX_CANDIDATES)
            if step is None:
                break
            try:
                here = memory.get(step)
                ready = self._ready(step, here, step in durable, attempt, state, captured)
                outcome = _READY if ready is not None else _UNAVAILABLE
            except StateMismatch as exc:  # the state does not fit: every rank stops
                mismatch, outcome, ready = exc, _MISMATCH, None
            worst = worst_outcome(outcome, cfg.world_size)
            if worst == _READY:
                break
            if worst == _MISMATCH:
                raise mismatch or StateMismatch(
                    f"step {step}: another rank's state does not fit the checkpoint (see its log)"
                )
            offer.discard(step)
            ready = None
        if step is None or ready is None:
            log.info("no checkpoint to restore (rank %d offered %s)", cfg.rank, sorted(offer))
            own, tensors = flatten(captured[0] if captured else capture(state))
            self._prepare(tensors, own.nbytes)
            return None
        tier, target = ready.tier, captured[0]
        if ready.cuda and ready.slot is not None:  # page-locked: host-to-device at DMA speed
            self.memory.prepare_slot(ready.slot, ready.nbytes, pin=True)
        copying = time.perf_counter()
        ready.run()
        own, tensors = flatten(target)  # with what the restore added (a fresh optimizer's)
        synchronize_devices(tensors)
        apply(state, target)
        del ready
        preparing = time.perf_counter()
        self._timing["copy_s"] = preparing - copying
        self.memory.drop_newer_than(step)
        self._prepare(tensors, own.nbytes)
        ended = time.perf_counter()
        self._timing["prepare_s"] = ended - preparing
        seconds = ended - started
        phases = dict(self._timing)
        self.last_restore = Restore(step, tier, seconds, phases)
        told = ", ".join(f"{key.removesuffix('_s')} {value:.3f} s" for key, value in phases.items())
        log.info(
            "rank %d restored step %d from %s in %.3f s (%s)", cfg.rank, step, tier, seconds, told
        )
        worker_events.emit(
            EventKind.CHECKPOINT_RESTORED,
            f"rank {cfg.rank} restored step {step} from {tier} in {seconds:.3f} s ({told})",
            step=step,
            tier=tier,
            seconds=seconds,
            phases=phases,
        )
        if cfg.rank == 0:
            print(f"Restored step {step} from {tier} in {seconds:.3f} s", flush=True)
        return step

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

    def _trusted(
        self, shards: dict[int, MemoryShard], attempt: int | None
    ) -> dict[int, MemoryShard]:
        """The memory shards this rank may load: those without a checksum only if this
        rank wrote them within ``attempt`` (the others are skipped, with the reason)."""
        trusted = {}
        for step, shard in shards.items():
            refusal = None
            if shard.meta.get("checksum") is None:
                refusal = unchecked_refusal(shard.meta, rank=self.config.rank, attempt=attempt)
            if refusal is None:
                trusted[step] = shard
            else:
                self._skipped("memory", step, self.memory.meta_path(shard.slot), refusal)
        return trusted

    def _skipped(self, tier: str, step: int | None, where: str, why: object) -> None:
        """Log, and put on the job's timeline, a shard of this rank that is not loaded
        (``step``: None where its meta does not say)."""
        rank = self.config.rank
        which = "a shard" if step is None else f"step {step}"
        log.warning("%s tier: skipping %s (%s, rank %d): %s", tier, where, which, rank, why)
        worker_events.emit(
            EventKind.CHECKPOINT_SKIPPED,
            f"rank {rank} skipped {which} in {tier}: {why} ({where})",
            step=step,
            tier=tier,
            reason=str(why),
            file=where,
        )

    def _ready(
        self,
        step: int,
        memory: MemoryShard | None,
        durable: bool,
        attempt: int | None,
        state: Any,
        captured: list[Any],
    ) -> _Ready | None:
        """Plan this rank's restore of ``step``; None if its shards are not at hand.

        This rank's own shard, if it fits (same world size, and every DTensor's local part
        is the part it saved); else every saved rank's shard, resharded
        (:mod:`trainguard.checkpoint.gather`). Raises :class:`StateMismatch` when the state
        does not fit the checkpoint. The first call captures the state (readying the
        moments of an optimizer of DTensors, :func:`init_optimizer_state`) into
        ``captured``.
        """
        cfg = self.config
        if not captured:
            captured.append(capture(state, prepare=init_optimizer_state))
        target = captured[0]
        cuda = has_cuda(flatten(target)[1])

        def plan(layout: Layout, buffer: torch.Tensor) -> Callable[[], None]:
            return plan_restore(target, layout, buffer, non_blocking=cuda)

        fetched = self._fetch(step, memory, durable, attempt, plan)
        if fetched is not None:
            tier, layout, planned = fetched
            if not isinstance(planned, NotCovered):
                slot = memory.slot if tier == "memory" and memory is not None else None
                return _Ready(tier, layout.nbytes, slot, cuda, planned)
            log.info("rank %d: step %d needs resharding (%s)", cfg.rank, step, planned)
        read = self._durable_tier().read_shard if cfg.durable and durable else None
        try:
            world = cfg.world_size if fetched is not None else None  # else: as saved
            saved = gather(
                step, directory=cfg.memory_dir, job_id=cfg.job_id, durable=read, world_size=world
            )
        except ShardInvalid as exc:
            self._skipped("memory" if read is None else "durable", step, cfg.memory_dir, exc)
            return None
        base = saved[cfg.rank % len(saved)]  # the plain values: this rank's, or a peer's
        try:
            run = plan_restore(
                target, base.layout, base.buffer, non_blocking=cuda, shards=shard_sources(saved)
            )
        except NotCovered as exc:
            self._skipped("memory", step, cfg.memory_dir, exc)
            return None
        tier = "durable" if any(s.tier == "durable" for s in saved) else "memory"
        log.info("rank %d: resharding step %d from %d ranks' shards", cfg.rank, step, len(saved))
        return _Ready(tier, 0, None, cuda, run)

    def _fetch(
        self,
        step: int,
        memory: MemoryShard | None,
        durable: bool,
        attempt: int | None,
        plan: Callable[[Layout, torch.Tensor], Callable[[], None]],
    ) -> tuple[str, Layout, Callable[[], None] | NotCovered] | None:
        """This rank's verified shard of ``step`` from the fastest tier, and ``plan`` of
        its restore (or why it must be resharded); None if none (quietly for a step saved
        with another world size: it is resharded). :class:`StateMismatch` if the state
        does not fit a shard whose data is sound."""
        cfg = self.config
        check = functools.partial(
            verify, job_id=cfg.job_id, world_size=cfg.world_size, rank=cfg.rank, step=step
        )
        if memory is not None:
            try:
                nbytes = int(memory.meta["nbytes"])
                with self.memory.data(memory.slot, nbytes) as data:
                    layout = check(data, memory.meta, attempt=attempt, data_too=False)
                    buffer = self.memory.buffer(memory.slot)[:nbytes]
                    planned = self._plan_verified(plan, layout, buffer, data, memory.meta)
                return "memory", layout, planned
            except StateMismatch:
                raise
            except (ShardInvalid, OSError, ValueError) as exc:
                self._skipped("memory", step, self.memory.meta_path(memory.slot), exc)
                self.memory.drop(memory.slot)
        if durable:
            try:
                data_bytes, meta = self._durable_tier().read_shard(step, cfg.rank)
                if meta.get("world_size") != cfg.world_size:
                    return None
                layout = check(data_bytes, meta, data_too=False)
                planned = self._plan_verified(plan, layout, as_tensor(data_bytes), data_bytes, meta)
                return "durable", layout, planned
            except StateMismatch:
                raise
            except Exception as exc:
                self._skipped("durable", step, str(cfg.durable_url), exc)
        return None

    def _plan_verified(
        self,
        plan: Callable[[Layout, torch.Tensor], Callable[[], None]],
        layout: Layout,
        buffer: torch.Tensor,
        data: memoryview | bytes,
        meta: dict[str, Any],
    ) -> Callable[[], None] | NotCovered:
        """``plan`` of a shard whose meta has passed :func:`verify`, then its checksum.

        Planning reads no data and changes nothing (a restore's fresh tensors are only
        allocated, and faulted in meanwhile by a thread of their own), so it goes first and
        the checksum overlaps those faults; the plan is returned only once the data has
        matched, and a shard that does not match is skipped whether or not it fits.
        """
        began = time.perf_counter()
        try:
            planned: Callable[[], None] | NotCovered = plan(layout, buffer)
        except NotCovered as exc:
            planned = exc
        except StateMismatch:
            verify_data(data, meta, layout)
            raise
        checked = time.perf_counter()
        verify_data(data, meta, layout)
        self._timing["plan_s"] = checked - began
        self._timing["verify_s"] = time.perf_counter() - checked
        return planned

    def _durable_tier(self) -> DurableTier:
        if self._durable is None:
            from trainguard.checkpoint.durable import DurableTier

            assert self.config.durable_url
            self._durable = DurableTier(
                self.config.durable_url, self.config.job_id, self.config.storage_options
            )
        return self._durable
