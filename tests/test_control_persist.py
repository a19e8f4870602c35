"""Which step goes to durable storage: picked by the controller with every rank in view."""

from __future__ import annotations

import control_helpers as h
from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    ControlConfig,
    Finish,
    JobController,
    JobPhase,
    PersistCheckpoint,
)
from trainguard.control.persist import CheckpointPlanner, DurableCadence
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
    c = JobController(config, lambda attempt, node: Endpoint("127.0.0.1", 30000 + attempt))
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
