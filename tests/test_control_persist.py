"""Which step goes to durable storage: picked by the controller with every rank in view."""

from __future__ import annotations

import control_helpers as h
from trainguard.control.actions import Finish, JobPhase
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.persist import CheckpointPlanner, DurableCadence, PersistCheckpoint
from trainguard.control.reports import NodeReport, NodeState, Refusal
from trainguard.wire.status import CheckpointStatus, MemoryStep, WorkerState

NODES = ("node-0", "node-1")  # x 2 ranks: node-0 has ranks 0, 1; node-1 has 2, 3


def node(
    node_id: str,
    steps: dict[int, tuple[int, ...]],
    *,
    state: NodeState = NodeState.RUNNING,
    forced: tuple[int, ...] = (),
    committed: tuple[int, ...] = (),
    failed: dict[int, str] | None = None,
) -> NodeReport:
    checkpoint = CheckpointStatus(
        memory_steps={s: MemoryStep(ranks=r, force=s in forced) for s, r in steps.items()},
        committed=committed,
        failed=failed or {},
    )
    done = state is NodeState.COMPLETED
    workers = h.workers(
        NODES.index(node_id), WorkerState.SUCCEEDED if done else WorkerState.RUNNING
    )
    return h.report(node_id, state, 0, checkpoint=checkpoint, workers=workers)


def both(steps: list[int], **kw: object) -> dict[str, NodeReport]:
    """Every rank holds every step in ``steps``."""
    return {
        "node-0": node("node-0", {s: (0, 1) for s in steps}, **kw),  # type: ignore[arg-type]
        "node-1": node("node-1", {s: (2, 3) for s in steps}),
    }


def planner(**cadence: object) -> CheckpointPlanner:
    return CheckpointPlanner(DurableCadence(**cadence), 4, started_at=0.0)  # type: ignore[arg-type]


def test_every_steps_persists_the_newest_complete_multiple_on_every_node() -> None:
    p = planner(every_steps=10)
    assert p.observe(1.0, NODES, both([8, 9]))[0] == []
    # Step 20 is on node-0 only: not complete, so 10 is the newest due step.
    reports = both([10, 11])
    reports["node-0"] = node("node-0", {10: (0, 1), 11: (0, 1), 20: (0, 1)})
    [request], _ = p.observe(2.0, NODES, reports)
    assert request == PersistCheckpoint(10, 4, NODES, "node-0")
    assert p.busy
    assert p.observe(3.0, NODES, both([20]))[0] == [], "one step in flight at a time"


def test_every_seconds_asks_for_the_newest_step_every_rank_holds() -> None:
    p = planner(every_seconds=30.0)
    assert p.observe(10.0, NODES, both([5]))[0] == []
    # The agents persist the first step >= 8 their ranks hold (held for them in memory).
    [first], _ = p.observe(31.0, NODES, both([7, 8]))
    assert first.step == 8
    assert p.observe(31.5, NODES, both([9]))[0] == [] and p.busy
    _, notes = p.observe(32.0, NODES, both([9, 10], committed=(8,)))
    assert [n.kind for n in notes] == ["CheckpointCommitted"] and not p.busy
    assert p.observe(50.0, NODES, both([12]))[0] == [], "30 s since the last request"
    [second], _ = p.observe(61.5, NODES, both([13, 14]))
    assert second.step == 14


def test_every_seconds_persists_the_newest_step_when_the_ranks_save_no_more() -> None:
    """Regression: the request named the step after the newest complete one (101), which
    no rank saved within the agents' 120 s; step 100, in memory all along, was never
    persisted. It names step 100 now, and nothing until a newer step is complete."""
    p = planner(every_seconds=30.0)
    [request], _ = p.observe(31.0, NODES, both([99, 100]))
    assert request.step == 100
    _, notes = p.observe(32.0, NODES, both([99, 100], committed=(100,)))
    assert [n.kind for n in notes] == ["CheckpointCommitted"] and not p.busy
    assert p.observe(90.0, NODES, both([99, 100]))[0] == [], "nothing newer to persist"
    [later], _ = p.observe(95.0, NODES, both([100, 101]))
    assert later.step == 101, "the first newer step once the period has passed"


def test_a_forced_save_is_persisted_at_once() -> None:
    p = planner(every_seconds=3600.0)
    [request], _ = p.observe(1.0, NODES, both([3, 4], forced=(3,)))
    assert request.step == 3


def test_a_failed_step_is_reported_and_a_newer_one_is_picked() -> None:
    p = planner(every_steps=5)
    assert len(p.observe(1.0, NODES, both([5]))[0]) == 1
    _, notes = p.observe(2.0, NODES, both([5, 6], failed={5: "overwritten in memory"}))
    assert [n.kind for n in notes] == ["CheckpointPersistFailed"]
    assert "overwritten" in notes[0].message and not p.busy
    assert p.observe(3.0, NODES, both([5, 6]))[0] == [], "a failed step is not retried"
    [again], _ = p.observe(4.0, NODES, both([10]))
    assert again.step == 10


def test_a_request_that_never_settles_times_out() -> None:
    p = planner(every_steps=5, request_timeout=60.0)
    p.observe(1.0, NODES, both([5]))
    _, notes = p.observe(62.0, NODES, both([5]))
    assert notes[0].kind == "CheckpointPersistFailed" and "60 s" in notes[0].message


def replaced(report: NodeReport, incarnation: str) -> NodeReport:
    """``report`` as a new agent of the same node (a killed agent's successor) gives it."""
    assert report.status is not None
    return NodeReport(report.node_id, report.status.model_copy(update={"incarnation": incarnation}))


def test_a_persist_whose_agent_was_killed_fails_and_is_asked_for_again() -> None:
    """Regression (issue 38): node-1's agent was SIGKILLed while step 100 persisted. Its
    successor knew nothing of the request, so the step was never committed, and the
    planner, waiting on it, asked for no other step: the job trained on to step 400 with
    step 100 its newest durable step, and ended without a word."""
    p = planner(every_steps=20)
    [first], _ = p.observe(1.0, NODES, both([99, 100]))
    assert first.step == 100
    restarted = both([100, 101])  # the job restored step 100 from memory
    restarted["node-1"] = replaced(restarted["node-1"], "node-1-agent-2")
    [again], notes = p.observe(5.0, NODES, restarted)
    assert [n.kind for n in notes] == ["CheckpointPersistFailed", "CheckpointPersisting"]
    assert "node-1's agent was replaced" in notes[0].message
    assert again.step == 100 and notes[1].data["retry"] is True
    _, notes = p.observe(6.0, NODES, both([100, 101], committed=(100,)))
    assert [n.kind for n in notes] == ["CheckpointCommitted"] and not p.busy
    [later], _ = p.observe(7.0, NODES, both([119, 120]))
    assert later.step == 120, "the schedule goes on"


def test_a_persist_whose_node_is_lost_or_leaves_the_job_fails_at_once() -> None:
    p = planner(every_steps=10)
    p.observe(1.0, NODES, both([10]))
    reports = both([10])
    reports["node-1"] = h.lost("node-1")
    _, notes = p.observe(2.0, NODES, reports)
    assert "node-1 was lost while persisting it" in notes[0].message and not p.busy
    # A spare took node-1's ranks: the request went to node-1, which is no longer asked.
    [retry], _ = p.observe(3.0, NODES, both([10]))
    assert retry.step == 10
    spare = {"node-0": both([10])["node-0"], "node-2": node("node-1", {10: (2, 3)})}
    _, notes = p.observe(4.0, ("node-0", "node-2"), spare)
    assert "node-1 left the job" in notes[0].message
    # A full job restart relaunches every agent.
    p.observe(5.0, NODES, both([10]))
    restarted = {n: replaced(r, f"{n}-b") for n, r in both([10]).items()}
    _, notes = p.observe(6.0, NODES, restarted)
    assert "the agents of node-0, node-1 were replaced" in notes[0].message


def test_an_earlier_tries_failure_does_not_fail_the_retry() -> None:
    p = planner(every_steps=10)
    p.observe(1.0, NODES, both([10]))
    reports = both([10], failed={10: "step 10: not every rank's shard reached the tier"})
    reports["node-1"] = replaced(reports["node-1"], "node-1-agent-2")
    [retry], _ = p.observe(2.0, NODES, reports)  # node-0's failure came with the loss
    assert retry.step == 10
    assert p.observe(3.0, NODES, reports) == ([], []), "still in flight"
    reports["node-1"] = replaced(
        node("node-1", {10: (2, 3)}, failed={10: "no checksum"}), "node-1-agent-2"
    )
    _, notes = p.observe(4.0, NODES, reports)
    assert "node-1: no checksum" in notes[0].message


def test_after_a_failure_the_newest_step_is_asked_for_after_a_back_off() -> None:
    p = planner(every_seconds=600.0, retry_after=5.0)
    [first], _ = p.observe(601.0, NODES, both([7]))
    assert first.step == 7
    _, notes = p.observe(602.0, NODES, both([7, 8], failed={7: "unreachable storage"}))
    assert notes[0].kind == "CheckpointPersistFailed"
    assert p.observe(603.0, NODES, both([8]))[0] == [], "backing off"
    [retry], _ = p.observe(607.5, NODES, both([8, 9]))
    assert retry.step == 9, "the newest step every rank holds, not the next period's"
    p.observe(608.0, NODES, both([9, 10], failed={9: "unreachable storage"}))
    assert p.observe(615.0, NODES, both([10]))[0] == [], "twice as long after two in a row"
    assert p.observe(618.5, NODES, both([10]))[0] != []


def test_the_newest_step_asked_for_and_not_durable_is_a_shortfall() -> None:
    p = planner(every_steps=10)
    assert p.shortfall() is None, "nothing asked"
    p.observe(1.0, NODES, both([10]))
    p.observe(2.0, NODES, both([10], committed=(10,)))
    assert p.shortfall() is None
    p.observe(3.0, NODES, both([20]))
    note = p.shortfall()
    assert note is not None and note.kind == "CheckpointNotDurable"
    assert note.data == {"step": 20, "durable_step": 10}
    assert "newest durable step is 10" in note.message


def test_memory_saves_are_events_at_most_every_interval() -> None:
    p = CheckpointPlanner(None, 4, started_at=0.0, memory_event_interval=10.0)
    kinds = []
    for t, step in [(1.0, 1), (2.0, 2), (12.0, 3), (13.0, 4)]:
        requests, notes = p.observe(t, NODES, both([step]))
        assert requests == [], "no durable tier: nothing to persist"
        kinds += [(n.kind, n.data["step"]) for n in notes]
    assert kinds == [("CheckpointSaved", 1), ("CheckpointSaved", 3)]


def test_unreachable_nodes_do_not_count() -> None:
    p = planner(every_steps=5)
    reports = both([5])
    reports["node-1"] = h.lost("node-1")
    assert p.observe(1.0, NODES, reports)[0] == []


# -- in the controller --------------------------------------------------------------------


def controller(**cadence: object) -> JobController:
    config = ControlConfig(
        "job", NODES, 2, durable=DurableCadence(**cadence), final_persist_timeout=30.0
    )  # type: ignore[arg-type]
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    return c


def test_the_controller_asks_for_due_steps_and_records_the_commit() -> None:
    c = controller(every_steps=10)
    [request] = c.observe(1.0, both([10]))
    assert isinstance(request, PersistCheckpoint) and request.step == 10
    assert c.observe(2.0, both([10, 11], committed=(10,))) == []
    kinds = [e.kind for e in c.drain_events()]
    assert kinds.count("CheckpointPersisting") == 1 and "CheckpointCommitted" in kinds


def test_a_refused_persist_fails_the_step_at_once() -> None:
    c = controller(every_steps=10)
    [request] = c.observe(1.0, both([10]))
    assert isinstance(request, PersistCheckpoint)
    refused = Refusal("node-1", "persist", None, "409 this node has no durable tier")
    assert c.observe(2.0, both([10, 11]), [refused]) == []
    failed = [e for e in c.drain_events() if e.kind == "CheckpointPersistFailed"]
    assert "node-1 refused it" in failed[0].message
    assert not c.checkpoints.busy


def test_success_waits_for_the_final_step_to_be_durable() -> None:
    c = controller(every_steps=10)
    done = both([39, 40], state=NodeState.COMPLETED)
    done["node-1"] = node("node-1", {39: (2, 3), 40: (2, 3)}, state=NodeState.COMPLETED)
    [final] = c.observe(1.0, done)
    assert isinstance(final, PersistCheckpoint) and final.step == 40
    assert c.observe(2.0, done) == [] and c.phase is JobPhase.RUNNING
    committed = both([39, 40], state=NodeState.COMPLETED, committed=(40,))
    committed["node-1"] = node("node-1", {40: (2, 3)}, state=NodeState.COMPLETED)
    [finish] = c.observe(3.0, committed)
    assert isinstance(finish, Finish) and c.phase is JobPhase.SUCCEEDED


def test_success_waits_for_the_final_step_a_timed_request_already_asked_for() -> None:
    c = controller(every_seconds=1.0)
    [timed] = c.observe(2.0, both([7]))
    assert isinstance(timed, PersistCheckpoint) and timed.step == 7
    done = both([7], state=NodeState.COMPLETED)  # the job ended with step 7 its newest
    done["node-1"] = node("node-1", {7: (2, 3)}, state=NodeState.COMPLETED)
    assert c.observe(3.0, done) == [], "the request in flight is for the final step"
    committed = both([7], state=NodeState.COMPLETED, committed=(7,))
    committed["node-1"] = node("node-1", {7: (2, 3)}, state=NodeState.COMPLETED)
    [finish] = c.observe(4.0, committed)
    assert isinstance(finish, Finish) and c.phase is JobPhase.SUCCEEDED


def test_success_does_not_wait_forever_for_the_final_step() -> None:
    c = controller(every_steps=10)
    done = both([40], state=NodeState.COMPLETED)
    done["node-1"] = node("node-1", {40: (2, 3)}, state=NodeState.COMPLETED)
    assert isinstance(c.observe(1.0, done)[0], PersistCheckpoint)
    assert c.observe(20.0, done) == []
    [finish] = c.observe(32.0, done)
    assert isinstance(finish, Finish) and c.phase is JobPhase.SUCCEEDED


def test_a_job_whose_persist_was_lost_ends_saying_its_final_step_is_not_durable() -> None:
    """Issue 38 at the controller: the persist of step 100 lost with node-1's agent, the
    job ran to step 400 and succeeded. Its final step is asked for once the lost request
    has failed, and when it never becomes durable the end says so."""
    c = controller(every_steps=20)
    [request] = c.observe(1.0, both([100]))
    assert isinstance(request, PersistCheckpoint) and request.step == 100
    done = both([399, 400], state=NodeState.COMPLETED)
    done["node-1"] = replaced(
        node("node-1", {399: (2, 3), 400: (2, 3)}, state=NodeState.COMPLETED), "node-1-b"
    )
    [final] = c.observe(2.0, done)
    assert isinstance(final, PersistCheckpoint) and final.step == 400
    assert c.observe(20.0, done) == [] and c.phase is JobPhase.RUNNING
    [finish] = c.observe(33.0, done)  # final_persist_timeout: 30 s
    assert isinstance(finish, Finish) and c.phase is JobPhase.SUCCEEDED
    events = [(e.kind, e.data.get("step")) for e in c.drain_events()]
    checkpoints = [e for e in events if e[0].startswith("CheckpointPersist") or "Not" in e[0]]
    assert checkpoints == [
        ("CheckpointPersisting", 100),
        ("CheckpointPersistFailed", 100),
        ("CheckpointPersisting", 400),
        ("CheckpointPersistFailed", 400),
        ("CheckpointNotDurable", 400),
    ]
    assert events[-2:] == [("AttemptEnded", None), ("JobSucceeded", None)]
