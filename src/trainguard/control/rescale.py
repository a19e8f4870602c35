"""Elastic scalings while the job trains: nodes come up ahead, ranks change size in place.

:class:`~trainguard.control.elastic.ElasticWatch` decides when and to which size, as for
any elastic job. Carrying the decision out:

- **up**: once the capacity fits a larger size, the new nodes are launched at once,
  while the job trains on and ``scalingTimeoutInSeconds`` runs (after a failed
  scale-up, only once the next one is decided). When they answer idle with their worker
  template warm and the scale-up is decided, they join: in place for a job whose
  workers run :mod:`trainguard.resilient` (``inProcessRestart``: the ranks rejoin the
  next attempt at the larger size, the new nodes start it and take the state from a
  peer), else by a stop and a restart at the new size with them (not launched again).
  Nodes not up within ``node_start_timeout`` are retired, the attempt goes on, and the
  next scale-up waits longer; capacity taken back, a fault, or nodes taken away while
  they come up retire them too;
- **down**: the survivors get the next attempt at the smaller size (``/rejoin``; the
  ranks of the nodes after a dropped one are renumbered) and the dropped nodes are
  retired. No process restarts and no checkpoint is read: each survivor keeps its model,
  optimizer and data in memory, and a step cut short is redone from the state of the
  rank that got furthest.

In place needs every rank running the attempt (every survivor's agent up, its workers
running); otherwise, and for jobs without in-process restarts, a scaling stops the job
and restarts it at the new size from its checkpoint (:func:`recovery.rescale`). Neither
counts against ``jobMaxRetryCount``.

Planners over a :class:`~trainguard.control.decision.JobView` (control/decision.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.control.actions import AttemptPhase, JobPhase, LaunchNodes, RetireNodes, StopMode
from trainguard.control.attempt import GrowingAhead, Rejoining, Rescaling, Training, standby
from trainguard.control.contact import Contact, contact, launch_verdict
from trainguard.control.decision import Decision, InPlace, JobView, Note, Stop, chain
from trainguard.control.elastic import Scale
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.health import HealthBook
from trainguard.control.reports import NodeReport
from trainguard.wire.status import NodeState, WorkerState

__all__ = ["abandon_growth", "look", "preempted_lost", "reform", "running", "standby_up"]


def look(view: JobView) -> Decision:
    """One look at an elastic job's running attempt: what its size needs now (nothing,
    nodes to bring up, a scaling in place, or a stop to restart at the new size)."""
    assert view.elastic is not None
    attempt = view.attempt
    first = Decision()
    if standby(view.activity) and _taking_away(view):
        first = abandon_growth(view, "nodes are being taken away")
    view = view.after(first)
    assert view.elastic is not None
    elastic, scale = view.elastic.observe(
        view.now, attempt.nodes, view.capacity, view.preempted, attempt.started_at
    )
    first = chain(first, Decision(elastic=elastic))
    view = view.after(first)
    if scale is not None and scale.down:
        return chain(first, _scale(view, scale))
    growth = view.activity if isinstance(view.activity, GrowingAhead) else GrowingAhead()
    if scale is not None and growth.due is None:
        growth = GrowingAhead(growth.standby, growth.deadline, scale)
        events: tuple[Note, ...] = ()
        if growth.standby:
            added = ", ".join(growth.standby)
            message = f"{scale.reason}; with {added}, brought up ahead"
            data = {"added": list(growth.standby)}
            events = (Note(EventKind.SCALING_REQUESTED, message, attempt.number, data=data),)
        first = chain(first, Decision(events=events, activity=growth))
        view = view.after(first)
    if growth.standby:
        return chain(first, _watch_growth(view, growth))
    if growth.due is not None:  # decided with no node up ahead (after a failed try)
        return chain(first, _launch_growth(view, growth.due.size))
    target = elastic.room(len(attempt.nodes), view.capacity)
    if target is not None:
        return chain(first, _launch_growth(view, target))
    return first


def preempted_lost(view: JobView, faults: Sequence[Fault]) -> Decision | None:
    """``faults`` are only preempted nodes lost before the job gave them up (taken without
    notice): a scale-down without them, in place where it can be, and no fault. None:
    not that case (other faults, or the rest is under ``minReplicas``)."""
    attempt, elastic = view.attempt, view.elastic
    if elastic is None or not faults or isinstance(view.activity, Rejoining):
        return None
    lost = {f.node for f in faults}
    taken = set(view.preempted)
    if any(f.type is not FaultType.NODE_LOST or f.node not in taken for f in faults):
        return None
    elastic, scale = elastic.observe(
        view.now, attempt.nodes, view.capacity, view.preempted, attempt.started_at
    )
    if scale is None or not lost <= set(scale.drop):
        return None
    how = elastic.taken_as
    events = tuple(
        Note(
            EventKind.NODE_PREEMPTED,
            f"{f.message} ({how}: a scale-down, not a fault)",
            attempt.number,
            f.node,
        )
        for f in faults
    )
    first = chain(Decision(events=events), abandon_growth(view, "nodes are being taken away"))
    first = chain(first, Decision(elastic=elastic))
    return chain(first, _scale(view.after(first), scale))


def _scale(view: JobView, scale: Scale) -> Decision:
    """Carry a scale-down out: in place where every remaining rank runs, else by a stop."""
    keep = tuple(n for n in view.attempt.nodes if n not in scale.drop)
    if not running(view, keep):
        return _stop_for(view, scale)
    return _reform(view, keep, (), scale.drop, scale.reason)


def _stop_for(view: JobView, scale: Scale, announce: bool = True) -> Decision:
    """Stop the attempt to restart at ``scale.size`` (control/recovery.py ``rescale``;
    the nodes up ahead, if any, are in the next attempt)."""
    number = view.attempt.number
    events = (Note(EventKind.SCALING_REQUESTED, scale.reason, number),) if announce else ()
    return Decision(
        activity=Rescaling(scale, standby(view.activity)),
        events=events,
        stop=Stop(StopMode.GRACEFUL, scale.reason),
    )


def abandon_growth(view: JobView, why: str) -> Decision:
    """Retire the nodes brought up for a scale-up (the attempt ends, or shrinks); their
    ids go back to the pool to grow onto."""
    added = standby(view.activity)
    if not added:
        return Decision()
    a = view.activity
    message = f"scale up given up: {why}; retiring {', '.join(added)}"
    data = {"lost": list(added), "failures": view.elastic.failures if view.elastic else 0}
    return Decision(
        growth=(*added, *view.growth),
        activity=Rescaling(a.scale) if isinstance(a, Rescaling) else Training(),
        events=(Note(EventKind.ELASTIC_SCALING_FAILED, message, view.attempt.number, data=data),),
        actions=(RetireNodes(added),),
    )


def _taking_away(view: JobView) -> bool:
    nodes = view.attempt.nodes
    return bool(set(view.preempted) & set(nodes)) or (
        view.capacity is not None and view.capacity < len(nodes) + len(standby(view.activity))
    )


def running(view: JobView, nodes: Sequence[str]) -> bool:
    """Whether a scaling may be made in place: in-process restarts on, and every node
    that stays up with its workers running the attempt."""
    if not view.config.in_process:
        return False
    for node_id in nodes:
        report = view.reports.get(node_id)
        if report is None or contact(report, view.config.contact_rule) is not Contact.UP:
            return False
        status = report.about(view.attempt.number)
        if status is None or status.state is not NodeState.RUNNING:
            return False
        if not status.workers or any(w.state is not WorkerState.RUNNING for w in status.workers):
            return False
    return True


def _warming(report: NodeReport | None) -> bool:
    status = report.status if report is not None else None
    return status is not None and status.warming


def standby_up(
    view: JobView, added: tuple[str, ...], deadline: float | None
) -> tuple[list[tuple[str, str]], bool]:
    """The nodes brought up ahead of a change (``added``): those lost (each with why;
    late ones too, past ``deadline``), and whether all are up, idle, done with their
    health checks and their worker template warm (a warming node joins once its workers
    can start at once)."""
    assert deadline is not None
    cfg, reports = view.config, view.reports
    late = view.now >= deadline
    lost, waiting = launch_verdict(added, reports, cfg.contact_rule, late, cfg.node_start_timeout)
    busy = any(HealthBook.checking(reports.get(n)) or _warming(reports.get(n)) for n in added)
    return lost, not lost and not waiting and not busy


def _launch_growth(view: JobView, size: int) -> Decision:
    """Bring up the nodes a scale-up of the attempt to ``size`` nodes adds, while it
    trains on: ahead of the decision (``scalingTimeoutInSeconds`` runs meanwhile), or
    after."""
    assert view.elastic is not None
    attempt = view.attempt
    added = view.growth[: max(0, size - len(view.nodes))]
    due = view.activity.due if isinstance(view.activity, GrowingAhead) else None
    if not added:
        return Decision(activity=Training())  # no node id left to grow onto
    names = ", ".join(added)
    if due is None:
        kind = EventKind.SCALE_UP_PREPARING
        message = (
            f"capacity for {view.capacity} nodes: bringing up {names} ahead of the scale-up "
            f"(scalingTimeoutInSeconds: {view.elastic.config.scaling_timeout:g} s)"
        )
    else:
        kind = EventKind.SCALING_REQUESTED
        message = f"{due.reason}; bringing up {names} while it trains"
    return Decision(
        growth=view.growth[len(added) :],
        activity=GrowingAhead(added, view.now + view.config.node_start_timeout, due),
        events=(Note(kind, message, attempt.number, data={"added": list(added)}),),
        actions=(LaunchNodes(added, attempt.number, view.avoid_hosts),),
    )


def _watch_growth(view: JobView, growth: GrowingAhead) -> Decision:
    """The nodes coming up for a scale-up: retired if lost, else they join once they are
    up and warm and the scale-up is decided: in place (the ranks rejoin, the new nodes
    start), or by a stop and a restart with them."""
    assert view.elastic is not None
    attempt, added = view.attempt, growth.standby
    lost, up = standby_up(view, added, growth.deadline)
    if lost:
        first = Decision(elastic=view.elastic.outcome(False))
        return chain(first, abandon_growth(view.after(first), "; ".join(w for _, w in lost)))
    if not up or growth.due is None:
        return Decision()  # not up, or up and warm ahead of the decision
    before = len(attempt.nodes)
    reason = f"scale up {before} -> {before + len(added)} nodes: {', '.join(added)} up"
    if not view.config.in_process:
        scale = Scale(before + len(added), reason)
        return _stop_for(view, scale, announce=False)  # announced when decided
    if not running(view, attempt.nodes):
        return Decision()  # a rank is not running: its fault, if any, ends the attempt first
    first = Decision(elastic=view.elastic.outcome(True), activity=Training())
    return chain(first, _reform(view.after(first), (*attempt.nodes, *added), added, (), reason))


def _reform(
    view: JobView,
    nodes: tuple[str, ...],
    added: tuple[str, ...],
    dropped: tuple[str, ...],
    reason: str,
) -> Decision:
    """An elastic scaling in place: the next attempt on ``nodes`` (:func:`reform`)."""
    assert view.elastic is not None
    before = len(view.attempt.nodes)
    elastic = view.elastic.scaled(view.now, len(nodes))
    world = len(nodes) * view.config.nproc_per_node
    message = (
        f"{reason}; in place at WORLD_SIZE {world}: the ranks keep their processes and "
        "their state (not counted as a restart)"
    )
    data = {"from": before, "to": len(nodes), "dropped": list(dropped),
            "added": list(added), "in_place": True}  # fmt: skip
    scaling = Decision(
        growth=(*dropped, *view.growth),  # dropped ids may come back
        elastic=elastic,
        end=(AttemptPhase.STOPPED, reason),
        events=(Note(EventKind.ELASTIC_SCALING, message, view.attempt.number + 1, data=data),),
    )
    return chain(scaling, reform(view, nodes, added, dropped))


def reform(
    view: JobView, nodes: tuple[str, ...], added: tuple[str, ...], dropped: tuple[str, ...]
) -> Decision:
    """Start the attempt after the current one (ended) on ``nodes``, in place: the nodes
    that ran it rejoin (their ranks keep their processes), ``added`` start, ``dropped``
    are retired."""
    attempt = view.attempt
    # Every rank of the nodes kept runs: rank 0 keeps its process where node 0 stays.
    host = attempt.endpoint if nodes[0] == attempt.nodes[0] else None
    return Decision(nodes=nodes, phase=JobPhase.RESTARTING, next=InPlace(added, dropped, host=host))
