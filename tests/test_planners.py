"""The planners (control/recovery.py, replace.py, rescale.py, lifecycle.py) as pure
functions: a literal JobView in, a Decision value out. No controller, no processes."""

from __future__ import annotations

import control_helpers as h
from trainguard.control import lifecycle, recovery, replace, rescale
from trainguard.control.actions import (
    AttemptPhase,
    JobPhase,
    LaunchNodes,
    ReplaceRanks,
    RetireNodes,
    StopMode,
)
from trainguard.control.assignment import StoreEndpoint, assign_attempt
from trainguard.control.attempt import (
    Activity,
    Attempt,
    GrowingAhead,
    Launching,
    Rejoining,
    ReplacingInPlace,
    Rescaling,
    Training,
)
from trainguard.control.config import ControlConfig
from trainguard.control.decision import Decision, InPlace, JobView, NextAttempt, Stop, chain
from trainguard.control.detect import AttemptWatch
from trainguard.control.elastic import ElasticConfig, ElasticWatch, Scale
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.inprocess import Rejoin
from trainguard.control.policy import PolicyConfig, RestartRecord, RestartScope
from trainguard.control.reports import NodeReport, NodeState
from trainguard.wire.status import WorkerState

NODES = ("node-0", "node-1")
HOST = StoreEndpoint("10.0.0.1", 29500)


def config(**kw: object) -> ControlConfig:
    kw.setdefault("policy", PolicyConfig.from_spec(None, 3))
    return ControlConfig("job", NODES, 2, **kw)  # type: ignore[arg-type]


def attempt(
    cfg: ControlConfig, faults: tuple[Fault, ...] = (), activity: Activity | None = None
) -> Attempt:
    """Attempt 0 on NODES, started (ranks assigned), with these faults."""
    watch = AttemptWatch(0, 0.0, (), None, contact_rule=cfg.contact_rule)
    a = Attempt(0, 0.0, NODES, watch, phase=AttemptPhase.RUNNING, endpoint=HOST)
    a.assignments = assign_attempt(cfg, NODES, 0, HOST)
    a.faults = list(faults)
    a.activity = activity or Training()
    return a


def view(
    cfg: ControlConfig,
    a: Attempt,
    reports: dict[str, NodeReport] | None = None,
    now: float = 10.0,
    **kw: object,
) -> JobView:
    """The job at ``now`` on ``cfg``'s nodes and spares, ``a`` its only attempt."""
    kw.setdefault("spares", cfg.spare_node_ids)
    return JobView(now, cfg, a, a.activity, reports or {}, cfg.node_ids, attempts=(a,), **kw)  # type: ignore[arg-type]


def lost(node: str) -> Fault:
    return Fault(FaultType.NODE_LOST, 5.0, 0, node, message=f"{node} lost")


def running(*nodes: str) -> dict[str, NodeReport]:
    return {n: h.report(n, NodeState.RUNNING, 0, workers=h.workers(i)) for i, n in enumerate(nodes)}


def test_a_lost_node_is_swapped_for_a_spare_in_a_counted_job_restart() -> None:
    cfg = config(spare_node_ids=("node-2",))
    decided = recovery.after_failure(view(cfg, attempt(cfg, (lost("node-1"),))))
    assert decided.nodes == ("node-0", "node-2") and decided.spares == ()
    assert decided.scope is RestartScope.JOB and decided.counted
    assert decided.phase is JobPhase.RESTARTING and decided.finish is None
    # node-0 lost nothing: its live agent may take the new attempt (a spare took node-1).
    assert decided.next == NextAttempt(
        RestartScope.JOB, ("node-0", "node-2"), ("node-1",), keep=("node-0",)
    )
    [note] = decided.events
    assert note.kind is EventKind.RESTART_SCHEDULED and note.attempt == 1
    assert note.data is not None and note.data["replaced"] == {"node-1": "node-2"}


def test_the_restart_budget_spent_fails_the_job() -> None:
    cfg = config(spare_node_ids=("node-2",))
    spent = tuple(RestartRecord(float(t), RestartScope.JOB) for t in range(3))
    decided = recovery.after_failure(view(cfg, attempt(cfg, (lost("node-1"),)), history=spent))
    assert decided.finish is not None and decided.finish[0] is JobPhase.FAILED
    assert decided.next is None and decided.nodes is None


def test_nodes_failing_their_checks_at_launch_are_swapped_uncounted_or_fail_the_job() -> None:
    cfg = config(spare_node_ids=("node-2",))
    checked = Fault(FaultType.HEALTH_CHECK_FAILED, 1.0, 0, "node-1", message="gpu check failed")
    a = attempt(cfg, (checked,))
    a.assignments = ()  # no rank started
    decided = recovery.after_failure(view(cfg, a))
    assert decided.nodes == ("node-0", "node-2") and decided.spares == ()
    assert decided.scope is RestartScope.JOB and not decided.counted
    assert decided.next == NextAttempt(RestartScope.PROCESS, ("node-2",), ("node-1",))
    # No spare left, and nowhere else to go: the job fails, saying why.
    alone = config(fresh_node_moves=False)
    why = {"node-1": "node-1 is Unschedulable: gpu check failed"}
    decided = recovery.after_failure(view(alone, a, unusable=why))
    assert decided.finish == (
        JobPhase.FAILED,
        "node-1 is Unschedulable: gpu check failed; no spare node is left to replace it",
    )


def test_a_failed_rank_with_survivors_restarts_in_place_keeping_rank_0s_rendezvous() -> None:
    cfg = config(in_process=True, barrier_timeout=30.0, stuck_rank_timeout=3.0)
    dead = Fault(FaultType.WORKER_CRASH, 5.0, 0, "node-1", rank=3, message="rank 3 died")
    reports = running(*NODES)
    failed = h.workers(1, r3=h.failed_worker(3))
    reports["node-1"] = h.report("node-1", NodeState.RUNNING, 0, workers=failed)
    a = attempt(cfg, (dead,))
    decided = recovery.restart_in_place(view(cfg, a, reports))
    assert decided is not None and decided.end == (AttemptPhase.FAILED, "rank 3 died")
    assert decided.scope is RestartScope.IN_PROCESS and decided.counted
    assert decided.next == InPlace(survivors=(0, 1, 2), host=HOST)


def test_a_lost_node_with_a_spare_is_replaced_in_place_then_reformed() -> None:
    cfg = config(in_process=True, spare_node_ids=("node-2",))
    a = attempt(cfg)
    reports = running("node-0")
    begun = replace.begin(view(cfg, a, reports), [lost("node-1")])
    assert begun is not None and begun.spares == () and begun.faults == (lost("node-1"),)
    assert begun.activity == ReplacingInPlace({"node-1": "node-2"}, 10.0 + cfg.node_start_timeout)
    assert begun.actions == (LaunchNodes(("node-2",), 0),)
    # Without in-process restarts, not this planner's case.
    assert replace.begin(view(config(), a, reports), [lost("node-1")]) is None
    # The spare came up idle: the next attempt in place, node-2 in node-1's place.
    a.activity = begun.activity
    a.faults = [lost("node-1")]
    up = {**reports, "node-2": h.report("node-2", NodeState.READY, None)}
    decided = replace.watch(view(cfg, a, up))
    assert decided.end == (AttemptPhase.FAILED, "node-1 lost") and decided.counted
    assert decided.then is not None and decided.then.nodes == ("node-0", "node-2")
    assert decided.then.next == InPlace(("node-2",), ("node-1",), host=HOST)
    # The spare late: the attempt stops, the policy takes over.
    late = view(cfg, a, reports, now=10.0 + cfg.node_start_timeout + 1)
    stop = replace.watch(late).stop
    assert stop is not None and stop.mode is StopMode.PROCESS


def test_a_scale_up_whose_nodes_did_not_come_up_goes_on_without_them() -> None:
    cfg = config(elastic=ElasticConfig(1, 3))
    watch = ElasticWatch(ElasticConfig(1, 3))
    a = attempt(cfg, activity=Launching(growing=("node-1",)))
    decided = recovery.scale_up_failed(view(cfg, a, elastic=watch, growth=("node-3",)), ["node-1"])
    assert decided.nodes == ("node-0",) and decided.growth == ("node-3", "node-1")
    assert decided.elastic is not None and decided.elastic.failures == 1
    assert watch.failures == 0  # the view's watch is left as it was
    assert decided.end == (AttemptPhase.FAILED, "node-1 did not come up")
    assert decided.next == NextAttempt(RestartScope.PROCESS, retire=("node-1",))


def test_a_rescale_restarts_with_the_nodes_up_ahead_and_fresh_ones_from_the_pool() -> None:
    cfg = config(elastic=ElasticConfig(1, 4))
    a = attempt(cfg, activity=GrowingAhead(("node-2",), 20.0))
    v = view(cfg, a, elastic=ElasticWatch(ElasticConfig(1, 4)), growth=("node-3", "node-4"))
    decided = recovery.rescale(v, Scale(4, "scale up 2 -> 4 nodes"))
    assert decided.nodes == ("node-0", "node-1", "node-2", "node-3")
    assert decided.growth == ("node-4",) and decided.activity == Training()
    growing = Launching(growing=("node-2", "node-3"))
    assert decided.next == NextAttempt(RestartScope.PROCESS, ("node-3",), (), growing)


def test_growth_is_abandoned_when_nodes_are_taken_away_and_the_view_follows_the_chain() -> None:
    cfg = config(elastic=ElasticConfig(1, 3))
    a = attempt(cfg, activity=GrowingAhead(("node-2",), 20.0))
    v = view(cfg, a, elastic=ElasticWatch(ElasticConfig(1, 3)), capacity=2)
    decided = rescale.look(v)
    assert decided.actions == (RetireNodes(("node-2",)),)
    assert decided.growth == ("node-2",) and decided.activity == Training()
    assert v.after(decided).activity == Training() and v.after(decided).growth == ("node-2",)
    assert v.activity == GrowingAhead(("node-2",), 20.0)  # the view itself is unchanged


def test_chain_applies_in_order_and_after_folds_every_step() -> None:
    first = Decision(nodes=("a",), stop=Stop(StopMode.GRACEFUL, "why"))
    second = Decision(spares=("s",))
    third = Decision(nodes=("b",))
    chained = chain(chain(first, second), third)
    assert chained.then == Decision(spares=("s",), then=third)
    cfg = config()
    folded = view(cfg, attempt(cfg)).after(chained)
    assert (folded.nodes, folded.spares) == (("b",), ("s",))


def test_the_rejoin_watch_returns_the_ranks_it_replaced_in_the_next_value() -> None:
    """Survivors stuck in the failed attempt get a new process once: the ranks replaced
    are in the Rejoining value the decision carries, the view's stays as it was."""
    cfg = config(in_process=True)
    under_way = Rejoining(Rejoin(0.0, (0, 1, 2, 3)))
    a = attempt(cfg, activity=under_way)
    decided, faults = recovery.watch_rejoin(view(cfg, a, running(*NODES), now=5.0))
    assert faults == [] and a.activity == under_way  # nobody joined; the view unchanged
    assert {(r.node_id, r.ranks) for r in decided.actions if isinstance(r, ReplaceRanks)} == {
        ("node-0", (0, 1)),
        ("node-1", (2, 3)),
    }
    assert isinstance(decided.activity, Rejoining)
    assert decided.activity.rejoin.replaced == {0, 1, 2, 3}
    # The next look, from that value: no rank is replaced twice.
    again, _ = recovery.watch_rejoin(
        view(cfg, attempt(cfg, activity=decided.activity), running(*NODES), now=6.0)
    )
    assert again.actions == () and again.activity == decided.activity


def launching(cfg: ControlConfig, activity: Activity | None = None) -> Attempt:
    """Attempt 0 on NODES, its agents coming up until 30 s (no rank started)."""
    a = attempt(cfg, activity=activity)
    a.phase, a.assignments, a.launch_deadline = AttemptPhase.LAUNCHING, (), 30.0
    return a


def stopping(
    cfg: ControlConfig, faults: tuple[Fault, ...], activity: Activity | None = None
) -> Attempt:
    """Attempt 0 on NODES, stopping since a look before (its nodes have until 20 s)."""
    a = attempt(cfg, faults, activity)
    a.phase, a.stop_deadline = AttemptPhase.STOPPING, 20.0
    a.reason = faults[0].message if faults else None
    return a


def test_a_node_lost_while_launching_fails_the_attempt_and_the_policy_plans_on_after_it() -> None:
    cfg = config(spare_node_ids=("node-2",))
    a = launching(cfg)
    # node-1 not up yet, before the deadline: wait.
    assert lifecycle.launching(view(cfg, a, h.ready(["node-0"]))) == Decision()
    gone = {**h.ready(["node-0"]), "node-1": h.lost("node-1")}
    decided = lifecycle.launching(view(cfg, a, gone))
    [fault] = decided.faults
    assert fault.type is FaultType.NODE_LOST and fault.node == "node-1"
    assert decided.end == (AttemptPhase.FAILED, fault.message) and decided.start is False
    # What follows is planned on the view after that end: a counted restart, the spare in.
    restart = decided.then
    assert restart is not None and restart.nodes == ("node-0", "node-2") and restart.counted
    assert restart.next == NextAttempt(
        RestartScope.JOB, ("node-0", "node-2"), ("node-1",), keep=("node-0",)
    )
    assert a.faults == [] and a.phase is AttemptPhase.LAUNCHING  # the view's attempt unchanged
    # Every agent up and idle: the attempt starts.
    assert lifecycle.launching(view(cfg, a, h.ready(NODES))) == Decision(
        activity=Training(), start=True
    )


def test_a_scale_ups_new_node_lost_while_launching_fails_the_scale_up_not_the_job() -> None:
    cfg = config(elastic=ElasticConfig(1, 3))
    watch = ElasticWatch(ElasticConfig(1, 3))
    a = launching(cfg, Launching(growing=("node-1",)))
    gone = {**h.ready(["node-0"]), "node-1": h.lost("node-1")}
    decided = lifecycle.launching(view(cfg, a, gone, elastic=watch))
    assert decided.faults == () and decided.end == (AttemptPhase.FAILED, "node-1 did not come up")
    assert decided.nodes == ("node-0",) and decided.growth == ("node-1",)
    assert decided.elastic is not None and decided.elastic.failures == 1
    assert decided.next == NextAttempt(RestartScope.PROCESS, retire=("node-1",))
    # It came up: the attempt starts, and the scale-up counts as a success.
    started = lifecycle.launching(view(cfg, a, h.ready(NODES), elastic=watch))
    assert started.start and started.activity == Training()
    assert started.elastic is not None and started.elastic is not watch


def test_a_stopped_attempt_ends_on_its_faults_then_the_policy_restarts_it() -> None:
    cfg = config()
    crash = Fault(FaultType.WORKER_CRASH, 5.0, 0, "node-1", rank=3, message="rank 3 died")
    a = stopping(cfg, (crash,))
    # node-1 still stops, before its deadline: wait (the deadline set at the first look).
    still = h.reports(NODES, NodeState.STOPPING)
    assert lifecycle.stopping(view(cfg, a, still)) == Decision(stop_deadline=20.0)
    a.stop_deadline = None
    assert (
        lifecycle.stopping(view(cfg, a, still, now=12.0)).stop_deadline == 12.0 + a.stop_allowance
    )
    a.stop_deadline = 20.0
    stopped = h.reports(NODES, NodeState.FAULTED)
    decided = lifecycle.stopping(view(cfg, a, stopped))
    assert decided.faults == () and decided.end == (AttemptPhase.FAILED, "rank 3 died")
    restart = decided.then
    assert restart is not None and restart.scope is RestartScope.PROCESS and restart.counted
    assert restart.phase is JobPhase.RESTARTING and restart.next == NextAttempt(
        RestartScope.PROCESS
    )
    # Past the deadline, the node still stopping is faulted for it too; a cancel ends the job.
    late = lifecycle.stopping(view(cfg, a, still, now=21.0, cancel=(JobPhase.STOPPED, "deleted")))
    assert [f.type for f in late.faults] == [FaultType.NODE_STOP_TIMEOUT] * 2
    assert late.then == Decision(finish=(JobPhase.STOPPED, "deleted"))


def test_a_scaling_stop_restarts_at_the_new_size_or_completes_where_the_work_was_done() -> None:
    cfg = config(elastic=ElasticConfig(1, 3))
    scale = Scale(1, "scale down 2 -> 1 nodes", drop=("node-1",))
    a = stopping(cfg, (), Rescaling(scale))
    a.reason = scale.reason
    watch = ElasticWatch(ElasticConfig(1, 3))
    # node-1 is taken away: its silence is no fault; node-0's ranks were stopped.
    stopped = {
        "node-0": h.report(
            "node-0", NodeState.STOPPED, 0, workers=h.workers(0, WorkerState.STOPPED)
        ),
        "node-1": h.lost("node-1"),
    }
    decided = lifecycle.stopping(view(cfg, a, stopped, elastic=watch))
    assert decided.faults == () and decided.end == (AttemptPhase.STOPPED, scale.reason)
    rescaled = decided.then
    assert rescaled is not None and rescaled.nodes == ("node-0",) and not rescaled.counted
    assert rescaled.next == NextAttempt(RestartScope.PROCESS, (), ("node-1",), Launching())
    # Its ranks exited 0 on their own before they stopped: the job completes.
    done = {
        **stopped,
        "node-0": h.report(
            "node-0", NodeState.COMPLETED, 0, workers=h.workers(0, WorkerState.SUCCEEDED)
        ),
    }
    assert lifecycle.stopping(view(cfg, a, done, elastic=watch)) == Decision(
        stop_deadline=20.0, complete="all ranks completed"
    )


def test_a_fault_while_running_is_recorded_and_stops_every_rank() -> None:
    cfg = config()
    hang = Fault(FaultType.LOG_HANG, 5.0, 0, "node-1", rank=2, message="rank 2 hangs")
    decided = lifecycle.faulted(view(cfg, attempt(cfg), running(*NODES)), [hang])
    assert decided == Decision(
        faults=(hang,), then=Decision(stop=Stop(StopMode.PROCESS, "rank 2 hangs", capture=True))
    )
    assert lifecycle.faulted(view(cfg, attempt(cfg), running(*NODES)), []) is None
