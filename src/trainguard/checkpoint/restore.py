"""The restore of a :class:`~trainguard.checkpoint.checkpointer.Checkpointer`'s state.

The ranks agree on the newest step every rank can load (:mod:`.agreement`); each rank
plans its restore from the fastest tier that has its shard (memory, then durable),
checksums the shard while the plan's fresh tensors fault in, and only then copies;
a step saved by another world size is resharded from the ranks' shards
(:mod:`.gather`). A corrupt, foreign or missing shard is logged, put on the job's
timeline and skipped, and the ranks fall back to an older step.
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
from trainguard.checkpoint.config import CheckpointConfig, writer_attempt
from trainguard.checkpoint.copying import has_cuda, synchronize_devices
from trainguard.checkpoint.gather import as_tensor, gather, node_steps, shard_sources
from trainguard.checkpoint.memory import MemoryShard, MemoryTier
from trainguard.checkpoint.shard import ShardInvalid, unchecked_refusal, verify, verify_data
from trainguard.checkpoint.sharding import NotCovered, init_optimizer_state
from trainguard.checkpoint.state import Layout, StateMismatch, flatten, plan_restore
from trainguard.checkpoint.stateful import apply, capture
from trainguard.control.events import EventKind
from trainguard.monitor import worker_events

if TYPE_CHECKING:
    from trainguard.checkpoint.durable import DurableTier

__all__ = ["MAX_CANDIDATES", "Restore", "Restorer"]

log = logging.getLogger(__name__)

PrepareSlots = Callable[[list[torch.Tensor], int], None]
"""Readies the memory slots for a state's tensors of a size, for the next saves."""

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


class Restorer:
    """Restores a rank's state from its checkpoint tiers (see the module docstring)."""

    def __init__(
        self,
        config: CheckpointConfig,
        memory: MemoryTier,
        durable: Callable[[], DurableTier],
        environ: Mapping[str, str] | None,
    ) -> None:
        self.config = config
        self.memory = memory
        self._durable = durable
        self._environ = environ  # read at each load: the attempt may change
        self._timing: dict[str, float] = {}  # the restore under way: its phases (Restore)

    def load(self, state: Any, prepare: PrepareSlots) -> Restore | None:
        """:meth:`Checkpointer.load_latest <trainguard.checkpoint.Checkpointer.load_latest>`.

        A memory shard whose checksum the writer never added is loaded only by its writer
        (this rank, within this attempt); for any other it is skipped the same way.
        ``prepare`` is given the state's tensors and size once it is restored (or once no
        step is found), to ready the memory slots for the next saves.
        """
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
                durable = self._durable().committed_steps()
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
            prepare(tensors, own.nbytes)
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
        prepare(tensors, own.nbytes)
        ended = time.perf_counter()
        self._timing["prepare_s"] = ended - preparing
        seconds = ended - started
        phases = dict(self._timing)
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
        return Restore(step, tier, seconds, phases)

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
        read = self._durable().read_shard if cfg.durable and durable else None
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
                data_bytes, meta = self._durable().read_shard(step, cfg.rank)
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
