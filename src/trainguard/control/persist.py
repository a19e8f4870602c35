"""Which checkpoint step goes to durable storage, and when: decided with every rank in view.

Each node reports the steps its memory tier holds (per local rank) and what its agent
has written to and committed in the durable tier. A step is *complete in memory* when
every rank of the job has a shard of it on some node. The planner asks every node to
persist the newest complete step that is due:

- ``every_steps``: a complete step that is a multiple of it (the ranks flag those steps
  and hold the newest in memory until it is persisted);
- a step a worker saved with ``force=True`` (flagged likewise);
- ``every_seconds``: once that long has passed since the last request (counted from the
  job's start for the first one), the newest complete step newer than any requested
  before, as soon as there is one. Each agent persists its ranks' first snapshot at or
  after it, which they hold for it from then on: the step itself, or, when a fast loop
  has already overwritten it, the first one after it they still hold. A request never
  names a step no rank has saved yet: waiting for the next save (as this once did) waited
  in vain when the loop saved rarely or had stopped saving, and gave up with the newest
  step in memory never persisted.

One request is in flight at a time; the first node commits the step once every rank's
shard is durable. Because one controller picks the step for all nodes, every rank
persists the same step, which wall-clock cadences decided per rank cannot promise.

Pure logic, like the rest of :mod:`trainguard.control`: times come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.control.reports import NodeReport


@dataclass(frozen=True)
class DurableCadence:
    """When to persist (from ``spec.checkpointing``) and how patient to be."""

    every_steps: int | None = None
    every_seconds: float | None = None
    # A requested step neither committed nor failed after this long is given up on.
    request_timeout: float = 180.0


@dataclass(frozen=True)
class PersistCheckpoint:
    """Ask ``node_ids`` to persist their ranks' first snapshot at or after ``step``;
    ``commit_node`` commits it."""

    step: int
    world_size: int
    node_ids: tuple[str, ...]
    commit_node: str


@dataclass(frozen=True)
class CheckpointNote:
    """Something worth an event (the controller records it)."""

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class _InFlight:
    step: int
    since: float


MEMORY_EVENT_INTERVAL = 30.0
"""At most one "saved in memory" event per this many seconds (a save per step is common)."""


class CheckpointPlanner:
    """Tracks the job's checkpoint tiers and picks the steps to persist."""

    def __init__(
        self,
        cadence: DurableCadence | None,
        world_size: int,
        started_at: float,
        memory_event_interval: float = MEMORY_EVENT_INTERVAL,
    ) -> None:
        self.cadence = cadence
        self.world_size = world_size
        self.memory_event_interval = memory_event_interval
        self.committed: set[int] = set()
        self._last_request_at = started_at
        self._last_requested = -1  # the newest step a request was made for (or from)
        self._inflight: _InFlight | None = None
        self._failed: set[int] = set()
        self._memory_noted = -1
        self._memory_noted_at: float | None = None

    @property
    def busy(self) -> bool:
        """A requested step is neither committed nor failed yet."""
        return self._inflight is not None

    def observe(
        self, now: float, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> tuple[list[PersistCheckpoint], list[CheckpointNote]]:
        """One poll: notes about what changed, and the step to persist if one is due."""
        complete, forced = self._memory(node_ids, reports)
        notes = self._note_durable(now, reports) + self._note_memory(now, complete)
        if self.cadence is None or self._inflight is not None:
            return [], notes
        step = self._due(now, complete, forced)
        if step is None:
            return [], notes
        request = self._request(now, step, node_ids)
        persisting = CheckpointNote(
            "CheckpointPersisting",
            f"persisting step {step} from node memory to durable storage",
            {"step": step},
        )
        return [request], [*notes, persisting]

    def flush(
        self, now: float, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> tuple[PersistCheckpoint, CheckpointNote] | None:
        """The job is done: persist its newest complete step unless it is already durable
        (or requested). None when there is nothing to do."""
        if self.cadence is None:
            return None
        complete, _ = self._memory(node_ids, reports)
        if not complete:
            return None
        newest = max(complete)
        if newest in self.committed:
            return None
        if self._inflight is not None and self._inflight.step <= newest:
            return None  # the request in flight will find it
        note = CheckpointNote(
            "CheckpointPersisting",
            f"persisting the final step {newest} to durable storage",
            {"step": newest},
        )
        return self._request(now, newest, node_ids), note

    def refused(self, node_id: str, message: str) -> CheckpointNote | None:
        """A node's agent refused the request in flight: it fails now, not at its timeout."""
        inflight = self._inflight
        if inflight is None:
            return None
        self._inflight = None
        self._failed.add(inflight.step)
        reason = f"{node_id} refused it: {message}"
        return CheckpointNote(
            "CheckpointPersistFailed",
            f"step {inflight.step} was not persisted: {reason}",
            {"step": inflight.step, "reason": reason},
        )

    # -- internals ------------------------------------------------------------------------

    def _memory(
        self, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> tuple[set[int], set[int]]:
        ranks: dict[int, set[int]] = {}
        forced: set[int] = set()
        for node_id in node_ids:
            report = reports.get(node_id)
            status = report.status if report is not None else None
            if status is None or report is None or report.gone is not None:
                continue
            for step, memory in status.checkpoint.memory_steps.items():
                ranks.setdefault(step, set()).update(memory.ranks)
                if memory.force:
                    forced.add(step)
        everyone = set(range(self.world_size))
        complete = {step for step, have in ranks.items() if everyone <= have}
        return complete, forced & complete

    def _due(self, now: float, complete: set[int], forced: set[int]) -> int | None:
        assert self.cadence is not None
        fresh = {s for s in complete if s > self._last_requested and s not in self._failed}
        due = {s for s in fresh if s in forced}
        if self.cadence.every_steps:
            due |= {s for s in fresh if s % self.cadence.every_steps == 0}
        if due:
            return max(due)
        seconds = self.cadence.every_seconds
        if seconds is not None and fresh and now - self._last_request_at >= seconds:
            return max(fresh)  # in memory on every rank: never a step that may not come
        return None

    def _request(self, now: float, step: int, node_ids: Sequence[str]) -> PersistCheckpoint:
        self._inflight = _InFlight(step, now)
        self._last_requested = max(self._last_requested, step)
        self._last_request_at = now
        return PersistCheckpoint(step, self.world_size, tuple(node_ids), node_ids[0])

    def _note_durable(self, now: float, reports: Mapping[str, NodeReport]) -> list[CheckpointNote]:
        notes = []
        committed: set[int] = set()
        failed: dict[int, str] = {}
        for report in reports.values():
            if report.status is not None and report.gone is None:
                committed.update(report.status.checkpoint.committed)
                failed.update(report.status.checkpoint.failed)
        for step in sorted(committed - self.committed):
            self.committed.add(step)
            self._last_requested = max(self._last_requested, step)
            notes.append(
                CheckpointNote(
                    "CheckpointCommitted",
                    f"step {step} committed to durable storage ({self.world_size} shards)",
                    {"step": step, "tier": "durable"},
                )
            )
        inflight = self._inflight
        if inflight is None:
            return notes
        reason = failed.get(inflight.step)
        if reason is None and self.cadence and now - inflight.since > self.cadence.request_timeout:
            reason = f"not committed within {self.cadence.request_timeout:.0f} s"
        if any(step >= inflight.step for step in self.committed):
            self._inflight = None
        elif reason is not None:
            self._inflight = None
            self._failed.add(inflight.step)
            notes.append(
                CheckpointNote(
                    "CheckpointPersistFailed",
                    f"step {inflight.step} was not persisted: {reason}",
                    {"step": inflight.step, "reason": reason},
                )
            )
        return notes

    def _note_memory(self, now: float, complete: set[int]) -> list[CheckpointNote]:
        if not complete or max(complete) <= self._memory_noted:
            return []
        noted_at = self._memory_noted_at
        if noted_at is not None and now - noted_at < self.memory_event_interval:
            return []
        step = max(complete)
        self._memory_noted, self._memory_noted_at = step, now
        return [
            CheckpointNote(
                "CheckpointSaved",
                f"step {step} saved in node memory by all {self.world_size} ranks",
                {"step": step, "tier": "memory"},
            )
        ]
