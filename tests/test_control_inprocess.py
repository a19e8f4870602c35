"""In-process restarts in the controller: when survivors keep their processes, and when not."""

from __future__ import annotations

from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    ControlConfig,
    JobController,
    JobPhase,
    RejoinNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.events import FaultType
from trainguard.control.policy import BARRIER_MISSED, PolicyConfig
from trainguard.control.reports import NodeReport, NodeState, WorkerFailure

NODES = ("node-0", "node-1")


def make(max_restarts: int = 3, hot_spares: int = 1, **kw: object) -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig.from_spec(None, max_restarts),
        in_process=True,
        hot_spares=hot_spares,
        barrier_timeout=30.0,
        **kw,
    )  # type: ignore[arg-type]
    return JobController(config, lambda attempt: Endpoint("127.0.0.1", 30000 + attempt))


def running(attempt: int, node: str = "node-0") -> NodeReport:
    return NodeReport(node, True, NodeState.RUNNING, attempt)


def crashed(
    attempt: int, node: str = "node-1", rank: int = 3, error: str | None = None
) -> NodeReport:
    failure = WorkerFailure(rank, rank % 2, -9, "SIGKILL", error)
    return NodeReport(node, True, NodeState.FAULTED, attempt, "rank died", (failure,))


def test_assignments_carry_the_in_process_settings_and_spread_the_spares() -> None:
    c = make(hot_spares=3)
    [start] = c.start(0.0)
    assert isinstance(start, StartNodes)
    assert [(a.in_process, a.hot_spares, a.barrier_timeout) for a in start.assignments] == [
        (True, 2, 30.0),
        (True, 1, 30.0),
    ]


def test_a_worker_crash_restarts_in_place_with_a_new_rendezvous() -> None:
    c = make()
    c.start(0.0)
    [action] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(action, RejoinNodes)
    assert action.attempt == 1
    assert {a.master_port for a in action.assignments} == {30001}
    assert [a.node_id for a in action.assignments] == list(NODES)
    assert c.phase is JobPhase.RUNNING and c.restarts == 1
    assert c.attempts[0].phase.value == "Failed"
    scheduled = [e for e in c.drain_events() if e.kind == "RestartScheduled"]
    assert scheduled[0].data["scope"] == "in-process"
    # The timeline names the scope; the next attempt's reports are about attempt 1.
    assert c.timeline.to_json()[0]["scope"] == "in-process"
    assert c.observe(2.0, {"node-0": running(1), "node-1": running(1, "node-1")}) == []


def test_a_rank_that_missed_the_barrier_falls_back_to_a_process_level_restart() -> None:
    c = make()
    c.start(0.0)
    c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    late = crashed(1, error=f"rank 3 {BARRIER_MISSED} of attempt 1 within 30 s")
    [stop] = c.observe(40.0, {"node-0": running(1), "node-1": late})
    assert isinstance(stop, StopNodes) and stop.attempt == 1
    stopped = {n: NodeReport(n, True, NodeState.STOPPED, 1) for n in NODES}
    [start] = c.observe(41.0, stopped)
    assert isinstance(start, StartNodes) and start.scope == "process"


def test_hangs_and_lost_nodes_restart_processes_as_usual() -> None:
    c = make()
    c.start(0.0)
    lost = NodeReport("node-1", False)
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": lost})
    assert isinstance(stop, StopNodes)
    assert c.attempts[0].faults[0].type is FaultType.NODE_LOST


def test_without_budget_a_crash_stops_the_job() -> None:
    c = make(max_restarts=0)
    c.start(0.0)
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)


def test_off_by_default() -> None:
    config = ControlConfig("job", NODES, 2, policy=PolicyConfig.from_spec(None, 3))
    c = JobController(config, lambda attempt: Endpoint("127.0.0.1", 30000 + attempt))
    [start] = c.start(0.0)
    assert isinstance(start, StartNodes) and not start.assignments[0].in_process
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)
