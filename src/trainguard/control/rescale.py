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

Functions over a :class:`~trainguard.control.controller.JobController`, pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trainguard.control.actions import (
    Action,
    AttemptPhase,
    JobPhase,
    LaunchNodes,
    RejoinNodes,
    RetireNodes,
    StartNodes,
    StopMode,
)
from trainguard.control.attempt import Attempt
from trainguard.control.contact import Contact, contact, launch_verdict
from trainguard.control.elastic import Scale
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.inprocess import Rejoin
from trainguard.control.policy import RestartScope
from trainguard.control.reports import NodeReport
from trainguard.wire.status import NodeState, WorkerState

if TYPE_CHECKING:
    from trainguard.control.controller import JobController

__all__ = ["abandon_growth", "look", "preempted_lost", "reform", "running", "standby_up"]


def look(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """One look at an elastic job's running attempt: what its size needs now (nothing,
    nodes to bring up, a scaling in place, or a stop to restart at the new size)."""
    assert c.elastic is not None
    actions: list[Action] = []
    if attempt.standby and _taking_away(c, attempt):
        actions += abandon_growth(c, now, attempt, "nodes are being taken away")
    scale = c.elastic.observe(now, attempt.nodes, c.capacity, c.preempted, attempt.started_at)
    if scale is not None and scale.down:
        return [*actions, *_scale(c, now, attempt, scale, reports)]
    if scale is not None and attempt.scale_due is None:
        attempt.scale_due = scale
        if attempt.standby:
            c._event(now, EventKind.SCALING_REQUESTED,
                     f"{scale.reason}; with {', '.join(attempt.standby)}, brought up ahead",
                     attempt=attempt.number, data={"added": list(attempt.standby)})  # fmt: skip
    if attempt.standby:
        return [*actions, *_watch_growth(c, now, attempt, reports)]
    if attempt.scale_due is not None:  # decided with no node up ahead (after a failed try)
        return [*actions, *_launch_growth(c, now, attempt, attempt.scale_due.size)]
    target = c.elastic.room(len(attempt.nodes), c.capacity)
    if target is not None:
        actions += _launch_growth(c, now, attempt, target)
    return actions


def preempted_lost(
    c: JobController,
    now: float,
    attempt: Attempt,
    faults: Sequence[Fault],
    reports: Mapping[str, NodeReport],
) -> list[Action] | None:
    """``faults`` are only preempted nodes lost before the job gave them up (taken without
    notice): a scale-down without them, in place where it can be, and no fault. None:
    not that case (other faults, or the rest is under ``minReplicas``)."""
    if c.elastic is None or not faults or attempt.rejoin is not None:
        return None
    lost = {f.node for f in faults}
    taken = set(c.preempted)
    if any(f.type is not FaultType.NODE_LOST or f.node not in taken for f in faults):
        return None
    scale = c.elastic.observe(now, attempt.nodes, c.capacity, c.preempted, attempt.started_at)
    if scale is None or not lost <= set(scale.drop):
        return None
    for fault in faults:
        how = c.elastic.taken_as
        message = f"{fault.message} ({how}: a scale-down, not a fault)"
        c._event(now, EventKind.NODE_PREEMPTED, message, attempt=attempt.number, node=fault.node)
    actions = abandon_growth(c, now, attempt, "nodes are being taken away")
    return [*actions, *_scale(c, now, attempt, scale, reports)]


def _scale(
    c: JobController, now: float, attempt: Attempt, scale: Scale, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """Carry a scale-down out: in place where every remaining rank runs, else by a stop."""
    keep = [n for n in attempt.nodes if n not in scale.drop]
    if not running(c, attempt, keep, reports):
        return _stop_for(c, now, attempt, scale)
    return _reform(c, now, attempt, tuple(keep), (), scale.drop, scale.reason)


def _stop_for(
    c: JobController, now: float, attempt: Attempt, scale: Scale, announce: bool = True
) -> list[Action]:
    """Stop ``attempt`` to restart at ``scale.size`` (control/recovery.py ``rescale``;
    the nodes up ahead, if any, are in the next attempt)."""
    attempt.scale = scale
    if announce:
        c._event(now, EventKind.SCALING_REQUESTED, scale.reason, attempt=attempt.number)
    return [c._stop(now, attempt, StopMode.GRACEFUL, scale.reason)]


def abandon_growth(c: JobController, now: float, attempt: Attempt, why: str) -> list[Action]:
    """Retire the nodes brought up for a scale-up (the attempt ends, or shrinks); their
    ids go back to the pool to grow onto."""
    added = attempt.take_standby()
    if not added:
        return []
    c.growth = (*added, *c.growth)
    c._event(
        now,
        EventKind.ELASTIC_SCALING_FAILED,
        f"scale up given up: {why}; retiring {', '.join(added)}",
        attempt=attempt.number,
        data={"lost": list(added), "failures": c.elastic.failures if c.elastic else 0},
    )
    return [RetireNodes(added)]


def _taking_away(c: JobController, attempt: Attempt) -> bool:
    size = len(attempt.nodes)
    return bool(set(c.preempted) & set(attempt.nodes)) or (
        c.capacity is not None and c.capacity < size + len(attempt.standby)
    )


def running(
    c: JobController, attempt: Attempt, nodes: Sequence[str], reports: Mapping[str, NodeReport]
) -> bool:
    """Whether a scaling may be made in place: in-process restarts on, and every node
    that stays up with its workers running the attempt."""
    if not c.config.in_process:
        return False
    for node_id in nodes:
        report = reports.get(node_id)
        if report is None or contact(report, c.config.contact_rule) is not Contact.UP:
            return False
        status = report.about(attempt.number)
        if status is None or status.state is not NodeState.RUNNING:
            return False
        if not status.workers or any(w.state is not WorkerState.RUNNING for w in status.workers):
            return False
    return True


def _warming(report: NodeReport | None) -> bool:
    status = report.status if report is not None else None
    return status is not None and status.warming


def standby_up(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> tuple[list[tuple[str, str]], bool]:
    """The nodes brought up ahead of a change (``attempt.standby``): those lost (each with
    why; late ones too, past ``standby_deadline``), and whether all are up, idle, done
    with their health checks and their worker template warm (a warming node joins once
    its workers can start at once)."""
    assert attempt.standby_deadline is not None
    added = attempt.standby
    lost, waiting = launch_verdict(
        added,
        reports,
        c.config.contact_rule,
        now >= attempt.standby_deadline,
        c.config.node_start_timeout,
    )
    busy = any(c.health.checking(reports.get(n)) or _warming(reports.get(n)) for n in added)
    return lost, not lost and not waiting and not busy


def _launch_growth(c: JobController, now: float, attempt: Attempt, size: int) -> list[Action]:
    """Bring up the nodes a scale-up of ``attempt`` to ``size`` nodes adds, while it trains
    on: ahead of the decision (``scalingTimeoutInSeconds`` runs meanwhile), or after."""
    added = c.growth[: max(0, size - len(c.nodes))]
    if not added:
        attempt.scale_due = None  # no node id left to grow onto
        return []
    c.growth = c.growth[len(added) :]
    attempt.standby = added
    attempt.standby_deadline = now + c.config.node_start_timeout
    assert c.elastic is not None
    due, names = attempt.scale_due, ", ".join(added)
    if due is None:
        kind = EventKind.SCALE_UP_PREPARING
        message = (
            f"capacity for {c.capacity} nodes: bringing up {names} ahead of the scale-up "
            f"(scalingTimeoutInSeconds: {c.elastic.config.scaling_timeout:g} s)"
        )
    else:
        kind, message = (
            EventKind.SCALING_REQUESTED,
            f"{due.reason}; bringing up {names} while it trains",
        )
    c._event(now, kind, message, attempt=attempt.number, data={"added": list(added)})
    return [LaunchNodes(added, attempt.number, c.avoid_hosts)]


def _watch_growth(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """The nodes coming up for a scale-up: retired if lost, else they join once they are
    up and warm and the scale-up is decided: in place (the ranks rejoin, the new nodes
    start), or by a stop and a restart with them."""
    assert c.elastic is not None
    added = attempt.standby
    lost, up = standby_up(c, now, attempt, reports)
    if lost:
        c.elastic.outcome(False)
        return abandon_growth(c, now, attempt, "; ".join(why for _, why in lost))
    if not up:
        return []
    due = attempt.scale_due
    if due is None:
        return []  # up and warm, ahead of the decision
    before = len(attempt.nodes)
    reason = f"scale up {before} -> {before + len(added)} nodes: {', '.join(added)} up"
    if not c.config.in_process:
        scale = Scale(before + len(added), reason)
        return _stop_for(c, now, attempt, scale, announce=False)  # announced when decided
    if not running(c, attempt, attempt.nodes, reports):
        return []  # a rank is not running: its fault, if any, ends the attempt first
    c.elastic.outcome(True)
    attempt.take_standby()
    return _reform(c, now, attempt, (*attempt.nodes, *added), added, (), reason)


def _reform(
    c: JobController,
    now: float,
    attempt: Attempt,
    nodes: tuple[str, ...],
    added: tuple[str, ...],
    dropped: tuple[str, ...],
    reason: str,
) -> list[Action]:
    """An elastic scaling in place: the next attempt on ``nodes`` (:func:`reform`)."""
    assert c.elastic is not None
    before = len(attempt.nodes)
    c.growth = (*dropped, *c.growth)  # dropped ids may come back
    c.elastic.scaled(now, len(nodes))
    world = len(nodes) * c.config.nproc_per_node
    c.checkpoints.world_size = world
    c._end_attempt(now, attempt, AttemptPhase.STOPPED, reason)
    c._event(
        now,
        EventKind.ELASTIC_SCALING,
        f"{reason}; in place at WORLD_SIZE {world}: the ranks keep their processes and "
        "their state (not counted as a restart)",
        attempt=attempt.number + 1,
        data={"from": before, "to": len(nodes), "dropped": list(dropped),
              "added": list(added), "in_place": True},
    )  # fmt: skip
    return reform(c, now, attempt, nodes, added, dropped)


def reform(
    c: JobController,
    now: float,
    attempt: Attempt,
    nodes: tuple[str, ...],
    added: tuple[str, ...],
    dropped: tuple[str, ...],
) -> list[Action]:
    """Start the attempt after ``attempt`` (ended) on ``nodes``, in place: the nodes that
    ran ``attempt`` rejoin (their ranks keep their processes), ``added`` start, ``dropped``
    are retired."""
    c.nodes = nodes
    c.phase = JobPhase.RESTARTING
    number = len(c.attempts)
    new = Attempt(number, now, nodes, c._watch(number, now), RestartScope.IN_PROCESS)
    new.rejoin = Rejoin(now, ())  # every rank must join; none is replaced as stuck
    c.attempts.append(new)
    # Every rank of the nodes kept runs: rank 0 keeps its process where node 0 stays.
    host = attempt.endpoint if nodes[0] == attempt.nodes[0] else None
    started = c._start_attempt(now, new, host)
    kept = tuple(a for a in started.assignments if a.node_id not in added)
    actions: list[Action] = [RejoinNodes(started.attempt, kept)]
    if added:
        fresh = tuple(a for a in started.assignments if a.node_id in added)
        actions.append(StartNodes(started.attempt, fresh, started.scope))
    if dropped:
        actions.append(RetireNodes(dropped))
    return actions
