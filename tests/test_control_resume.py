"""Taking a job over from a dead controller (trainguard.control.resume), pure."""

from __future__ import annotations

import pytest

from test_control_recovery import NODES, crash, running, stopped
from trainguard.control.actions import AttemptPhase, Finish, JobPhase, LaunchNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.decision import NextAttempt
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.resume import Recorded, RecordedAttempt, adopt, restart

FAULT = {
    "type": "WorkerCrash", "time": 2.0, "attempt": 0, "node": "node-1", "rank": 3, "step": None,
    "message": "rank 3 exited with signal SIGKILL", "evidence": {}, "detected_at": 2.0,
    "fault_step": 50, "scope": "process", "recovered_at": 8.0, "resumed_step": 40,
}  # fmt: skip
RECORDED = Recorded(
    started_at=0.5,
    attempts=(
        RecordedAttempt(0, "Failed", 0.6, 3.0, "rank 3 died", StoreEndpoint("127.0.0.1", 1000)),
        RecordedAttempt(1, "Running", 3.1, None, None, StoreEndpoint("127.0.0.1", 2000)),
    ),
    restarts=(RestartRecord(3.0, RestartScope.PROCESS),),
    faults=(FAULT,),
)


def make() -> JobController:
    """A controller that has not started (as ``trainguard resume`` builds one)."""
    config = ControlConfig("job", NODES, 2, stop_grace_seconds=5, stop_slack_seconds=10)
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def test_adopt_takes_the_running_attempt_over_as_it_was() -> None:
    c = make()
    c.take_over(100.0, adopt(c.config, 100.0, RECORDED, NODES))
    assert c.phase is JobPhase.RUNNING and c.started_at == 0.5
    assert [a.phase for a in c.attempts] == [AttemptPhase.FAILED, AttemptPhase.RUNNING]
    current = c.attempts[-1]
    assert current.number == 1 and current.endpoint == StoreEndpoint("127.0.0.1", 2000)
    assert [list(a.global_ranks) for a in current.assignments] == [[0, 1], [2, 3]]
    assert all(a.master_port == 2000 for a in current.assignments)
    assert c.restarts == 1  # the budget spent so far is kept
    assert c.timeline.to_json()[0]["lost_steps"] == 10  # and the fault timeline
    assert [e.kind for e in c.drain_events()] == ["Resumed"]
    # It goes on like any attempt: progress, then a crash is a fault and stops all.
    assert c.observe(101.0, running(attempt=1, step=60, t=100.5)) == []
    c.observe(102.0, crash(1))
    [finish] = c.observe(103.0, stopped(1))  # the restart recorded before spent the budget
    assert isinstance(finish, Finish) and "jobMaxRetryCount=0, restarts=1" in finish.reason


def test_restart_starts_a_new_attempt_after_the_recorded_ones() -> None:
    c = make()
    [launch] = c.take_over(100.0, restart(c.config, 100.0, RECORDED, "the agent of node-0 is gone"))
    assert isinstance(launch, LaunchNodes) and launch.attempt == 2
    assert [a.phase for a in c.attempts[:2]] == [AttemptPhase.FAILED, AttemptPhase.FAILED]
    assert c.attempts[1].reason == "its controller died"
    assert c.restarts == 1  # a lost controller is not the job's fault: no restart counted
    kinds = [e.kind for e in c.drain_events()]
    assert kinds[0] == "Resumed" and "NodesLaunching" in kinds


def test_the_takeover_is_a_value_of_what_was_recorded() -> None:
    """adopt and restart are pure: literal records in, a Takeover out (no controller)."""
    cfg = ControlConfig("job", NODES, 2, spare_node_ids=("spare-0",))
    adopted = adopt(cfg, 100.0, RECORDED, NODES)
    assert (adopted.phase, adopted.started_at, adopted.next) == (JobPhase.RUNNING, 0.5, None)
    assert (adopted.nodes, adopted.spares, adopted.history) == (
        NODES,
        ("spare-0",),
        RECORDED.restarts,
    )
    ended, running_one = adopted.attempts
    assert (ended.number, ended.phase, ended.reason) == (0, AttemptPhase.FAILED, "rank 3 died")
    assert running_one.phase is AttemptPhase.RUNNING and running_one.recovered
    assert running_one.endpoint == StoreEndpoint("127.0.0.1", 2000)
    assert adopted.faults[0].fault_step == 50 and adopted.faults[0].fault.rank == 3
    assert adopted.event.attempt == 1 and adopted.event.data == {
        "mode": "reattach",
        "nodes": list(NODES),
    }

    restarted = restart(cfg, 100.0, RECORDED, "the agents are gone")
    assert restarted.phase is JobPhase.PENDING
    assert restarted.next == NextAttempt(RestartScope.JOB, NODES)  # every node on a fresh agent
    assert [(a.number, a.phase) for a in restarted.attempts] == [
        (0, AttemptPhase.FAILED),
        (1, AttemptPhase.FAILED),  # it was running when its controller died
    ]
    assert restarted.attempts[1].reason == "its controller died"
    assert "the agents are gone" in restarted.event.message
    # An elastic job restarts at the size it had, its ids left to grow onto without it.
    elastic = Recorded(0.5, RECORDED.attempts, nodes=("node-1",), growth=("node-1", "node-7"))
    shrunk = restart(cfg, 100.0, elastic, "gone")
    assert (shrunk.nodes, shrunk.growth, shrunk.next) == (
        ("node-1",),
        ("node-7",),
        NextAttempt(RestartScope.JOB, ("node-1",)),
    )


def test_nothing_to_adopt_and_a_started_job_are_refused() -> None:
    cfg = ControlConfig("job", NODES, 2)
    with pytest.raises(ValueError, match="no recorded attempt"):
        adopt(cfg, 1.0, Recorded(0.5, ()), NODES)
    c = make()
    c.start(0.0)
    with pytest.raises(RuntimeError, match="already started"):
        c.take_over(1.0, restart(c.config, 1.0, RECORDED, "gone"))
