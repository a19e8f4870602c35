"""Elastic scalings in place (control/rescale.py): a resilient job shrinks and grows
without stopping its ranks, pure."""

from __future__ import annotations

import dataclasses

import control_helpers as h
from trainguard.control.actions import (
    AttemptPhase,
    JobPhase,
    LaunchNodes,
    RejoinNodes,
    RetireNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.attempt import Rejoining, standby
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.elastic import ElasticConfig
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState
from trainguard.wire.status import WorkerState

NODES = ("node-0", "node-1", "node-2")


def make(capacity: int = 3, *, in_process: bool = True) -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        elastic=ElasticConfig(1, 4, scaling_timeout=1.0),
        elastic_node_ids=("node-3",),
        stop_grace_seconds=5,
        in_process=in_process,
        node_start_timeout=30.0,
        policy=PolicyConfig.from_spec(None, 3),
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    c.set_capacity(capacity)
    return c


def running(nodes: tuple[str, ...], attempt: int) -> dict[str, NodeReport]:
    return {
        n: h.report(n, NodeState.RUNNING, attempt, workers=h.workers(i))
        for i, n in enumerate(nodes)
    }


def test_a_preempted_node_leaves_and_the_survivors_rejoin_renumbered_in_place() -> None:
    c = make()
    c.set_capacity(2, ["node-1"])
    actions = c.observe(1.0, running(NODES, 0))
    rejoin, retire = actions
    assert isinstance(rejoin, RejoinNodes) and rejoin.attempt == 1
    assert [(a.node_id, a.node_rank, a.global_ranks) for a in rejoin.assignments] == [
        ("node-0", 0, [0, 1]),
        ("node-2", 1, [2, 3]),  # ranks 4, 5 before: renumbered after the node that left
    ]
    assert all(a.nnodes == 2 and a.in_process for a in rejoin.assignments)
    # Rank 0 keeps its process, and serves the next attempt's rendezvous on its port.
    assert {a.master_port for a in rejoin.assignments} == {30000}
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-1",)
    assert not any(isinstance(a, StopNodes) for a in actions)
    assert c.restarts == 0 and c.nodes == ("node-0", "node-2") and "node-1" in c.growth
    assert c.checkpoints.world_size == 4
    assert c.attempts[0].phase is AttemptPhase.STOPPED
    assert c.attempts[1].scope == "in-process" and isinstance(c.attempts[1].activity, Rejoining)
    [scaling] = [e for e in c.drain_events() if e.kind == "ElasticScaling"]
    assert scaling.data["in_place"] is True and scaling.data["dropped"] == ["node-1"]
    assert (scaling.data["from"], scaling.data["to"]) == (3, 2)

    joined = {
        n: h.report(
            n,
            NodeState.RUNNING,
            1,
            workers=tuple(w.model_copy(update={"joined": 1}) for w in h.workers(i)),
        )
        for i, n in enumerate(c.nodes)
    }
    assert c.observe(2.0, joined) == []
    assert c.current is not None and not isinstance(
        c.current.activity, Rejoining
    )  # every rank joined


def test_node_0_preempted_moves_rank_0_and_the_rendezvous_to_the_next_node() -> None:
    c = make()
    c.set_capacity(2, ["node-0"])
    rejoin, _ = c.observe(1.0, running(NODES, 0))
    assert isinstance(rejoin, RejoinNodes)
    assert [(a.node_id, a.global_ranks) for a in rejoin.assignments] == [
        ("node-1", [0, 1]),
        ("node-2", [2, 3]),
    ]
    assert {a.master_port for a in rejoin.assignments} == {30001}  # a new store, on node-1


def test_capacity_back_brings_new_nodes_up_ahead_and_they_join_once_decided() -> None:
    c = make(capacity=4)
    now = running(NODES, 0)
    [launch] = c.observe(1.0, now)  # at once, while scalingTimeoutInSeconds runs
    assert isinstance(launch, LaunchNodes) and launch.node_ids == ("node-3",)
    assert c.current is not None and c.current.phase is AttemptPhase.RUNNING
    [preparing] = [e for e in c.drain_events() if e.kind == "ScaleUpPreparing"]
    assert "ahead of the scale-up" in preparing.message
    up = {**now, **h.ready(("node-3",))}
    assert c.observe(1.5, up) == []  # up and idle: the scale-up is not decided yet
    actions = c.observe(2.0, up)
    rejoin, start = actions
    assert isinstance(rejoin, RejoinNodes) and [a.node_id for a in rejoin.assignments] == [*NODES]
    assert isinstance(start, StartNodes) and [a.node_id for a in start.assignments] == ["node-3"]
    assert start.attempt == rejoin.attempt == 1 and start.assignments[0].global_ranks == [6, 7]
    assert all(a.nnodes == 4 for a in (*rejoin.assignments, *start.assignments))
    assert {a.master_port for a in (*rejoin.assignments, *start.assignments)} == {30000}
    assert c.restarts == 0 and c.phase is JobPhase.RUNNING and c.nodes == (*NODES, "node-3")
    assert c.elastic is not None and c.elastic.failures == 0


def test_a_decided_scale_up_waits_for_its_nodes_to_be_up_and_warm() -> None:
    c = make(capacity=4)
    now = running(NODES, 0)
    c.observe(1.0, now)
    assert c.observe(2.5, now) == []  # decided; node-3's agent is starting
    idle = h.ready(("node-3",))["node-3"]
    assert idle.status is not None
    warming = dataclasses.replace(idle, status=idle.status.model_copy(update={"warming": True}))
    assert c.observe(3.0, {**now, "node-3": warming}) == []  # its template imports
    rejoin, start = c.observe(3.5, {**now, **h.ready(("node-3",))})
    assert isinstance(rejoin, RejoinNodes) and isinstance(start, StartNodes)


def test_capacity_taken_back_before_the_decision_retires_the_nodes_up_ahead() -> None:
    c = make(capacity=4)
    now = running(NODES, 0)
    c.observe(1.0, now)
    c.set_capacity(3)
    [retire] = c.observe(1.5, {**now, **h.ready(("node-3",))})
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-3",)
    assert c.current is not None and c.current.number == 0 and standby(c.current.activity) == ()
    assert c.elastic is not None and c.elastic.failures == 0  # not the nodes' fault
    assert c.growth == ("node-3",)
    assert c.observe(5.0, now) == []


def test_new_nodes_that_do_not_come_up_are_retired_and_the_attempt_goes_on() -> None:
    c = make(capacity=4)
    now = running(NODES, 0)
    [launch] = c.observe(1.0, now)
    assert isinstance(launch, LaunchNodes)
    [retire] = c.observe(3.0, {**now, "node-3": h.lost("node-3", "its agent could not start")})
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-3",)
    assert c.current is not None and c.current.number == 0
    assert c.current.phase is AttemptPhase.RUNNING
    assert c.elastic is not None and c.elastic.failures == 1 and "node-3" in c.growth
    # The next try waits twice as long (2 s), and brings nodes up only once decided.
    assert c.observe(4.0, now) == [] and c.observe(5.5, now) == []
    [again] = c.observe(6.1, now)
    assert isinstance(again, LaunchNodes)
    *_, requested = [e for e in c.drain_events() if e.kind == "ScalingRequested"]
    assert "bringing up node-3 while it trains" in requested.message


def test_a_fault_while_new_nodes_come_up_retires_them_and_restarts_in_place() -> None:
    c = make(capacity=4)
    now = running(NODES, 0)
    c.observe(1.0, now)
    crash = {**now, "node-1": h.crashed("node-1", 3)}
    retire, rejoin = c.observe(3.0, crash)
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-3",)
    assert isinstance(rejoin, RejoinNodes) and len(rejoin.assignments) == 3
    assert c.restarts == 1 and "node-3" in c.growth


def test_without_in_process_restarts_or_with_a_rank_down_a_scaling_stops_the_job() -> None:
    c = make(in_process=False)
    c.set_capacity(2, ["node-1"])
    [stop] = c.observe(1.0, running(NODES, 0))
    assert isinstance(stop, StopNodes) and stop.mode == "graceful"

    c = make()
    c.set_capacity(2, ["node-1"])
    starting = {**running(NODES, 0), "node-2": h.report("node-2", NodeState.STARTING, 0)}
    [stop] = c.observe(1.0, starting)
    assert isinstance(stop, StopNodes)
    done = {n: h.report(n, NodeState.STOPPED, 0, workers=h.workers(i, WorkerState.STOPPED))
            for i, n in enumerate(NODES)}  # fmt: skip
    retire, start = c.observe(2.0, done)
    assert isinstance(retire, RetireNodes) and isinstance(start, StartNodes)
    assert c.restarts == 0 and c.attempts[1].scope == "process"


def test_a_node_taken_without_notice_is_a_scale_down_in_place_not_a_fault() -> None:
    c = make()
    c.set_capacity(2, ["node-1"])
    evicted = {**running(NODES, 0), "node-1": h.lost("node-1", "pod evicted")}
    rejoin, retire = c.observe(1.0, evicted)
    assert isinstance(rejoin, RejoinNodes) and len(rejoin.assignments) == 2
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-1",)
    assert c.restarts == 0 and c.attempts[0].faults == [] and c.timeline.to_json() == []
    kinds = [e.kind for e in c.drain_events()]
    assert "NodePreempted" in kinds and "ElasticScaling" in kinds

    # Under minReplicas there is no scaling: the lost node is a fault like any other.
    c = make()
    assert c.elastic is not None
    c.elastic = type(c.elastic)(ElasticConfig(3, 4))
    c.set_capacity(2, ["node-1"])
    [stop] = c.observe(1.0, {**running(NODES, 0), "node-1": h.lost("node-1", "pod evicted")})
    assert isinstance(stop, StopNodes) and stop.mode == "process"
    assert [f.type.value for f in c.attempts[0].faults] == ["NodeLost"]
