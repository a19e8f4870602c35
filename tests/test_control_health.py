"""Node health in the control plane (control/health.py and the controller), pure."""

from __future__ import annotations

from typing import Any

import control_helpers as h
from test_control_recovery import NODES, running, stopped
from trainguard.control.actions import (
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
from trainguard.control.events import FaultType
from trainguard.control.health import HealthBook
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState
from trainguard.wire.health import CheckReport, FindingReport, HealthReport

PASSED = CheckReport(name="disk", outcome="passed", message="512 MiB free")
FAILED = CheckReport(name="disk", outcome="failed", message="10 MiB free, expected 512")
XID = FindingReport(
    seq=0, kind="XID", action="replace", message="XID 79: fallen off the bus", evidence={"xid": 79}
)


def with_health(report: NodeReport, **health: Any) -> NodeReport:
    assert report.status is not None
    status = report.status.model_copy(update={"health": HealthReport(**health)})
    return NodeReport(report.node_id, status)


def controller(
    spares: tuple[str, ...] = ("node-2",), retries: int = 3, moves: bool = False
) -> JobController:
    policy = PolicyConfig(
        job_max_retry_count=retries,
        num_restart_before_full_job_restart=None,
        eval_period_seconds=1000.0,
        max_full_job_restarts=None,
        max_num_repeat_offenders_to_avoid=0,
    )
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=policy,
        spare_node_ids=spares,
        stop_grace_seconds=5,
        fresh_node_moves=moves,
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    [launch] = c.start(0.0)
    assert isinstance(launch, LaunchNodes)
    return c


def ready(
    nodes: tuple[str, ...], deep: str | None, **per_node: NodeReport
) -> dict[str, NodeReport]:
    out = {n: with_health(h.report(n, NodeState.READY, None), deep=deep) for n in nodes}
    out.update(per_node)
    return out


def test_the_book_takes_each_check_and_finding_once_per_agent() -> None:
    book = HealthBook()
    report = with_health(h.report("node-1"), deep="Failed", checks=(PASSED, FAILED))
    faults, notes = book.observe(1.0, 0, {"node-1": report})
    # Two results named "disk": the first is taken (one per check name and agent).
    assert [n.kind for n in notes] == ["NodeHealth", "HealthCheck"]
    assert faults == []
    failing = with_health(h.report("node-0"), deep="Failed", checks=(FAILED,))
    faults, notes = book.observe(2.0, 0, {"node-0": failing})
    assert [f.type for f in faults] == [FaultType.HEALTH_CHECK_FAILED]
    assert faults[0].evidence["check"] == "disk"
    assert [n.kind for n in notes] == ["NodeHealth", "HealthCheck", "NodeHealth"]
    assert book.of("node-0").to_json() == {
        "status": "Unschedulable",
        "deep": "Failed",
        "reason": "its disk check failed: 10 MiB free, expected 512",
    }
    assert book.observe(3.0, 0, {"node-0": failing}) == ([], [])  # nothing new

    finding = with_health(h.report("node-1"), findings=(XID,))
    faults, notes = book.observe(4.0, 0, {"node-1": finding})
    assert [f.type for f in faults] == [FaultType.NODE_UNHEALTHY]
    assert book.of("node-1").status.value == "UnschedulablePendingReplacement"
    assert book.observe(5.0, 0, {"node-1": finding})[0] == []  # seq 0 seen
    assert book.unusable("node-1") is not None and book.unusable("node-2") is None


def test_a_node_checking_gets_no_ranks_and_a_failed_check_swaps_in_a_spare() -> None:
    c = controller()
    assert c.observe(1.0, ready(NODES, "InProgress")) == []
    checking = with_health(h.report("node-1", NodeState.READY, None), deep="InProgress")
    assert c.observe(2.0, ready(NODES, "Passed", **{"node-1": checking})) == []
    failed = with_health(h.report("node-1", NodeState.READY, None), deep="Failed", checks=(FAILED,))
    actions = c.observe(3.0, ready(NODES, "Passed", **{"node-1": failed}))
    retire, launch = actions
    assert isinstance(retire, RetireNodes) and retire.node_ids == ("node-1",)
    assert isinstance(launch, LaunchNodes) and launch.node_ids == ("node-2",)
    assert c.nodes == ("node-0", "node-2")
    assert c.restarts == 0  # no rank ran: not counted against jobMaxRetryCount
    kinds = [e.kind for e in c.drain_events()]
    assert "HealthCheck" in kinds and "NodesReplaced" in kinds
    [start] = c.observe(4.0, ready(("node-0", "node-2"), "Passed"))
    assert isinstance(start, StartNodes) and start.attempt == 1
    assert [a.node_id for a in start.assignments] == ["node-0", "node-2"]


def test_a_failed_check_with_no_spare_fails_the_job_naming_the_node_and_check() -> None:
    c = controller(spares=())
    failed = with_health(h.report("node-1", NodeState.READY, None), deep="Failed", checks=(FAILED,))
    [finish] = c.observe(1.0, ready(NODES, "Passed", **{"node-1": failed}))
    assert isinstance(finish, Finish) and c.phase is JobPhase.FAILED
    assert c.reason is not None
    assert "node-1 is Unschedulable: its disk check failed" in c.reason
    assert "no spare node is left" in c.reason


def test_a_finding_mid_job_replaces_the_node_which_never_gets_ranks_again() -> None:
    c = controller(retries=5)
    [start] = c.observe(1.0, ready(NODES, None))
    assert isinstance(start, StartNodes)
    reports = running(0)
    reports["node-1"] = with_health(reports["node-1"], findings=(XID,))
    [stop] = c.observe(2.0, reports)
    assert isinstance(stop, StopNodes)
    actions = c.observe(3.0, stopped(0))
    assert [type(a) for a in actions] == [RetireNodes, LaunchNodes]
    assert c.nodes == ("node-0", "node-2") and c.restarts == 1
    fault = c.timeline.records[0].fault
    assert fault.type is FaultType.NODE_UNHEALTHY and fault.node == "node-1"
    # Another fault later: a restart, and node-1 is still out.
    [start] = c.observe(4.0, ready(("node-0", "node-2"), None))
    assert isinstance(start, StartNodes)
    crash = {
        "node-0": h.report("node-0", NodeState.RUNNING, 1, workers=h.workers(0)),
        "node-2": h.crashed("node-2", 3, 1),
    }
    assert isinstance(c.observe(5.0, crash)[0], StopNodes)
    after = {n: h.report(n, NodeState.STOPPED, 1, workers=()) for n in ("node-0", "node-2")}
    c.observe(6.0, after)
    assert "node-1" not in c.nodes


def test_a_finding_with_no_spare_fails_the_job() -> None:
    c = controller(spares=())
    c.observe(1.0, ready(NODES, None))
    reports = running(0)
    reports["node-1"] = with_health(reports["node-1"], findings=(XID,))
    c.observe(2.0, reports)
    [finish] = c.observe(3.0, stopped(0))
    assert isinstance(finish, Finish)
    assert c.reason is not None and "node-1 is UnschedulablePendingReplacement: XID" in c.reason


def test_a_replacement_asked_for_by_hand_stops_the_attempt_once() -> None:
    c = controller()
    c.observe(1.0, ready(NODES, None))
    c.replace_nodes(2.0, [("node-0", "asked for by hand: ops"), ("node-9", "no such node")])
    c.replace_nodes(2.1, [("node-0", "again")])  # already pending: nothing more
    [stop] = c.observe(2.5, running(0))
    assert isinstance(stop, StopNodes)
    assert [f.type for f in c.current.faults] == [FaultType.NODE_UNHEALTHY]  # type: ignore[union-attr]
    c.observe(3.0, stopped(0))
    assert c.nodes == ("node-2", "node-1")
    health = [e for e in c.drain_events() if e.kind == "NodeHealth"]
    assert [e.node for e in health] == ["node-0"]
    assert health[0].data["status"] == "UnschedulablePendingReplacement"


def test_where_a_fresh_node_lands_elsewhere_no_spare_means_a_fresh_node() -> None:
    """Kubernetes: a node's fresh pod lands on another machine (its Node is labelled)."""
    c = controller(spares=(), moves=True)
    failed = with_health(h.report("node-1", NodeState.READY, None), deep="Failed", checks=(FAILED,))
    retire_none = c.observe(1.0, ready(NODES, "Passed", **{"node-1": failed}))
    [launch] = retire_none
    assert isinstance(launch, LaunchNodes) and launch.node_ids == ("node-1",)
    assert c.health.unusable("node-1") is None and c.restarts == 0
    [start] = c.observe(2.0, ready(NODES, "Passed"))
    assert isinstance(start, StartNodes)
    reports = running(1)
    reports["node-1"] = with_health(reports["node-1"], findings=(XID,))
    [stop] = c.observe(3.0, reports)
    assert isinstance(stop, StopNodes)
    actions = c.observe(4.0, stopped(1))
    assert [type(a) for a in actions] == [RetireNodes, LaunchNodes] or [
        type(a) for a in actions
    ] == [LaunchNodes]
    assert c.nodes == NODES and c.phase is JobPhase.RESTARTING
    notes = [e.message for e in c.drain_events() if e.kind == "NodeHealth"]
    assert (
        notes[-1]
        == "node-1 restarts fresh on another machine (was UnschedulablePendingReplacement)"
    )


def test_a_spare_swapped_at_launch_for_a_lost_nodes_spare_restores_the_lost_nodes_ranks() -> None:
    # node-1 is lost; node-2 comes up in its place but fails its check before any rank
    # starts; node-3 then runs node-1's ranks, whose memory tier is node-1's replica.
    c = controller(spares=("node-2", "node-3"))
    [start] = c.observe(1.0, ready(NODES, "Passed"))
    assert isinstance(start, StartNodes) and {a.replica_source for a in start.assignments} == {None}
    after = running()
    after["node-1"] = h.lost("node-1")
    c.observe(2.0, after)
    after = stopped()
    after["node-1"] = h.lost("node-1")
    c.observe(3.0, after)
    assert c.nodes == ("node-0", "node-2")
    failed = with_health(h.report("node-2", NodeState.READY, None), deep="Failed", checks=(FAILED,))
    c.observe(4.0, ready(("node-0",), "Passed", **{"node-2": failed}))
    assert c.nodes == ("node-0", "node-3")
    [start] = c.observe(5.0, ready(("node-0", "node-3"), "Passed"))
    assert isinstance(start, StartNodes)
    assert [(a.node_id, a.replica_source) for a in start.assignments] == [
        ("node-0", None),
        ("node-3", "node-1"),
    ]
