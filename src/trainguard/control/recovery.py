"""What follows an attempt that failed or is stopped to rescale: the restart decided by
policy, nodes swapped at launch, an in-process restart, an elastic scaling.

Planners (control/decision.py): each takes the job's :class:`JobView` and returns the
:class:`Decision` the controller applies; none changes anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainguard.control import inprocess
from trainguard.control.actions import AttemptPhase, JobPhase, ReplaceRanks
from trainguard.control.attempt import Launching, Rejoining, Training, standby
from trainguard.control.decision import Decision, InPlace, JobView, NextAttempt, Note
from trainguard.control.detect import barrier_fault
from trainguard.control.elastic import Scale
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.hosts import hosts_to_avoid
from trainguard.control.policy import GiveUp, RestartScope, decide_restart
from trainguard.control.script_bug import ScriptBug, script_bug
from trainguard.wire.status import WorkerState

__all__ = [
    "after_failure",
    "faulty_scale_down",
    "replace_at_launch",
    "rescale",
    "restart_in_place",
    "scale_up_failed",
    "watch_rejoin",
]


def scale_up_failed(view: JobView, lost: Sequence[str]) -> Decision:
    """The new nodes of a scale-up did not come up: go on without them (the next
    scale-up waits longer: control/elastic.py)."""
    assert view.elastic is not None
    elastic = view.elastic.outcome(False)
    nodes = tuple(n for n in view.nodes if n not in lost)
    why = f"{', '.join(lost)} did not come up"
    message = f"scale up failed: {why}; going on with {len(nodes)} nodes"
    data = {"lost": list(lost), "failures": elastic.failures}
    return Decision(
        nodes=nodes,
        growth=(*view.growth, *lost),
        elastic=elastic,
        end=(AttemptPhase.FAILED, why),
        events=(Note(EventKind.ELASTIC_SCALING_FAILED, message, view.attempt.number, data=data),),
        next=NextAttempt(view.attempt.scope, retire=tuple(lost)),
    )


def rescale(view: JobView, scale: Scale) -> Decision:
    """Restart the job on ``scale.size`` nodes (elastic training; not a restart counted
    against jobMaxRetryCount): without the dropped nodes, or with new ones."""
    assert view.elastic is not None
    before = len(view.nodes)
    up = standby(view.activity)  # brought up while the attempt trained: not launched again
    fresh = view.growth[: max(0, scale.size - before - len(up))]
    added = (*up, *fresh)
    nodes = (*(n for n in view.nodes if n not in scale.drop), *added)
    elastic = view.elastic.scaled(view.now, len(nodes))
    world = len(nodes) * view.config.nproc_per_node
    data = {"from": before, "to": len(nodes), "dropped": list(scale.drop), "added": list(added)}
    message = f"{scale.reason}; the job restarts at WORLD_SIZE {world} (not counted as a restart)"
    return Decision(
        nodes=nodes,
        growth=(*scale.drop, *view.growth[len(fresh) :]),  # dropped ids may come back
        elastic=elastic,
        activity=Training(),
        phase=JobPhase.RESTARTING,
        events=(Note(EventKind.ELASTIC_SCALING, message, view.attempt.number + 1, data=data),),
        next=NextAttempt(RestartScope.PROCESS, fresh, scale.drop, Launching(growing=added)),
    )


def after_failure(view: JobView) -> Decision:
    """The attempt ended on faults: swap nodes that failed their checks, scale without
    preempted ones, fail on a script bug, else restart as the policy decides."""
    attempt, now, cfg = view.attempt, view.now, view.config
    if not attempt.assignments and all(
        f.type is FaultType.HEALTH_CHECK_FAILED for f in attempt.faults
    ):
        return replace_at_launch(view)
    taken = _preempted_away(view)
    if taken is not None:
        return rescale(view, taken)
    bug = _script_bug(view)
    if bug is not None:
        bug_data = {"error": bug.error, "ranks": list(bug.ranks), "traceback": bug.traceback}
        return Decision(
            events=(Note(EventKind.SCRIPT_ERROR, bug.reason, data=bug_data),),
            finish=(JobPhase.FAILED, bug.reason),
        )
    history, fault_times = view.history, view.node_fault_times
    decision = decide_restart(
        now, attempt.faults, history, fault_times, view.nodes, view.spares, cfg.policy
    )
    if isinstance(decision, GiveUp):
        return Decision(finish=(JobPhase.FAILED, decision.reason))
    unhealthy = tuple(n for n in decision.nodes if n in view.unusable)
    if unhealthy and not cfg.fresh_node_moves:  # one machine: no fresh node
        why = "; ".join(view.unusable[n] for n in unhealthy)
        return Decision(finish=(JobPhase.FAILED, f"{why}; {_spares_left(view.spares)}"))
    used = set(decision.nodes)
    scope = decision.scope
    message = (
        f"{scope.value}-level restart {view.restarts + 1} of {cfg.max_restarts}: {decision.reason}"
    )
    data = {"scope": scope.value, "replaced": dict(decision.replaced)}
    restart = Decision(
        relaunch=unhealthy,
        scope=scope,
        counted=True,
        spares=tuple(s for s in view.spares if s not in used),
        nodes=decision.nodes,
        phase=JobPhase.RESTARTING,
        events=(Note(EventKind.RESTART_SCHEDULED, message, attempt.number + 1, data=data),),
        next=NextAttempt(scope),
    )
    if scope is not RestartScope.JOB:
        return restart
    lost = [f.node for f in attempt.faults if f.node is not None and f.type.loses_node]
    avoid = hosts_to_avoid(
        view.avoid_hosts,
        [*lost, *decision.replaced],
        view.hosts,
        cfg.policy.max_num_repeat_offenders_to_avoid,
    )
    timeout = cfg.elastic.faulty_scale_down_timeout if cfg.elastic else None
    fresh = tuple(n for n in lost if n in decision.nodes)  # no spare took its place
    activity = None
    if timeout is not None and fresh:
        activity = Launching(relaunching=fresh, deadline=now + timeout)
    retired = tuple(n for n in view.nodes if n not in used)
    keep: tuple[str, ...] = ()
    if decision.replaced and all(f.type is FaultType.NODE_LOST for f in attempt.faults):
        # Only nodes were lost, and spares took them: the others' agents may be kept.
        keep = tuple(n for n in decision.nodes if n in attempt.nodes and n not in lost)
    next_attempt = NextAttempt(scope, decision.nodes, retired, activity, keep)
    return dataclasses.replace(restart, avoid_hosts=avoid, next=next_attempt)


def faulty_scale_down(view: JobView, late: Sequence[str]) -> Decision | None:
    """Lost nodes restarting fresh are not up ``faultyScaleDownTimeoutInSeconds`` after
    the restart: go on without them, at the largest allowed size (None: that would be
    under ``minReplicas``: keep waiting)."""
    assert view.elastic is not None
    size = view.elastic.config.fit(len(view.nodes) - len(late))
    if size is None:
        return None
    keep = tuple(n for n in view.nodes if n not in late)[:size]
    drop = tuple(n for n in view.nodes if n not in keep)
    before = len(view.nodes)
    elastic = view.elastic.scaled(view.now, size)
    timeout = elastic.config.faulty_scale_down_timeout
    reason = f"{', '.join(late)} not up {timeout:g} s after the restart"
    message = (
        f"scale down {before} -> {size} nodes: {reason} (faultyScaleDownTimeoutInSeconds; "
        "not counted as a restart)"
    )
    data = {"from": before, "to": size, "dropped": list(drop), "added": [], "faulty": True}
    return Decision(
        nodes=keep,
        growth=(*view.growth, *drop),
        elastic=elastic,
        end=(AttemptPhase.FAILED, reason),
        events=(Note(EventKind.ELASTIC_SCALING, message, view.attempt.number + 1, data=data),),
        next=NextAttempt(view.attempt.scope, retire=drop),
    )


def _preempted_away(view: JobView) -> Scale | None:
    """An elastic job whose only faults are preempted nodes lost (taken before it gave
    them up): a scale-down without them, not a restart (None: not that case). The
    watch's own memory is not kept: with nodes being taken away, it forgets any wait
    for a scale-up, as its next look does."""
    attempt = view.attempt
    if view.elastic is None or not view.preempted or not attempt.faults:
        return None
    lost = {f.node for f in attempt.faults if f.type is FaultType.NODE_LOST}
    if not lost or any(f.type is not FaultType.NODE_LOST for f in attempt.faults):
        return None
    if not lost <= set(view.preempted):
        return None
    at = attempt.ended_at or attempt.started_at
    return view.elastic.observe(at, attempt.nodes, view.capacity, view.preempted, None)[1]


def replace_at_launch(view: JobView) -> Decision:
    """Nodes failed their on-start checks before any rank started: swap them for
    spares and bring those up. No rank ran, so no restart is counted."""
    attempt, spares = view.attempt, view.spares
    failed = list(dict.fromkeys(f.node for f in attempt.faults if f.node is not None))
    if len(failed) > len(spares) and not view.config.fresh_node_moves:
        why = "; ".join(view.unusable[n] for n in failed if n in view.unusable)
        return Decision(finish=(JobPhase.FAILED, f"{why}; {_spares_left(spares)}"))
    replaced = dict(zip(failed, spares, strict=False))
    fresh = tuple(n for n in failed if n not in replaced)  # no spare: a fresh one elsewhere
    swaps = [f"{old} -> {new}" for old, new in replaced.items()]
    swaps += [f"{n} -> a fresh {n} elsewhere" for n in fresh]
    message = (
        f"replacing {', '.join(swaps)} before any rank started (failed on-start health "
        "checks; not counted as a restart)"
    )
    data = {"replaced": replaced, "fresh": list(fresh)}
    avoid = hosts_to_avoid(
        view.avoid_hosts, failed, view.hosts, len(failed) + len(view.avoid_hosts)
    )
    launch = (*replaced.values(), *fresh)
    retire = tuple(n for n in failed if n in replaced)
    return Decision(
        spares=spares[len(replaced) :],
        relaunch=fresh,
        nodes=tuple(replaced.get(n, n) for n in view.nodes),
        scope=RestartScope.JOB,
        avoid_hosts=avoid,
        events=(Note(EventKind.NODES_REPLACED, message, attempt.number + 1, data=data),),
        next=NextAttempt(attempt.scope, launch, retire),
    )


def restart_in_place(view: JobView) -> Decision | None:
    """The attempt's faults recorded: its survivors rejoin the next attempt, the dead
    ranks replaced (None: not eligible, ``inprocess.eligible``; or a script bug, which
    stops and fails the job through ``after_failure``)."""
    cfg, attempt, scope = view.config, view.attempt, RestartScope.IN_PROCESS
    if (
        not cfg.in_process
        or view.restarts >= cfg.max_restarts
        or _script_bug(view) is not None
        or not inprocess.eligible(
            attempt.faults, attempt.number, attempt.assignments, view.reports, cfg.contact_rule
        )
    ):
        return None
    reason = attempt.faults[0].message
    dead = {f.rank for f in attempt.faults}
    survivors = tuple(
        w.rank
        for _, status in attempt.watch.current(attempt.assignments, view.reports)
        for w in status.workers
        if w.state is WorkerState.RUNNING and w.rank not in dead
    )
    message = (
        f"in-process restart {view.restarts + 1} of {view.config.max_restarts}: {reason}; "
        "survivors keep their processes, dead ranks are replaced"
    )
    data: dict[str, object] = {"scope": scope.value, "replaced": {}}
    host = attempt.endpoint if 0 in survivors and view.nodes[0] == attempt.nodes[0] else None
    return Decision(
        end=(AttemptPhase.FAILED, reason),
        scope=scope,
        counted=True,
        phase=JobPhase.RESTARTING,
        events=(Note(EventKind.RESTART_SCHEDULED, message, attempt.number + 1, data=data),),
        next=InPlace(survivors=survivors, host=host),
    )


def watch_rejoin(view: JobView) -> tuple[Decision, list[Fault]]:
    """While an in-process restart is under way: replace the ranks stuck in the failed
    attempt, and fault the ranks that miss the barrier."""
    attempt, cfg = view.attempt, view.config
    assert isinstance(view.activity, Rejoining)
    step = inprocess.watch_rejoin(
        view.now,
        attempt.number,
        view.activity.rejoin,
        view.reports,
        attempt.assignments,
        cfg.stuck_rank_timeout,
        cfg.barrier_timeout,
    )
    node_of = {r: a.node_id for a in attempt.assignments for r in a.global_ranks}
    faults = [
        barrier_fault(view.now, attempt.number, node_of[rank], rank, cfg.barrier_timeout)
        for rank in step.missed
    ]
    events = tuple(
        Note(
            EventKind.STUCK_RANKS_REPLACED,
            f"{', '.join(f'rank {r}' for r in ranks)} did not leave attempt "
            f"{attempt.number - 1} within {cfg.stuck_rank_timeout:g} s (deadlocked in a "
            "collective); giving each a new process",
            attempt.number,
            node_id,
            {"ranks": list(ranks)},
        )
        for node_id, ranks in step.replace.items()
    )
    actions = tuple(ReplaceRanks(attempt.number, n, r) for n, r in step.replace.items())
    replaced = view.activity.rejoin.replaced.union(*step.replace.values())
    rejoin = dataclasses.replace(view.activity.rejoin, replaced=replaced)
    return Decision(
        actions, events, activity=Training() if step.done else Rejoining(rejoin)
    ), faults


def _spares_left(spares: Sequence[str]) -> str:
    if not spares:
        return "no spare node is left to replace it"
    return f"only {len(spares)} spare node{'s' if len(spares) > 1 else ''} left to replace them"


def _script_bug(view: JobView) -> ScriptBug | None:
    """The job's attempts so far end in a script bug (control/script_bug.py)."""
    ended = [a.faults for a in view.attempts if a.faults]
    stepped = any(a.watch.progress is not None for a in view.attempts)
    world = sum(len(a.global_ranks) for a in view.attempts[-1].assignments)
    return script_bug(ended, stepped, world)
