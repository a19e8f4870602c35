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

Planners over a :class:`~trainguard.control.decision.JobView` (control/decision.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.control.actions import AttemptPhase, LaunchNodes, RetireNodes, StopMode
from trainguard.control.attempt import Rejoining, ReplacingInPlace, Training
from trainguard.control.decision import Decision, JobView, Note, Stop, chain
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.policy import RestartScope
from trainguard.control.rescale import reform, running, standby_up

__all__ = ["begin", "give_up", "watch"]


def begin(view: JobView, faults: Sequence[Fault]) -> Decision | None:
    """Bring spares up for the lost nodes of ``faults``, to replace them in place; None:
    not that case (see the module doc)."""
    cfg, attempt = view.config, view.attempt
    if (
        not cfg.in_process
        or isinstance(view.activity, Rejoining | ReplacingInPlace)
        or view.restarts >= cfg.max_restarts
        or not faults
        or any(f.type is not FaultType.NODE_LOST or f.node is None for f in faults)
    ):
        return None
    lost = tuple(dict.fromkeys(f.node for f in faults if f.node is not None))
    if not set(lost) <= set(attempt.nodes) or len(lost) > len(view.spares):
        return None
    spares = view.spares[: len(lost)]
    if any(n in view.unusable for n in spares):
        return None
    survivors = [n for n in attempt.nodes if n not in lost]
    if not survivors or not running(view, survivors):
        return None
    swap = dict(zip(lost, spares, strict=True))
    swaps = ", ".join(f"{old} -> {new}" for old, new in swap.items())
    message = (
        f"{faults[0].message}; bringing up {', '.join(spares)} to take its ranks in place "
        f"({swaps}): the other ranks keep their processes"
    )
    return Decision(
        spares=view.spares[len(lost) :],
        faults=tuple(faults),
        activity=ReplacingInPlace(swap, view.now + cfg.node_start_timeout),
        events=(Note(EventKind.NODE_REPLACING, message, attempt.number, data={"replacing": swap}),),
        actions=(LaunchNodes(spares, attempt.number, view.avoid_hosts),),
    )


def give_up(view: JobView) -> Decision:
    """Another fault while spares came up to replace lost nodes in place: retire the
    spares (back in the pool) and let the fault stop the attempt."""
    assert isinstance(view.activity, ReplacingInPlace)
    spares = view.activity.standby
    return Decision(
        spares=(*spares, *view.spares),
        activity=Training(),
        actions=(RetireNodes(spares),) if spares else (),
    )


def watch(view: JobView) -> Decision:
    """While the spares come up: once all are up and warm, the next attempt in place; a
    spare that does not come up stops the attempt (the policy takes over)."""
    attempt, replacing = view.attempt, view.activity
    assert isinstance(replacing, ReplacingInPlace)
    failed, up = standby_up(view, replacing.standby, replacing.deadline)
    if failed:
        why = "; ".join(w for _, w in failed)
        return Decision(stop=Stop(StopMode.PROCESS, f"replacing in place failed: {why}"))
    if not up:
        return Decision()
    swap = dict(replacing.swap)
    nodes = tuple(swap.get(n, n) for n in attempt.nodes)  # each spare in its node's place
    reason = attempt.faults[0].message if attempt.faults else "nodes lost"
    scope = RestartScope.IN_PROCESS
    message = (
        f"in-process restart {view.restarts + 1} of {view.config.max_restarts}: {reason}; "
        f"{', '.join(f'{new} takes the ranks of {old}' for old, new in swap.items())}, the "
        "other ranks keep their processes"
    )
    data = {"scope": scope.value, "replaced": swap}
    restart = Decision(
        activity=Training(),
        end=(AttemptPhase.FAILED, reason),
        scope=scope,
        counted=True,
        events=(Note(EventKind.RESTART_SCHEDULED, message, attempt.number + 1, data=data),),
    )
    return chain(restart, reform(view, nodes, tuple(swap.values()), tuple(swap)))
