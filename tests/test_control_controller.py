"""The job controller's state machine, driven by plain reports: no processes, no clock."""

import control_helpers as h
from trainguard.control.actions import Finish, JobPhase, LaunchNodes, StartNodes, StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState

NODES = ("node-0", "node-1")


def make(max_restarts: int = 0, **kw: object) -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig.from_spec(None, max_restarts),
        stop_grace_seconds=5,
        stop_slack_seconds=10,
        **kw,
    )  # type: ignore[arg-type]
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def reports(state: NodeState, attempt: int = 0, **per_node: NodeReport) -> dict[str, NodeReport]:
    return h.reports(NODES, state, attempt, **per_node)


def crashed(
    attempt: int = 0, node: str = "node-1", rank: int = 3, peers: str = "running"
) -> NodeReport:
    return h.crashed(node, rank, attempt, peers=h.WorkerState(peers))


def test_start_launches_the_nodes_then_assigns_a_fresh_endpoint_once_all_answer() -> None:
    c = make()
    [launch] = c.start(0.0)
    assert launch == LaunchNodes(NODES, 0)
    assert (
        c.observe(0.5, {"node-0": h.ready(NODES)["node-0"], "node-1": NodeReport("node-1")}) == []
    )
    [action] = c.observe(1.0, h.ready(NODES))
    assert isinstance(action, StartNodes)
    assert action.attempt == 0
    assert [a.node_id for a in action.assignments] == list(NODES)
    assert {a.master_port for a in action.assignments} == {30000}
    assert c.phase is JobPhase.RUNNING


def test_a_node_that_never_comes_up_is_lost() -> None:
    c = make(max_restarts=0, node_start_timeout=5.0)
    c.start(0.0)
    assert c.observe(4.0, {"node-0": h.ready(NODES)["node-0"]}) == []
    [finish] = c.observe(5.0, {"node-0": h.ready(NODES)["node-0"]})
    assert isinstance(finish, Finish) and finish.phase is JobPhase.FAILED
    assert "node-1 lost: its agent was not ready within 5s" in finish.reason


def test_all_nodes_completed_is_success() -> None:
    c = make()
    h.begin(c)
    assert c.observe(1.0, reports(NodeState.RUNNING)) == []
    [finish] = c.observe(2.0, reports(NodeState.COMPLETED))
    assert finish == Finish(JobPhase.SUCCEEDED, "all ranks completed")
    assert c.phase is JobPhase.SUCCEEDED
    kinds = [e.kind for e in c.drain_events()]
    assert kinds == [
        "JobStarted",
        "NodesLaunching",
        "AttemptStarted",
        "AttemptEnded",
        "JobSucceeded",
    ]


def test_one_node_completed_is_not_yet_success() -> None:
    c = make()
    h.begin(c)
    completed = h.report("node-0", NodeState.COMPLETED, 0)
    assert c.observe(1.0, reports(NodeState.RUNNING, **{"node-0": completed})) == []


def test_reports_about_an_older_attempt_are_ignored() -> None:
    c = make(max_restarts=1)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    c.observe(2.0, reports(NodeState.STOPPED))  # attempt 1 starts
    # agents still say "faulted"/"completed" about attempt 0: neither a fault nor success
    assert c.observe(3.0, reports(NodeState.COMPLETED, attempt=0, **{"node-1": crashed()})) == []
    assert c.phase is JobPhase.RUNNING


def test_a_crash_stops_every_node_at_once() -> None:
    c = make(max_restarts=1)
    h.begin(c)
    [stop] = c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    assert isinstance(stop, StopNodes)
    assert stop.node_ids == NODES
    assert stop.mode == "process"
    fault = c.current.faults[0] if c.current else None
    assert fault is not None and fault.rank == 3 and fault.node == "node-1"
    assert fault.evidence["signal"] == "SIGKILL"


def test_restart_after_all_stopped_with_a_new_attempt_and_endpoint() -> None:
    c = make(max_restarts=1)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    assert c.observe(1.5, reports(NodeState.STOPPING)) == []
    # A faulted node counts as stopped once none of its workers runs.
    assert c.observe(1.8, reports(NodeState.STOPPED, **{"node-1": crashed()})) == []
    [start] = c.observe(2.0, reports(NodeState.STOPPED, **{"node-1": crashed(peers="stopped")}))
    assert isinstance(start, StartNodes)
    assert start.attempt == 1
    assert {a.restart_count for a in start.assignments} == {1}
    assert {a.master_port for a in start.assignments} == {30001}
    assert c.restarts == 1
    [finish] = c.observe(3.0, reports(NodeState.COMPLETED, attempt=1))
    assert finish.phase is JobPhase.SUCCEEDED  # type: ignore[union-attr]


def test_budget_exhausted_fails_with_the_cause() -> None:
    c = make(max_restarts=0)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    [finish] = c.observe(2.0, reports(NodeState.STOPPED))
    assert isinstance(finish, Finish)
    assert finish.phase is JobPhase.FAILED
    assert "rank 3 exited with signal SIGKILL" in finish.reason
    assert "jobMaxRetryCount=0" in finish.reason


def test_exit_code_failure_is_described() -> None:
    c = make()
    h.begin(c)
    bad = h.crashed("node-0", 1, exitcode=3, signal=None, reason=None)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-0": bad}))
    [finish] = c.observe(2.0, reports(NodeState.STOPPED))
    assert "rank 1 exited with exit code 3" in finish.reason  # type: ignore[union-attr]


def test_lost_node_gets_a_full_job_restart() -> None:
    c = make(max_restarts=3)
    h.begin(c)
    [stop] = c.observe(1.0, reports(NodeState.RUNNING, **{"node-0": h.lost("node-0")}))
    assert isinstance(stop, StopNodes)
    [launch] = c.observe(2.0, reports(NodeState.STOPPED, **{"node-0": h.lost("node-0")}))
    assert launch == LaunchNodes(NODES, 1)  # every node's agent is replaced
    assert c.attempts[0].faults[0].message == ("node-0 lost: its agent process exited with code -9")
    [start] = c.observe(3.0, h.ready(NODES))
    assert isinstance(start, StartNodes) and start.scope == "job"


def test_a_node_lost_while_stopping_gets_the_full_restart_at_once() -> None:
    # Its worker's death is reported first, then its agent (the machine) is gone.
    c = make(max_restarts=3)
    h.begin(c)
    [stop] = c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    assert isinstance(stop, StopNodes)
    [launch] = c.observe(2.0, reports(NodeState.STOPPED, **{"node-1": h.lost("node-1")}))
    assert isinstance(launch, LaunchNodes)  # not a process-level restart first
    assert [f.type for f in c.attempts[0].faults] == ["WorkerCrash", "NodeLost"]


def test_a_node_that_never_takes_the_attempt_is_lost_after_the_start_timeout() -> None:
    c = make(max_restarts=0, node_start_timeout=30.0)
    h.begin(c)
    idle = h.report("node-1", NodeState.READY, None)  # its /start never arrived
    assert c.observe(29.0, reports(NodeState.RUNNING, **{"node-1": idle})) == []
    [stop] = c.observe(30.0, reports(NodeState.RUNNING, **{"node-1": idle}))
    assert isinstance(stop, StopNodes)
    fault = c.attempts[0].faults[0]
    assert (fault.type, fault.node) == ("NodeLost", "node-1")
    assert fault.message == "node-1 did not take attempt 0 within 30s"


def test_lost_node_without_budget_fails() -> None:
    c = make(max_restarts=0)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-0": h.lost("node-0")}))
    [finish] = c.observe(2.0, reports(NodeState.STOPPED, **{"node-0": h.lost("node-0")}))
    assert finish.phase is JobPhase.FAILED  # type: ignore[union-attr]
    assert "node-0 lost" in finish.reason  # type: ignore[union-attr]


def test_stop_timeout_is_a_fault() -> None:
    c = make(max_restarts=3)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    assert c.observe(5.0, reports(NodeState.STOPPING)) == []  # the first look after the stop
    assert c.observe(14.0, reports(NodeState.STOPPING)) == []
    [launch] = c.observe(15.0, reports(NodeState.STOPPING))  # 5 + 0 grace + 10 slack passed
    assert isinstance(launch, LaunchNodes)  # its agent is replaced: a full job restart
    assert any(f.type == "NodeStopTimeout" for f in c.attempts[0].faults)


def test_cancel_stops_gracefully_then_finishes_stopped() -> None:
    c = make(max_restarts=5)
    h.begin(c)
    [stop] = c.cancel(1.0, "deleted by user")
    assert isinstance(stop, StopNodes) and stop.mode == "graceful" and stop.timeout == 5
    assert c.cancel(1.1, "again") == []
    assert c.phase is JobPhase.STOPPING
    [finish] = c.observe(2.0, reports(NodeState.STOPPED))
    assert finish == Finish(JobPhase.STOPPED, "deleted by user")


def test_cancel_during_a_fault_stop_does_not_restart() -> None:
    c = make(max_restarts=5)
    h.begin(c)
    c.observe(1.0, reports(NodeState.RUNNING, **{"node-1": crashed()}))
    assert c.cancel(1.5, "interrupted (Ctrl-C)") == []
    [finish] = c.observe(2.0, reports(NodeState.STOPPED))
    assert finish == Finish(JobPhase.STOPPED, "interrupted (Ctrl-C)")


def test_active_deadline_fails_the_job() -> None:
    c = make(active_deadline_seconds=10.0)
    h.begin(c)
    assert c.observe(5.0, reports(NodeState.RUNNING)) == []
    [stop] = c.observe(11.0, reports(NodeState.RUNNING))
    assert isinstance(stop, StopNodes)
    [finish] = c.observe(12.0, reports(NodeState.STOPPED))
    assert finish.phase is JobPhase.FAILED  # type: ignore[union-attr]
    assert "DeadlineExceeded" in finish.reason  # type: ignore[union-attr]


def test_nothing_happens_after_the_end() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, reports(NodeState.COMPLETED))
    assert c.observe(2.0, reports(NodeState.FAULTED)) == []
    assert c.cancel(3.0, "late") == []


def test_a_workers_event_is_on_the_node_that_runs_its_rank() -> None:
    """Agents on one host share the attempt's event directory, so node-0 reports rank 2's
    event too (friction: describe's events put ranks 2 and 3 on node-0)."""
    c = make()
    h.begin(c)
    c.drain_events()
    restored = [
        h.WorkerEvent(rank=r, seq=1, time=0.5, kind="CheckpointRestored", message=f"rank {r}")
        for r in (0, 2)
    ]
    both = {n: h.report(n, workers=h.workers(i), events=restored) for i, n in enumerate(NODES)}
    c.observe(1.0, both)
    events = [(e.rank, e.node) for e in c.drain_events() if e.kind == "CheckpointRestored"]
    assert events == [(0, "node-0"), (2, "node-1")]
