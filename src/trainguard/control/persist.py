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

A request in flight always ends, as committed or as a ``CheckpointPersistFailed`` note:

- an agent reports the step failed (or refuses the request);
- a node it was sent to is lost, leaves the attempt, or answers with another agent
  (``incarnation``): a killed agent's successor knows nothing of the request, and the
  committing node would wait in vain for the killed one's shards;
- it is not committed within ``request_timeout``.

A failure is never the end of the schedule: the step is *owed*, and once
``retry_after`` has passed (doubling with each failure in a row) the newest step every
rank holds in memory that is newer than the newest durable one is asked for, whatever the
cadence says (a step lost to a fault is asked for again; a step an agent reported
failed, torn or overwritten, is not). ``shortfall`` says, at the job's end, whether the
newest step the schedule asked for is durable.

Pure logic, like the rest of :mod:`trainguard.control`: times come in as arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainguard.control.events import EventKind, Note
from trainguard.control.reports import NodeReport


@dataclass(frozen=True)
class DurableCadence:
    """When to persist (from ``spec.checkpointing``) and how patient to be."""

    every_steps: int | None = None
    every_seconds: float | None = None
    # A requested step neither committed nor failed after this long is given up on.
    request_timeout: float = 180.0
    # After a failed request, how long until the owed step is asked for again (doubled
    # with each failure in a row, up to ``retry_max``).
    retry_after: float = 5.0
    retry_max: float = 300.0


@dataclass(frozen=True)
class PersistCheckpoint:
    """Ask ``node_ids`` to persist their ranks' first snapshot at or after ``step``;
    ``commit_node`` commits it."""

    step: int
    world_size: int
    node_ids: tuple[str, ...]
    commit_node: str


@dataclass
class _InFlight:
    step: int
    since: float
    # The agent each node ran when asked (its status's incarnation; "" when unknown).
    agents: dict[str, str]
    # Failures of this step the nodes reported before it was asked (an earlier try's).
    stale: set[tuple[str, str]]


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
        self._failed: set[int] = set()  # steps an agent failed: never asked for again
        self._asked = -1  # the newest step the schedule asked to persist
        self._owed_since: float | None = None  # when the request in flight last failed
        self._failures_in_a_row = 0
        self._last_failed: int | None = None  # the step of the newest failed request
        self._memory_noted = -1
        self._memory_noted_at: float | None = None

    @property
    def busy(self) -> bool:
        """A requested step is neither committed nor failed yet."""
        return self._inflight is not None

    def observe(
        self, now: float, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> tuple[list[PersistCheckpoint], list[Note]]:
        """One poll: notes about what changed, and the step to persist if one is due."""
        complete, forced = self._memory(node_ids, reports)
        notes = self.settle(now, node_ids, reports) + self._note_memory(now, complete)
        if self.cadence is None or self._inflight is not None:
            return [], notes
        due = self._due(now, complete, forced)
        if due is None:
            return [], notes
        step, retry = due
        retry = retry or step == self._last_failed
        request = self._request(now, step, node_ids, reports)
        again = " again, after a failure" if retry else ""
        persisting = Note(
            EventKind.CHECKPOINT_PERSISTING,
            f"persisting step {step} from node memory to durable storage{again}",
            data={"step": step, "retry": retry},
        )
        return [request], [*notes, persisting]

    def flush(
        self, now: float, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> tuple[PersistCheckpoint, Note] | None:
        """The job is done: persist its newest complete step unless it is already durable,
        failed, or a request is still in flight (asked again once that one has settled).
        None when there is nothing to do now."""
        if self.cadence is None or self._inflight is not None:
            return None
        complete, _ = self._memory(node_ids, reports)
        if not complete:
            return None
        newest = max(complete)
        if max(self.committed, default=-1) >= newest or newest in self._failed:
            return None
        note = Note(
            EventKind.CHECKPOINT_PERSISTING,
            f"persisting the final step {newest} to durable storage",
            data={"step": newest, "final": True},
        )
        return self._request(now, newest, node_ids, reports), note

    def settle(
        self, now: float, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> list[Note]:
        """Notes of the steps newly committed, and of the request in flight once it has
        failed (reported failed, a node of it gone or its agent replaced, timed out)."""
        notes = self._note_committed(reports)
        inflight = self._inflight
        if inflight is None:
            return notes
        if max(self.committed, default=-1) >= inflight.step:
            self._inflight = None
            self._owed_since, self._failures_in_a_row = None, 0
            return notes
        lost = _lost_agent(inflight, node_ids, reports)
        if lost is not None:
            return [*notes, self._fail(now, f"{lost}; it is asked for again", retry=True)]
        reason = _reported_failure(inflight, reports)
        if reason is None and self.cadence and now - inflight.since > self.cadence.request_timeout:
            reason = f"not committed within {self.cadence.request_timeout:.0f} s"
        if reason is not None:
            notes.append(self._fail(now, reason, retry=False))
        return notes

    def give_up(self, now: float, reason: str) -> Note | None:
        """The job ends with a request in flight: it failed (None when there is none)."""
        if self._inflight is None:
            return None
        return self._fail(now, reason, retry=False)

    def shortfall(self) -> Note | None:
        """A warning when the newest step the schedule asked to persist is not durable (the
        job's end state); None when it is, or when nothing was asked."""
        durable = max(self.committed, default=None)
        if self._asked < 0 or (durable is not None and durable >= self._asked):
            return None
        newest = "none" if durable is None else str(durable)
        return Note(
            EventKind.CHECKPOINT_NOT_DURABLE,
            f"warning: step {self._asked}, the newest the schedule asked to persist, is not "
            f"in durable storage; the newest durable step is {newest}",
            data={"step": self._asked, "durable_step": durable},
        )

    def refused(self, now: float, node_id: str, message: str) -> Note | None:
        """A node's agent refused the request in flight: it fails now, not at its timeout."""
        if self._inflight is None:
            return None
        note = self._fail(now, f"{node_id} refused it: {message}", retry=False)
        return dataclasses.replace(note, node=node_id)

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

    def _due(self, now: float, complete: set[int], forced: set[int]) -> tuple[int, bool] | None:
        """The step to ask for now, and whether it is for one that failed; None: none."""
        assert self.cadence is not None
        fresh = {s for s in complete if s > self._last_requested and s not in self._failed}
        due = {s for s in fresh if s in forced}
        if self.cadence.every_steps:
            due |= {s for s in fresh if s % self.cadence.every_steps == 0}
        if due:
            return max(due), False
        owed = self._owed_since
        if owed is not None:  # the newest step in memory, once the back-off has passed
            wait = self.cadence.retry_after * 2 ** (self._failures_in_a_row - 1)
            if fresh and now - owed >= min(wait, self.cadence.retry_max):
                return max(fresh), True
            return None
        seconds = self.cadence.every_seconds
        if seconds is not None and fresh and now - self._last_request_at >= seconds:
            return max(fresh), False  # in memory on every rank: never a step that may not come
        return None

    def _request(
        self, now: float, step: int, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
    ) -> PersistCheckpoint:
        agents = {n: _agent(reports.get(n)) for n in node_ids}
        stale = {(n, why) for n, why in _failures(reports, step)}
        self._inflight = _InFlight(step, now, agents, stale)
        self._last_requested = max(self._last_requested, step)
        self._last_request_at = now
        self._asked = max(self._asked, step)
        return PersistCheckpoint(step, self.world_size, tuple(node_ids), node_ids[0])

    def _fail(self, now: float, reason: str, *, retry: bool) -> Note:
        """The request in flight failed; the step is owed (asked for again when ``retry``,
        else the newest newer step)."""
        inflight = self._inflight
        assert inflight is not None
        self._inflight = None
        if not retry:
            self._failed.add(inflight.step)
        # Anything newer than the newest durable step may be asked for now.
        self._last_requested = max(self.committed, default=-1)
        self._owed_since, self._last_failed = now, inflight.step
        self._failures_in_a_row += 1
        return Note(
            EventKind.CHECKPOINT_PERSIST_FAILED,
            f"step {inflight.step} was not persisted: {reason}",
            data={"step": inflight.step, "reason": reason, "retry": retry},
        )

    def _note_committed(self, reports: Mapping[str, NodeReport]) -> list[Note]:
        notes = []
        committed: set[int] = set()
        for report in reports.values():
            if report.status is not None and report.gone is None:
                committed.update(report.status.checkpoint.committed)
        for step in sorted(committed - self.committed):
            self.committed.add(step)
            self._last_requested = max(self._last_requested, step)
            notes.append(
                Note(
                    EventKind.CHECKPOINT_COMMITTED,
                    f"step {step} committed to durable storage ({self.world_size} shards)",
                    data={"step": step, "tier": "durable"},
                )
            )
        return notes

    def _note_memory(self, now: float, complete: set[int]) -> list[Note]:
        if not complete or max(complete) <= self._memory_noted:
            return []
        noted_at = self._memory_noted_at
        if noted_at is not None and now - noted_at < self.memory_event_interval:
            return []
        step = max(complete)
        self._memory_noted, self._memory_noted_at = step, now
        return [
            Note(
                EventKind.CHECKPOINT_SAVED,
                f"step {step} saved in node memory by all {self.world_size} ranks",
                data={"step": step, "tier": "memory"},
            )
        ]


def _agent(report: NodeReport | None) -> str:
    status = report.status if report is not None else None
    return status.incarnation if status is not None else ""


def _failures(reports: Mapping[str, NodeReport], step: int) -> list[tuple[str, str]]:
    """(node, reason) for each live node that reports ``step`` failed."""
    found = []
    for node_id, report in reports.items():
        if report.status is not None and report.gone is None:
            reason = report.status.checkpoint.failed.get(step)
            if reason is not None:
                found.append((node_id, reason))
    return found


def _reported_failure(inflight: _InFlight, reports: Mapping[str, NodeReport]) -> str | None:
    """Why a node failed the step in flight (not an earlier try's failure); else None."""
    for node_id, reason in _failures(reports, inflight.step):
        if (node_id, reason) not in inflight.stale:
            return f"{node_id}: {reason}"
    return None


def _lost_agent(
    inflight: _InFlight, node_ids: Sequence[str], reports: Mapping[str, NodeReport]
) -> str | None:
    """Why a node the request went to can no longer carry it out; None while all can."""
    replaced = []
    for node_id, agent in sorted(inflight.agents.items()):
        report = reports.get(node_id)
        if node_id not in node_ids:
            return f"{node_id} left the job while persisting it"
        if report is not None and report.gone is not None:
            return f"{node_id} was lost while persisting it ({report.gone})"
        now_agent = _agent(report)
        if agent and now_agent and now_agent != agent:
            replaced.append(node_id)
    if not replaced:
        return None
    if len(replaced) == 1:
        return f"{replaced[0]}'s agent was replaced while persisting it"
    return f"the agents of {', '.join(replaced)} were replaced while persisting it"
