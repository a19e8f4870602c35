"""Elastic training's decisions (control/elastic.py) and the controller's scalings, pure."""

from __future__ import annotations

import pytest

import control_helpers as h
from trainguard.control.actions import (
    AttemptPhase,
    Finish,
    JobPhase,
    LaunchNodes,
    RetireNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.elastic import ElasticConfig, ElasticWatch
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState
from trainguard.wire.status import WorkerState

NODES = ("node-0", "node-1")


def test_sizes_follow_the_increment_or_the_discrete_values() -> None:
    assert ElasticConfig(1, 4).sizes() == (1, 2, 3, 4)
    assert ElasticConfig(2, 8, increment=3).sizes() == (2, 5, 8)
    assert ElasticConfig(1, 8, discrete=(8, 2, 4, 16)).sizes() == (2, 4, 8)
    assert ElasticConfig(2, 8, increment=3).fit(7) == 5
    assert ElasticConfig(2, 8).fit(1) is None
    with pytest.raises(ValueError, match="min"):
        ElasticConfig(3, 2)


def test_preemption_scales_down_at_once_to_what_fits() -> None:
    watch = ElasticWatch(ElasticConfig(1, 4, increment=1))
    nodes = ("n0", "n1", "n2")
    _, scale = watch.observe(10.0, nodes, capacity=2, preempted=["n1"], last_restart=0.0)
    assert scale is not None and scale.size == 2 and scale.drop == ("n1",)
    assert "n1 preempted" in scale.reason
    # With discrete sizes, the largest that fits: 3 left of 4, only 2 allowed.
    even = ElasticWatch(ElasticConfig(2, 4, discrete=(2, 4)))
    four = ("n0", "n1", "n2", "n3")
    _, scale = even.observe(10.0, four, capacity=3, preempted=["n2"], last_restart=0.0)
    assert scale is not None and scale.size == 2 and scale.drop == ("n2", "n3")
    # Under the minimum: no scaling (the node will be lost, a fault).
    low = ElasticWatch(ElasticConfig(2, 4))
    assert (
        low.observe(10.0, ("n0", "n1"), capacity=1, preempted=["n1"], last_restart=0.0)[1] is None
    )


def test_scale_up_waits_for_stable_capacity_and_the_snooze_and_backs_off() -> None:
    cfg = ElasticConfig(1, 4, scaling_timeout=5.0, scale_up_snooze=30.0)
    watch = ElasticWatch(cfg)
    nodes = ("n0", "n1")
    watch, scale = watch.observe(100.0, nodes, 4, [], last_restart=0.0)
    assert scale is None  # capacity just came
    watch, scale = watch.observe(103.0, nodes, 2, [], last_restart=0.0)
    assert scale is None  # gone again: resets
    watch, scale = watch.observe(104.0, nodes, 4, [], last_restart=0.0)
    assert scale is None
    assert watch.observe(108.0, nodes, 4, [], last_restart=0.0)[0] is not watch  # a new value
    _, scale = watch.observe(109.0, nodes, 4, [], last_restart=0.0)
    assert scale is not None and scale.size == 4 and not scale.down
    # Within the snooze after a restart: no scale-up.
    again, _ = ElasticWatch(cfg).observe(100.0, nodes, 4, [], last_restart=90.0)
    again, scale = again.observe(110.0, nodes, 4, [], last_restart=90.0)
    assert scale is None
    again, scale = again.observe(121.0, nodes, 4, [], last_restart=90.0)
    assert scale is not None
    # A failed scale-up doubles the wait.
    again, _ = again.outcome(False).observe(200.0, nodes, 4, [], last_restart=0.0)
    assert again.observe(206.0, nodes, 4, [], last_restart=0.0)[1] is None
    assert again.observe(210.0, nodes, 4, [], last_restart=0.0)[1] is not None


def make(capacity: int = 2, *, begin: bool = True) -> JobController:
    """2 nodes, elastic 1..3, node-2 to grow onto; started unless ``begin`` is False."""
    config = ControlConfig(
        "job",
        NODES,
        2,
        elastic=ElasticConfig(1, 3, scaling_timeout=1.0),
        elastic_node_ids=("node-2",),
        stop_grace_seconds=5,
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    if begin:
        h.begin(c)
        c.set_capacity(capacity)
    return c


def stopped(
    nodes: tuple[str, ...], attempt: int, workers: WorkerState = WorkerState.STOPPED
) -> dict[str, NodeReport]:
    """Nodes whose stop is over, their workers ``workers`` (SUCCEEDED: exited 0 on their own)."""
    return {
        n: h.report(n, NodeState.STOPPED, attempt, workers=h.workers(i, workers))
        for i, n in enumerate(nodes)
    }


def test_a_preempted_node_is_given_up_then_capacity_brings_the_job_back_to_three() -> None:
    c = make()
    c.set_capacity(1, ["node-1"])
    [stop] = c.observe(1.0, h.reports(NODES, NodeState.RUNNING, 0))
    assert isinstance(stop, StopNodes) and stop.mode == "graceful"
    actions = c.observe(2.0, stopped(NODES, 0))
    retire, start = actions
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-1",)
    assert isinstance(start, StartNodes) and [a.node_id for a in start.assignments] == ["node-0"]
    assert start.assignments[0].nnodes == 1  # WORLD_SIZE 2
    assert c.restarts == 0 and c.phase is JobPhase.RUNNING
    assert c.checkpoints.world_size == 2

    # Capacity for 3: the new nodes come up at once, ahead of the scale-up, while the job
    # trains on; once scalingTimeoutInSeconds has passed and they are up, the job stops
    # and restarts with them (they are not launched again).
    c.set_capacity(3)
    one = {"node-0": h.report("node-0", NodeState.RUNNING, 1, workers=h.workers(0))}
    [launch] = c.observe(3.0, one)
    assert isinstance(launch, LaunchNodes) and set(launch.node_ids) == {"node-2", "node-1"}
    assert c.current is not None and c.current.number == 1
    up = {**one, **h.ready(("node-2", "node-1"))}
    assert c.observe(3.5, up) == []  # up, ahead of the decision
    [stop] = c.observe(4.5, up)
    assert isinstance(stop, StopNodes) and stop.node_ids == ("node-0",)
    stopped_one = {"node-0": h.report("node-0", NodeState.STOPPED, 1, workers=())}
    [start] = c.observe(5.0, {**stopped_one, **h.ready(("node-2", "node-1"))})
    assert isinstance(start, StartNodes) and len(start.assignments) == 3
    assert c.restarts == 0 and c.nodes == ("node-0", "node-1", "node-2")
    kinds = [e.kind for e in c.drain_events()]
    assert kinds.count("ElasticScaling") == 2 and "RestartScheduled" not in kinds
    assert kinds[kinds.index("ScaleUpPreparing") :].count("ScalingRequested") == 1


def test_a_scale_up_whose_nodes_do_not_come_up_goes_on_without_them() -> None:
    c = make(capacity=3)
    running = h.reports(NODES, NodeState.RUNNING, 0)
    [launch] = c.observe(1.0, running)  # ahead of the scale-up
    assert isinstance(launch, LaunchNodes) and launch.node_ids == ("node-2",)
    late = {**running, "node-2": h.lost("node-2", "its agent could not start")}
    [retire] = c.observe(2.5, late)  # the job never stopped
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-2",)
    assert c.current is not None and c.current.number == 0
    assert c.elastic is not None and c.elastic.failures == 1
    assert c.restarts == 0 and "node-2" in c.growth
    # The next try waits twice as long, and brings the node up only once decided.
    assert c.observe(3.0, running) == [] and c.observe(4.5, running) == []
    [again] = c.observe(5.1, running)
    assert isinstance(again, LaunchNodes) and again.node_ids == ("node-2",)


def test_a_scale_up_node_lost_while_the_job_restarts_is_left_out() -> None:
    c = make(capacity=3)
    running = h.reports(NODES, NodeState.RUNNING, 0)
    c.observe(1.0, running)
    [stop] = c.observe(2.5, {**running, **h.ready(("node-2",))})
    assert isinstance(stop, StopNodes)
    late = {**stopped(NODES, 0), "node-2": h.lost("node-2", "its agent exited")}
    actions = c.observe(3.0, late)
    assert isinstance(actions[0], RetireNodes) and actions[0].node_ids == ("node-2",)
    assert isinstance(actions[-1], StartNodes) and len(actions[-1].assignments) == 2
    assert c.elastic is not None and c.elastic.failures == 1
    assert c.restarts == 0 and "node-2" in c.growth


def test_a_preempted_node_lost_before_it_was_given_up_is_a_scale_down_not_a_restart() -> None:
    c = make()
    c.set_capacity(1, ["node-1"])
    lost = {
        "node-0": h.report("node-0", NodeState.RUNNING, 0, workers=h.workers(0)),
        "node-1": h.lost("node-1", "pod evicted"),
    }
    [stop] = c.observe(1.0, lost)  # the fault comes first: every rank stops
    assert isinstance(stop, StopNodes)
    after = {"node-0": stopped(NODES, 0)["node-0"], "node-1": h.lost("node-1", "pod evicted")}
    actions = c.observe(2.0, after)
    assert isinstance(actions[0], RetireNodes) and actions[0].node_ids == ("node-1",)
    assert isinstance(actions[-1], StartNodes) and len(actions[-1].assignments) == 1
    assert c.restarts == 0 and c.nodes == ("node-0",)
    kinds = [e.kind for e in c.drain_events()]
    assert kinds.count("ElasticScaling") == 1 and kinds.count("NodePreempted") == 1
    assert c.attempts[0].faults == [] and c.timeline.to_json() == []  # not a fault


def test_a_lost_node_not_back_within_the_faulty_timeout_is_scaled_away() -> None:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig.from_spec(None, 3),
        elastic=ElasticConfig(1, 2, faulty_scale_down_timeout=5.0),
        stop_grace_seconds=5,
        node_start_timeout=120.0,
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    lost = {
        "node-0": h.report("node-0", NodeState.RUNNING, 0, workers=h.workers(0)),
        "node-1": h.lost("node-1"),
    }
    [stop] = c.observe(1.0, lost)
    assert isinstance(stop, StopNodes)
    after = {"node-0": stopped(NODES, 0)["node-0"], "node-1": h.lost("node-1")}
    [launch] = c.observe(2.0, after)  # no spare: both restart fresh (a job-level restart)
    assert isinstance(launch, LaunchNodes) and launch.node_ids == NODES
    assert c.restarts == 1
    up = h.ready(("node-0",))
    assert c.observe(4.0, up) == []  # node-1 not up yet, within the timeout
    actions = c.observe(7.5, up)  # 5 s after the restart: go on without it
    assert isinstance(actions[0], RetireNodes) and actions[0].node_ids == ("node-1",)
    assert isinstance(actions[-1], StartNodes) and len(actions[-1].assignments) == 1
    assert c.restarts == 1 and c.nodes == ("node-0",)
    [scaling] = [e for e in c.drain_events() if e.kind == "ElasticScaling"]
    assert scaling.data["faulty"] is True and "faultyScaleDownTimeoutInSeconds" in scaling.message


def test_ranks_that_finish_their_work_while_a_scaling_stops_them_complete_the_job() -> None:
    """Exit 0 without agreeing to the scaling (trainguard.elastic) is the end of the
    work, not a stop for the scaling: no restart at the new size from a checkpoint."""
    c = make()
    c.set_capacity(1, ["node-1"])
    [stop] = c.observe(1.0, h.reports(NODES, NodeState.RUNNING, 0))
    assert isinstance(stop, StopNodes)
    [finish] = c.observe(2.0, stopped(NODES, 0, WorkerState.SUCCEEDED))
    assert isinstance(finish, Finish) and finish.phase is JobPhase.SUCCEEDED
    assert c.attempts[0].phase is AttemptPhase.SUCCEEDED and len(c.attempts) == 1
    # Stopped for the scaling (they agreed to it, or were signalled): the job restarts.
    c = make()
    c.set_capacity(1, ["node-1"])
    c.observe(1.0, h.reports(NODES, NodeState.RUNNING, 0))
    _, start = c.observe(2.0, stopped(NODES, 0))
    assert isinstance(start, StartNodes) and len(c.attempts) == 2
