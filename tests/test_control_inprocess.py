"""In-process restarts in the controller: when survivors keep their processes, and when not;
stuck survivors and the restart barrier, decided from the ranks' reported joins."""

from __future__ import annotations

import control_helpers as h
from trainguard.control.actions import JobPhase, RejoinNodes, ReplaceRanks, StartNodes, StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.attempt import Rejoining
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.events import FaultType
from trainguard.control.inprocess import hot_spares_per_node
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState, Refusal
from trainguard.wire.control_files import EXIT_BARRIER_TIMEOUT
from trainguard.wire.status import WorkerState, WorkerStatus

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
        stuck_rank_timeout=3.0,
        **kw,
    )  # type: ignore[arg-type]
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def joined(attempt: int, node: str, left: int | None = None, **replace: int) -> NodeReport:
    """``node``'s ranks all running and acknowledged ``attempt`` (``r3=0``: rank 3 joined
    only attempt 0, i.e. not this one)."""
    node_rank = NODES.index(node)
    workers = []
    for w in h.workers(node_rank):
        ack = replace.get(f"r{w.rank}", attempt)
        workers.append(w.model_copy(update={"joined": ack, "left": left}))
    return h.report(node, NodeState.RUNNING, attempt, workers=workers)


def running(attempt: int, node: str = "node-0") -> NodeReport:
    return joined(attempt, node)


def crashed(attempt: int, node: str = "node-1", rank: int = 3, exitcode: int = -9) -> NodeReport:
    return h.crashed(
        node, rank, attempt, exitcode=exitcode, signal="SIGKILL" if exitcode < 0 else None
    )


def test_assignments_carry_the_in_process_settings_and_spread_the_spares() -> None:
    c = make(hot_spares=3)
    start = h.begin(c)
    assert [(a.in_process, a.hot_spares, a.barrier_timeout) for a in start.assignments] == [
        (True, 2, 30.0),
        (True, 1, 30.0),
    ]
    assert hot_spares_per_node(5, 3) == [2, 2, 1]


def test_a_worker_crash_restarts_in_place_on_the_store_rank_0_serves() -> None:
    """Rank 0 survives: the attempt keeps its rendezvous (rank 0's process serves the
    store; a new port would have to be bound, and could be taken by then)."""
    c = make()
    h.begin(c)
    [action] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(action, RejoinNodes)
    assert action.attempt == 1
    assert {a.master_port for a in action.assignments} == {30000}
    assert [a.node_id for a in action.assignments] == list(NODES)
    assert c.phase is JobPhase.RUNNING and c.restarts == 1
    assert c.attempts[0].phase.value == "Failed"
    scheduled = [e for e in c.drain_events() if e.kind == "RestartScheduled"]
    assert scheduled[0].data["scope"] == "in-process"
    # The timeline names the scope; the next attempt's reports are about attempt 1.
    assert c.timeline.to_json()[0]["scope"] == "in-process"
    assert c.observe(2.0, {"node-0": running(1), "node-1": running(1, "node-1")}) == []
    assert c.current is not None and not isinstance(
        c.current.activity, Rejoining
    )  # every rank joined


def test_a_crash_of_rank_0_restarts_in_place_on_a_new_rendezvous() -> None:
    """Rank 0's process is replaced: its store went with it, the new one binds anew."""
    c = make()
    h.begin(c)
    dead = crashed(0, node="node-0", rank=0)
    [action] = c.observe(1.0, {"node-0": dead, "node-1": running(0, "node-1")})
    assert isinstance(action, RejoinNodes)
    assert {a.master_port for a in action.assignments} == {30001}


def test_a_survivor_stuck_in_the_failed_attempt_gets_a_new_process_once() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    # Rank 2 neither left attempt 0 nor joined attempt 1; rank 3 (the dead one) is being
    # replaced; node-0's ranks joined.
    stuck = {"node-0": running(1), "node-1": joined(1, "node-1", r2=0, r3=0)}
    assert c.observe(3.5, stuck) == []  # within stuck_rank_timeout
    [replace] = c.observe(4.5, stuck)
    assert replace == ReplaceRanks(1, "node-1", (2,))
    assert c.observe(5.0, stuck) == []  # once
    events = [e for e in c.drain_events() if e.kind == "StuckRanksReplaced"]
    assert "rank 2 did not leave attempt 0 within 3 s" in events[0].message
    # A survivor that left the failed attempt and waits to join is not stuck.
    c2 = make()
    h.begin(c2)
    c2.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    waiting = {"node-0": running(1), "node-1": joined(1, "node-1", left=0, r2=0, r3=0)}
    assert c2.observe(4.5, waiting) == []


def test_a_rank_that_missed_the_barrier_falls_back_to_a_process_level_restart() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    late = {"node-0": running(1), "node-1": joined(1, "node-1", left=0, r3=0)}
    assert c.observe(30.5, late) == []
    [stop] = c.observe(31.5, late)  # 30 s barrier after the restart at 1.0
    assert isinstance(stop, StopNodes) and stop.attempt == 1
    fault = c.attempts[1].faults[0]
    assert fault.type is FaultType.BARRIER_MISSED and fault.rank == 3
    assert "rank 3 missed the restart barrier of attempt 1 within 30 s" in fault.message
    stopped = {n: h.report(n, NodeState.STOPPED, 1) for n in NODES}
    [start] = c.observe(32.0, stopped)
    assert isinstance(start, StartNodes) and start.scope == "process"


def test_a_worker_that_gave_up_the_barrier_exit_75_gets_a_process_level_restart() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    gave_up = crashed(1, rank=2, exitcode=EXIT_BARRIER_TIMEOUT)
    [stop] = c.observe(2.0, {"node-0": running(1), "node-1": gave_up})
    assert isinstance(stop, StopNodes)  # not another in-process restart
    fault = c.attempts[1].faults[0]
    assert fault.type is FaultType.BARRIER_GIVEN_UP and fault.rank == 2
    stopped = {n: h.report(n, NodeState.STOPPED, 1) for n in NODES}
    [start] = c.observe(3.0, stopped)
    assert isinstance(start, StartNodes) and start.scope == "process"


def test_a_second_crash_restarts_in_place_though_a_node_still_reports_the_last_attempt() -> None:
    c = make()
    h.begin(c)
    [first] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(first, RejoinNodes)
    # node-0 took the rejoin but was not polled since (it reports attempt 0); node-1's
    # replacement rank crashes at once.
    [second] = c.observe(1.2, {"node-0": running(0), "node-1": crashed(1, rank=3)})
    assert isinstance(second, RejoinNodes) and second.attempt == 2
    # A node that stopped (or completed) has no workers to rejoin.
    c2 = make()
    h.begin(c2)
    c2.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    done = h.report("node-0", NodeState.COMPLETED, 1)
    [stop] = c2.observe(1.2, {"node-0": done, "node-1": crashed(1, rank=3)})
    assert isinstance(stop, StopNodes)


def test_a_refused_rejoin_falls_back_to_a_process_level_restart() -> None:
    c = make()
    h.begin(c)
    c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    refused = Refusal("node-1", "rejoin", 1, "409 an in-process restart needs running workers")
    [stop] = c.observe(1.1, {"node-0": running(1), "node-1": running(1, "node-1")}, [refused])
    assert isinstance(stop, StopNodes)
    assert c.attempts[1].faults[0].type is FaultType.REJOIN_REFUSED


def test_hangs_and_lost_nodes_restart_processes_as_usual() -> None:
    c = make()
    h.begin(c)
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": h.lost("node-1")})
    assert isinstance(stop, StopNodes)
    assert c.attempts[0].faults[0].type is FaultType.NODE_LOST


def test_a_node_that_is_not_up_keeps_a_crash_from_restarting_in_place() -> None:
    c = make(unreachable_after=3)
    h.begin(c)
    silent = NodeReport("node-0", running(0).status, failed_contacts=1)  # evidence, still up
    [action] = c.observe(1.0, {"node-0": silent, "node-1": crashed(0)})
    assert isinstance(action, RejoinNodes)
    c2 = make(unreachable_after=1)
    h.begin(c2)
    [stop] = c2.observe(1.0, {"node-0": silent, "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)  # node-0 is lost: a full restart follows


def test_a_node_silent_for_less_than_lost_after_is_up_for_an_in_place_restart() -> None:
    # Across hosts (lost_after 8 s): 3 failed contacts over 2 s of silence are evidence;
    # the controller holds node-0 up, and so does the in-place eligibility.
    c = make(unreachable_after=3, lost_after=8.0)
    h.begin(c)
    quiet = NodeReport("node-0", running(0).status, failed_contacts=3, silent_for=2.0)
    [action] = c.observe(1.0, {"node-0": quiet, "node-1": crashed(0)})
    assert isinstance(action, RejoinNodes)
    c2 = make(unreachable_after=3, lost_after=8.0)
    h.begin(c2)
    silent = NodeReport("node-0", running(0).status, failed_contacts=3, silent_for=8.5)
    [stop] = c2.observe(1.0, {"node-0": silent, "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)
    assert FaultType.NODE_LOST in {f.type for f in c2.attempts[0].faults}


def test_without_budget_a_crash_stops_the_job() -> None:
    c = make(max_restarts=0)
    h.begin(c)
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)


def test_off_by_default() -> None:
    config = ControlConfig("job", NODES, 2, policy=PolicyConfig.from_spec(None, 3))
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    start = h.begin(c)
    assert not start.assignments[0].in_process
    [stop] = c.observe(1.0, {"node-0": running(0), "node-1": crashed(0)})
    assert isinstance(stop, StopNodes)


def test_worker_statuses_carry_the_join_facts() -> None:
    w = WorkerStatus(local_rank=0, rank=0, state=WorkerState.RUNNING, joined=2, left=1)
    assert WorkerStatus.from_json(w.to_json()) == w
