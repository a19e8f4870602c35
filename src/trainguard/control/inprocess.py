"""In-process restarts: when survivors may keep their processes, and how the restart goes.

Decisions (all pure, parameters from :class:`~trainguard.control.config.ControlConfig`):

- :func:`eligible`: after faults in a running attempt, restart in place (survivors keep
  their processes, dead ranks are replaced) only when every fault is a plain
  :attr:`~FaultType.WORKER_CRASH` of a rank, budget is left, and every node of the
  attempt is up with its resilient workers running or waiting. A rank that gave up the
  restart barrier (exit 75), missed it, or a node that refused a rejoin, means the
  in-process path did not work: those take the process-level path.
- :func:`hot_spares_per_node`: the job's hot spares, round robin from node 0.
- :func:`stuck_ranks`: ``stuck_rank_timeout`` after the restart, a survivor that has
  neither left the failed attempt nor joined the new one is deadlocked in a collective
  (a gloo collective blocked on a *live* peer never fails): it gets a new process in the
  same attempt.
- :func:`barrier_misses`: ``barrier_timeout`` after the restart, every rank that has not
  joined missed the restart barrier; each is a fault, and the attempt falls back to a
  process-level restart.

What the ranks did comes from the agents' worker statuses: ``joined`` (a rank's
acknowledgement of an attempt) and ``left`` (the attempt it left after a fault).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.control.contact import Contact, ContactRule, contact
from trainguard.control.events import Fault, FaultType
from trainguard.control.reports import NodeReport
from trainguard.wire.requests import NodeAssignment
from trainguard.wire.status import NodeState, WorkerState, WorkerStatus

__all__ = [
    "Rejoin",
    "RejoinStep",
    "barrier_misses",
    "eligible",
    "hot_spares_per_node",
    "stuck_ranks",
    "watch_rejoin",
]


@dataclass(frozen=True)
class Rejoin:
    """An in-process restart under way: since when, who survived, whom the controller
    gave a new process because it was stuck."""

    at: float
    survivors: tuple[int, ...]
    replaced: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RejoinStep:
    """What an in-process restart needs now: done (every rank joined), stuck ranks to
    give new processes (node id -> ranks), or the ranks that missed the barrier."""

    done: bool = False
    replace: dict[str, tuple[int, ...]] = field(default_factory=dict)
    missed: tuple[int, ...] = ()


def watch_rejoin(
    now: float,
    attempt: int,
    rejoin: Rejoin,
    reports: Mapping[str, NodeReport],
    assignments: Sequence[NodeAssignment],
    stuck_rank_timeout: float,
    barrier_timeout: float,
) -> RejoinStep:
    """One look at an in-process restart under way (the ranks it replaces are new:
    none of ``rejoin.replaced``)."""
    missing = barrier_misses(attempt, reports, assignments)
    if not missing:
        return RejoinStep(done=True)
    since = now - rejoin.at
    if since >= barrier_timeout:
        return RejoinStep(missed=tuple(missing))
    if since < stuck_rank_timeout:
        return RejoinStep()
    stuck = stuck_ranks(attempt, rejoin.survivors, reports, assignments)
    fresh = [rank for rank in stuck if rank not in rejoin.replaced]
    replace = {
        a.node_id: ranks
        for a in assignments
        if (ranks := tuple(r for r in fresh if r in a.global_ranks))
    }
    return RejoinStep(replace=replace)


def eligible(
    faults: Sequence[Fault],
    attempt: int,
    assignments: Sequence[NodeAssignment],
    reports: Mapping[str, NodeReport],
    rule: ContactRule,
) -> bool:
    """Whether ``faults`` of ``attempt`` may be recovered in place (budget aside).

    Every node must be up, and none known to have stopped or finished this attempt. A
    node's latest status may still be about an earlier attempt, or say it is starting:
    agents report what the controller caused (a start, a rejoin) only when polled, and
    one that cannot rejoin after all refuses, which falls back to a process-level
    restart.
    """
    if not faults or any(f.type is not FaultType.WORKER_CRASH or f.rank is None for f in faults):
        return False
    for a in assignments:
        report = reports.get(a.node_id)
        if report is None or contact(report, rule) is not Contact.UP:
            return False
        status = report.about(attempt)
        if status is not None and status.state not in _REJOINABLE:
            return False
    return True


_REJOINABLE = (NodeState.STARTING, NodeState.RUNNING, NodeState.FAULTED)


def hot_spares_per_node(total: int, nnodes: int) -> list[int]:
    """How many of ``total`` hot spares each node rank keeps: round robin from node 0."""
    return [total // nnodes + (1 if rank < total % nnodes else 0) for rank in range(nnodes)]


def stuck_ranks(
    attempt: int,
    survivors: Sequence[int],
    reports: Mapping[str, NodeReport],
    assignments: Sequence[NodeAssignment],
) -> list[int]:
    """Of ``survivors`` (ranks alive when ``attempt`` replaced the failed one), those still
    running that have neither left ``attempt - 1`` nor joined ``attempt``.

    Call once ``stuck_rank_timeout`` has passed since the restart.
    """
    workers = _workers(attempt, reports, assignments)
    stuck = []
    for rank in survivors:
        w = workers.get(rank)
        if w is None or w.state is not WorkerState.RUNNING:
            continue  # exited (a crash, seen as such) or not reported yet
        left = w.left is not None and w.left >= attempt - 1
        joined = w.joined is not None and w.joined >= attempt
        if not (left or joined):
            stuck.append(rank)
    return stuck


def barrier_misses(
    attempt: int, reports: Mapping[str, NodeReport], assignments: Sequence[NodeAssignment]
) -> list[int]:
    """Ranks of ``attempt`` that have not joined it (call once the barrier timeout passed)."""
    workers = _workers(attempt, reports, assignments)
    return [
        rank
        for a in assignments
        for rank in a.global_ranks
        if (w := workers.get(rank)) is None or w.joined is None or w.joined < attempt
    ]


def _workers(
    attempt: int, reports: Mapping[str, NodeReport], assignments: Sequence[NodeAssignment]
) -> dict[int, WorkerStatus]:
    out: dict[int, WorkerStatus] = {}
    for a in assignments:
        report = reports.get(a.node_id)
        status = report.about(attempt) if report is not None else None
        if status is not None:
            out.update({w.rank: w for w in status.workers})
    return out
