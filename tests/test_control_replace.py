"""A lost node replaced in place (control/replace.py): the survivors keep their processes,
a spare takes the lost node's ranks. Plain reports, no processes."""

from __future__ import annotations

import control_helpers as h
from trainguard.control.actions import LaunchNodes, RejoinNodes, RetireNodes, StartNodes, StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState

NODES = ("node-0", "node-1")


def make(in_process: bool = True, spares: tuple[str, ...] = ("node-2",)) -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig.from_spec(None, 3),
        spare_node_ids=spares,
        in_process=in_process,
        barrier_timeout=30.0,
        stuck_rank_timeout=3.0,
    )
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def running(attempt: int, node: str, node_rank: int) -> NodeReport:
    return h.report(node, NodeState.RUNNING, attempt, workers=h.workers(node_rank))


def lost_node_1(c: JobController, now: float) -> list[object]:
    reports = {
        "node-0": running(0, "node-0", 0),
        "node-1": h.lost("node-1", "its host went silent"),
    }
    return c.observe(now, reports)  # type: ignore[return-value]


def test_a_lost_node_is_replaced_in_place_by_a_spare_and_every_rank_keeps_its_number() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, {"node-0": running(0, "node-0", 0), "node-1": running(0, "node-1", 1)})
    [launch] = lost_node_1(c, 2.0)
    assert launch == LaunchNodes(("node-2",), 0)
    events = [e.kind for e in c.drain_events()]
    assert "NodeReplacing" in events and "StoppingAll" not in events
    # While the spare comes up, the lost node's silence is no news.
    assert lost_node_1(c, 3.0) == []
    spare = h.report("node-2", NodeState.READY, None)
    reports = {"node-0": running(0, "node-0", 0), "node-1": h.lost("node-1"), "node-2": spare}
    actions = c.observe(4.0, reports)
    rejoin, start, retire = actions
    assert isinstance(rejoin, RejoinNodes) and isinstance(start, StartNodes)
    assert [a.node_id for a in rejoin.assignments] == ["node-0"]
    assert [(a.node_id, a.global_ranks) for a in start.assignments] == [("node-2", [2, 3])]
    # Its ranks take their state from a peer, not from node-1's memory-tier replica.
    assert start.assignments[0].replica_source is None
    assert retire == RetireNodes(("node-1",))
    assert c.nodes == ("node-0", "node-2") and c.spares == ()
    assert c.restarts == 1 and c.history[0].scope.value == "in-process"
    [record] = c.timeline.records
    assert record.fault.node == "node-1" and record.scope == "in-process"


def test_without_in_process_restarts_or_a_spare_the_attempt_stops_as_before() -> None:
    for c in (make(in_process=False), make(spares=())):
        h.begin(c)
        [stop] = lost_node_1(c, 2.0)
        assert isinstance(stop, StopNodes)


def test_a_spare_that_does_not_come_up_stops_the_attempt() -> None:
    c = make()
    h.begin(c)
    lost_node_1(c, 2.0)
    late = c.config.node_start_timeout + 3.0
    reports = {"node-0": running(0, "node-0", 0), "node-1": h.lost("node-1")}
    [stop] = c.observe(late, reports)
    assert isinstance(stop, StopNodes) and "replacing in place failed" in stop_reason(c)


def test_another_fault_while_the_spare_comes_up_stops_the_attempt_and_frees_the_spare() -> None:
    c = make()
    h.begin(c)
    lost_node_1(c, 2.0)
    crashed = h.crashed("node-0", 1, 0)
    actions = c.observe(3.0, {"node-0": crashed, "node-1": h.lost("node-1")})
    assert RetireNodes(("node-2",)) in actions
    assert any(isinstance(a, StopNodes) for a in actions)
    assert c.spares == ("node-2",)  # back in the pool for the restart


def stop_reason(c: JobController) -> str:
    attempt = c.current
    assert attempt is not None and attempt.reason is not None
    return attempt.reason
