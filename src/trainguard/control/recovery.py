"""What follows an attempt that failed or is stopped to rescale: the restart decided by
policy, nodes swapped at launch, an in-process restart, an elastic scaling.

Functions over a :class:`~trainguard.control.controller.JobController` (its state
machine is there; these are its ways out of an attempt), pure like the rest of the
package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from trainguard.control import inprocess
from trainguard.control.actions import (
    Action,
    AttemptPhase,
    JobPhase,
    LaunchNodes,
    RejoinNodes,
    ReplaceRanks,
)
from trainguard.control.attempt import Attempt
from trainguard.control.detect import barrier_fault
from trainguard.control.elastic import Scale
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.hosts import hosts_to_avoid
from trainguard.control.inprocess import Rejoin
from trainguard.control.policy import GiveUp, RestartRecord, RestartScope, decide_restart
from trainguard.control.reports import NodeReport
from trainguard.control.script_bug import ScriptBug, script_bug
from trainguard.wire.status import WorkerState

if TYPE_CHECKING:
    from trainguard.control.controller import JobController

__all__ = [
    "after_failure",
    "can_restart_in_place",
    "faulty_scale_down",
    "replace_at_launch",
    "rescale",
    "restart_in_place",
    "scale_up_failed",
    "watch_rejoin",
]


def scale_up_failed(
    c: JobController,
    now: float,
    attempt: Attempt,
    lost: Sequence[str],
    reports: Mapping[str, NodeReport],
) -> list[Action]:
    """The new nodes of a scale-up did not come up: go on without them (the next
    scale-up waits longer: control/elastic.py)."""
    assert c.elastic is not None
    c.elastic.outcome(False)
    c.nodes = tuple(n for n in c.nodes if n not in lost)
    c.growth = (*c.growth, *lost)
    c.checkpoints.world_size = len(c.nodes) * c.config.nproc_per_node
    c._end_attempt(now, attempt, AttemptPhase.FAILED, f"{', '.join(lost)} did not come up")
    c._event(
        now,
        EventKind.ELASTIC_SCALING_FAILED,
        f"scale up failed: {', '.join(lost)} did not come up; going on with {len(c.nodes)} nodes",
        attempt=attempt.number,
        data={"lost": list(lost), "failures": c.elastic.failures},
    )
    return c._new_attempt(now, attempt.scope, (), reports, retire=lost)


def rescale(
    c: JobController, now: float, attempt: Attempt, scale: Scale, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """Restart the job on ``scale.size`` nodes (elastic training; not a restart counted
    against jobMaxRetryCount): without the dropped nodes, or with new ones."""
    assert c.elastic is not None
    before = len(c.nodes)
    up = attempt.take_standby()  # brought up while the attempt trained: not launched again
    fresh = c.growth[: max(0, scale.size - before - len(up))]
    added = (*up, *fresh)
    c.growth = (*scale.drop, *c.growth[len(fresh) :])  # dropped ids may come back
    c.nodes = (*(n for n in c.nodes if n not in scale.drop), *added)
    c.elastic.scaled(now, len(c.nodes))
    c.checkpoints.world_size = len(c.nodes) * c.config.nproc_per_node
    c.phase = JobPhase.RESTARTING
    c._event(
        now,
        EventKind.ELASTIC_SCALING,
        f"{scale.reason}; the job restarts at WORLD_SIZE "
        f"{len(c.nodes) * c.config.nproc_per_node} (not counted as a restart)",
        attempt=attempt.number + 1,
        data={"from": before, "to": len(c.nodes), "dropped": list(scale.drop),
              "added": list(added)},
    )  # fmt: skip
    return c._new_attempt(
        now, RestartScope.PROCESS, fresh, reports, retire=scale.drop, growing=added
    )


def after_failure(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> list[Action]:
    if not attempt.assignments and all(
        f.type is FaultType.HEALTH_CHECK_FAILED for f in attempt.faults
    ):
        return replace_at_launch(c, now, attempt, reports)
    taken = _preempted_away(c, attempt)
    if taken is not None:
        return rescale(c, now, attempt, taken, reports)
    bug = _script_bug(c)
    if bug is not None:
        c._event(
            now,
            EventKind.SCRIPT_ERROR,
            bug.reason,
            data={"error": bug.error, "ranks": list(bug.ranks), "traceback": bug.traceback},
        )
        return c._finish(now, JobPhase.FAILED, bug.reason)
    decision = decide_restart(
        now,
        attempt.faults,
        c.history,
        c._node_fault_times,
        c.nodes,
        c.spares,
        c.config.policy,
    )
    if isinstance(decision, GiveUp):
        return c._finish(now, JobPhase.FAILED, decision.reason)
    unhealthy = [n for n in decision.nodes if c.health.unusable(n) is not None]
    if unhealthy and not c.config.fresh_node_moves:  # one machine: no fresh node
        why = "; ".join(w for n in unhealthy if (w := c.health.unusable(n)) is not None)
        return c._finish(now, JobPhase.FAILED, f"{why}; {_spares_left(c.spares)}")
    c._health_events(now, attempt, [r for n in unhealthy if (r := c.health.relaunch(n))])
    c.history.append(RestartRecord(now, decision.scope))
    c.timeline.set_scope(attempt.number, decision.scope.value)
    used = set(decision.nodes)
    c.spares = tuple(s for s in c.spares if s not in used)
    retired = [n for n in c.nodes if n not in used]
    c.nodes = decision.nodes
    c.phase = JobPhase.RESTARTING
    c._event(
        now,
        EventKind.RESTART_SCHEDULED,
        f"{decision.scope.value}-level restart "
        f"{c.restarts} of {c.config.max_restarts}: {decision.reason}",
        attempt=attempt.number + 1,
        data={"scope": decision.scope.value, "replaced": dict(decision.replaced)},
    )
    if decision.scope is not RestartScope.JOB:
        return c._new_attempt(now, decision.scope, (), reports)
    lost = [f.node for f in attempt.faults if f.node is not None and f.type.loses_node]
    c.avoid_hosts = hosts_to_avoid(
        c.avoid_hosts,
        [*lost, *decision.replaced],
        c._hosts,
        c.config.policy.max_num_repeat_offenders_to_avoid,
    )
    actions = c._new_attempt(now, decision.scope, launch=c.nodes, reports=reports, retire=retired)
    if decision.replaced and all(f.type is FaultType.NODE_LOST for f in attempt.faults):
        # Only nodes were lost, and spares took them: the others' agents may be kept.
        keep = tuple(n for n in c.nodes if n in attempt.nodes and n not in lost)
        actions = [replace(a, keep=keep) if isinstance(a, LaunchNodes) else a for a in actions]
    timeout = c.config.elastic.faulty_scale_down_timeout if c.config.elastic else None
    fresh = tuple(n for n in lost if n in c.nodes)  # no spare took its place
    if timeout is not None and fresh:
        c.attempts[-1].replacing, c.attempts[-1].faulty_deadline = fresh, now + timeout
    return actions


def faulty_scale_down(
    c: JobController,
    now: float,
    attempt: Attempt,
    late: Sequence[str],
    reports: Mapping[str, NodeReport],
) -> list[Action] | None:
    """Lost nodes restarting fresh are not up ``faultyScaleDownTimeoutInSeconds`` after
    the restart: go on without them, at the largest allowed size (None: that would be
    under ``minReplicas``: keep waiting)."""
    assert c.elastic is not None
    size = c.elastic.config.fit(len(c.nodes) - len(late))
    if size is None:
        return None
    keep = [n for n in c.nodes if n not in late][:size]
    drop = tuple(n for n in c.nodes if n not in keep)
    before = len(c.nodes)
    c.nodes, c.growth = tuple(keep), (*c.growth, *drop)
    c.elastic.scaled(now, size)
    c.checkpoints.world_size = size * c.config.nproc_per_node
    timeout = c.elastic.config.faulty_scale_down_timeout
    reason = f"{', '.join(late)} not up {timeout:g} s after the restart"
    c._end_attempt(now, attempt, AttemptPhase.FAILED, reason)
    c._event(
        now,
        EventKind.ELASTIC_SCALING,
        f"scale down {before} -> {size} nodes: {reason} (faultyScaleDownTimeoutInSeconds; "
        "not counted as a restart)",
        attempt=attempt.number + 1,
        data={"from": before, "to": size, "dropped": list(drop), "added": [], "faulty": True},
    )
    return c._new_attempt(now, attempt.scope, (), reports, retire=drop)


def _preempted_away(c: JobController, attempt: Attempt) -> Scale | None:
    """An elastic job whose only faults are preempted nodes lost (taken before it gave
    them up): a scale-down without them, not a restart (None: not that case)."""
    if c.elastic is None or not c.preempted or not attempt.faults:
        return None
    lost = {f.node for f in attempt.faults if f.type is FaultType.NODE_LOST}
    if not lost or any(f.type is not FaultType.NODE_LOST for f in attempt.faults):
        return None
    if not lost <= set(c.preempted):
        return None
    return c.elastic.observe(
        attempt.ended_at or attempt.started_at, attempt.nodes, c.capacity, c.preempted, None
    )


def replace_at_launch(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> list[Action]:
    """Nodes failed their on-start checks before any rank started: swap them for
    spares and bring those up. No rank ran, so no restart is counted."""
    failed = list(dict.fromkeys(f.node for f in attempt.faults if f.node is not None))
    if len(failed) > len(c.spares) and not c.config.fresh_node_moves:
        why = "; ".join(w for n in failed if (w := c.health.unusable(n)) is not None)
        return c._finish(now, JobPhase.FAILED, f"{why}; {_spares_left(c.spares)}")
    replaced = dict(zip(failed, c.spares, strict=False))
    c.spares = c.spares[len(replaced) :]
    fresh = [n for n in failed if n not in replaced]  # no spare: a fresh one elsewhere
    c._health_events(now, attempt, [r for n in fresh if (r := c.health.relaunch(n))])
    c.nodes = tuple(replaced.get(n, n) for n in c.nodes)
    c.timeline.set_scope(attempt.number, RestartScope.JOB.value)
    c.avoid_hosts = hosts_to_avoid(
        c.avoid_hosts, failed, c._hosts, len(failed) + len(c.avoid_hosts)
    )
    swaps = [f"{old} -> {new}" for old, new in replaced.items()]
    swaps += [f"{n} -> a fresh {n} elsewhere" for n in fresh]
    c._event(
        now,
        EventKind.NODES_REPLACED,
        f"replacing {', '.join(swaps)} before any rank started (failed on-start health "
        "checks; not counted as a restart)",
        attempt=attempt.number + 1,
        data={"replaced": replaced, "fresh": fresh},
    )
    launch = [*replaced.values(), *fresh]
    retire = [n for n in failed if n in replaced]
    return c._new_attempt(now, attempt.scope, launch, reports, retire=retire)


def can_restart_in_place(
    c: JobController, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> bool:
    if not c.config.in_process or c.restarts >= c.config.max_restarts:
        return False
    if _script_bug(c) is not None:  # stopped, then failed by after_failure
        return False
    return inprocess.eligible(
        attempt.faults,
        attempt.number,
        attempt.assignments,
        reports,
        c.config.contact_rule,
    )


def restart_in_place(
    c: JobController, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
) -> RejoinNodes:
    scope = RestartScope.IN_PROCESS
    reason = attempt.faults[0].message
    dead = {f.rank for f in attempt.faults}
    survivors = tuple(
        w.rank
        for _, status in attempt.watch.current(attempt.assignments, reports)
        for w in status.workers
        if w.state is WorkerState.RUNNING and w.rank not in dead
    )
    c._end_attempt(now, attempt, AttemptPhase.FAILED, reason)
    c.history.append(RestartRecord(now, scope))
    c.timeline.set_scope(attempt.number, scope.value)
    c.phase = JobPhase.RESTARTING
    c._event(
        now,
        EventKind.RESTART_SCHEDULED,
        f"in-process restart {c.restarts} of {c.config.max_restarts}: {reason}; "
        "survivors keep their processes, dead ranks are replaced",
        attempt=attempt.number + 1,
        data={"scope": scope.value, "replaced": {}},
    )
    new = Attempt(len(c.attempts), now, c.nodes, c._watch(len(c.attempts), now))
    new.scope = scope
    new.rejoin = Rejoin(now, survivors)
    c.attempts.append(new)
    host = attempt.endpoint if 0 in survivors and new.nodes[0] == attempt.nodes[0] else None
    started = c._start_attempt(now, new, host)
    return RejoinNodes(started.attempt, started.assignments)


def watch_rejoin(
    c: JobController,
    now: float,
    attempt: Attempt,
    rejoin: Rejoin,
    reports: Mapping[str, NodeReport],
) -> tuple[list[Action], list[Fault]]:
    """While an in-process restart is under way: replace the ranks stuck in the failed
    attempt, and fault the ranks that miss the barrier."""
    cfg = c.config
    step = inprocess.watch_rejoin(
        now,
        attempt.number,
        rejoin,
        reports,
        attempt.assignments,
        cfg.stuck_rank_timeout,
        cfg.barrier_timeout,
    )
    if step.done:
        attempt.rejoin = None
    node_of = {r: a.node_id for a in attempt.assignments for r in a.global_ranks}
    faults = [
        barrier_fault(now, attempt.number, node_of[rank], rank, cfg.barrier_timeout)
        for rank in step.missed
    ]
    actions: list[Action] = []
    for node_id, ranks in step.replace.items():
        actions.append(ReplaceRanks(attempt.number, node_id, ranks))
        c._event(
            now,
            EventKind.STUCK_RANKS_REPLACED,
            f"{', '.join(f'rank {r}' for r in ranks)} did not leave attempt "
            f"{attempt.number - 1} within {cfg.stuck_rank_timeout:g} s (deadlocked in a "
            "collective); giving each a new process",
            attempt=attempt.number,
            node=node_id,
            data={"ranks": list(ranks)},
        )
    return actions, faults


def _spares_left(spares: Sequence[str]) -> str:
    if not spares:
        return "no spare node is left to replace it"
    return f"only {len(spares)} spare node{'s' if len(spares) > 1 else ''} left to replace them"


def _script_bug(c: JobController) -> ScriptBug | None:
    """The job's attempts so far end in a script bug (control/script_bug.py)."""
    ended = [a.faults for a in c.attempts if a.faults]
    stepped = any(a.watch.progress is not None for a in c.attempts)
    world = sum(len(a.global_ranks) for a in c.attempts[-1].assignments)
    return script_bug(ended, stepped, world)
