"""A lost node replaced in place: the survivors keep their processes, a spare takes its ranks.

For a job whose workers run :mod:`trainguard.resilient` (``inProcessRestart``) with a
spare node left, when every fault of the attempt is a lost node (its agent gone or
silent: a host crashed or cut off) and every other node still runs the attempt:

1. the spares are brought up (one per lost node) while the survivors wait in their
   failed collective; the attempt goes on meanwhile, and the lost nodes' own faults are
   not counted again;
2. once every spare is up, idle and its worker template warm, the next attempt starts
   in place (:func:`~trainguard.control.rescale.reform`): each spare takes its lost
   node's place in the node order, so every rank keeps its number; the survivors rejoin
   (their processes, model, optimizer and data stay), the spares start the lost nodes'
   ranks, which take their state from a healthy peer; the lost nodes are retired.

No survivor restarts and no checkpoint is read: no step is lost. It counts as a restart
(in-process scope) against ``jobMaxRetryCount``. A spare that is not up within
``node_start_timeout``, or any other fault meanwhile, stops the attempt, and the policy
restarts it as for any lost node (from the checkpoints).

Pure, like the rest of the package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trainguard.control.actions import Action, AttemptPhase, LaunchNodes, StopMode
from trainguard.control.attempt import Attempt
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.reports import NodeReport
from trainguard.control.rescale import reform, running, standby_up

if TYPE_CHECKING:
    from trainguard.control.controller import JobController

__all__ = ["begin", "pending_faults", "watch"]


def begin(
    c: JobController,
    now: float,
    attempt: Attempt,
    faults: Sequence[Fault],
    reports: Mapping[str, NodeReport],
) -> list[Action] | None:
    """Bring spares up for the lost nodes of ``faults``, to replace them in place; None:
    not that case (see the module doc)."""
    if (
        not c.config.in_process
        or attempt.rejoin is not None
        or attempt.replacing_in_place
        or c.restarts >= c.config.max_restarts
        or not faults
        or any(f.type is not FaultType.NODE_LOST or f.node is None for f in faults)
    ):
        return None
    lost = tuple(dict.fromkeys(f.node for f in faults if f.node is not None))
    if not set(lost) <= set(attempt.nodes) or len(lost) > len(c.spares):
        return None
    if any(c.health.unusable(n) is not None for n in c.spares[: len(lost)]):
        return None
    survivors = [n for n in attempt.nodes if n not in lost]
    if not survivors or not running(c, attempt, survivors, reports):
        return None
    spares = c.spares[: len(lost)]
    c.spares = c.spares[len(lost) :]
    for fault in faults:
        c._record_fault(now, attempt, fault)
    attempt.replacing_in_place = dict(zip(lost, spares, strict=True))
    attempt.standby = spares
    attempt.standby_deadline = now + c.config.node_start_timeout
    swaps = ", ".join(f"{old} -> {new}" for old, new in attempt.replacing_in_place.items())
    c._event(
        now,
        EventKind.NODE_REPLACING,
        f"{faults[0].message}; bringing up {', '.join(spares)} to take its ranks in place "
        f"({swaps}): the other ranks keep their processes",
        attempt=attempt.number,
        data={"replacing": dict(attempt.replacing_in_place)},
    )
    return [LaunchNodes(spares, attempt.number, c.avoid_hosts)]


def pending_faults(attempt: Attempt, faults: Sequence[Fault]) -> list[Fault]:
    """``faults`` without those of the nodes being replaced in place (they are lost:
    their silence is no news)."""
    gone = set(attempt.replacing_in_place)
    return [f for f in faults if f.node not in gone]


def watch(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """While the spares come up: once all are up and warm, the next attempt in place; a
    spare that does not come up stops the attempt (the policy takes over)."""
    failed, up = standby_up(c, now, attempt, reports)
    if failed:
        why = "; ".join(w for _, w in failed)
        return [c._stop(now, attempt, StopMode.PROCESS, f"replacing in place failed: {why}")]
    if not up:
        return []
    swap = dict(attempt.replacing_in_place)
    attempt.take_standby()
    nodes = tuple(swap.get(n, n) for n in attempt.nodes)  # each spare in its node's place
    lost = tuple(swap)
    reason = attempt.faults[0].message if attempt.faults else "nodes lost"
    scope = RestartScope.IN_PROCESS
    c._end_attempt(now, attempt, AttemptPhase.FAILED, reason)
    c.history.append(RestartRecord(now, scope))
    c.timeline.set_scope(attempt.number, scope.value)
    c._event(
        now,
        EventKind.RESTART_SCHEDULED,
        f"in-process restart {c.restarts} of {c.config.max_restarts}: {reason}; "
        f"{', '.join(f'{new} takes the ranks of {old}' for old, new in swap.items())}, the "
        "other ranks keep their processes",
        attempt=attempt.number + 1,
        data={"scope": scope.value, "replaced": swap},
    )
    return reform(c, now, attempt, nodes, tuple(swap.values()), lost)
