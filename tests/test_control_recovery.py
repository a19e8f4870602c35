"""The controller's detection, escalation and timeline, driven by plain reports."""

from math import nan

import control_helpers as h
from trainguard.control.actions import Finish, LaunchNodes, RetireNodes, StartNodes, StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.events import Event, Fault, FaultType
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport, NodeState
from trainguard.control.timeline import Timeline, left_at, resume_point
from trainguard.monitor.rules import LogRuleSpec
from trainguard.wire.status import Detection, Progress, RuleActivity, WorkerEvent, WorkerState

NODES = ("node-0", "node-1")
HANG = LogRuleSpec("JobHang", ".*Loss:.*", expected_recurring_frequency_in_seconds=10)


def make(max_restarts: int = 3, spares: tuple[str, ...] = (), **kw: object) -> JobController:
    policy = PolicyConfig(
        job_max_retry_count=max_restarts,
        num_restart_before_full_job_restart=kw.pop("escalate_after", None),  # type: ignore[arg-type]
        eval_period_seconds=1000.0,
        max_full_job_restarts=None,
        max_num_repeat_offenders_to_avoid=1,
    )
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=policy,
        spare_node_ids=spares,
        stop_grace_seconds=5,
        stop_slack_seconds=10,
        **kw,
    )  # type: ignore[arg-type]
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    return c


def running(
    attempt: int = 0,
    step: int | None = None,
    t: float = 0.0,
    first: int | None = None,
    **extra: object,
) -> dict[str, NodeReport]:
    progress = None
    if step is not None:
        first_step = first if first is not None else step
        progress = Progress(first_step=first_step, first_time=t, step=step, time=t)
    return {
        "node-0": h.report(
            "node-0", NodeState.RUNNING, attempt, workers=h.workers(0), progress=progress, **extra
        ),
        "node-1": h.report("node-1", NodeState.RUNNING, attempt, workers=h.workers(1)),
    }


def stopped(attempt: int = 0, **extra: object) -> dict[str, NodeReport]:
    return {
        n: h.report(
            n, NodeState.STOPPED, attempt, workers=h.workers(i, WorkerState.STOPPED), **extra
        )
        for i, n in enumerate(NODES)
    }


def crash(attempt: int = 0, node: str = "node-1") -> dict[str, NodeReport]:
    reports = running(attempt)
    reports[node] = h.crashed(node, 3 if node == "node-1" else 1, attempt)
    return reports


def test_slow_detection_from_an_agent_stops_all() -> None:
    c = make()
    d = Detection(
        kind="LogSlow", rule="Speed", rank=0, time=5.0,
        line="Batch 9 Speed: 10 samples/sec", value=10.0,
    )  # fmt: skip
    [stop] = c.observe(6.0, running(detections=(d,)))
    assert isinstance(stop, StopNodes) and not stop.capture_stacks
    fault = c.attempts[0].faults[0]
    assert fault.type is FaultType.LOG_SLOW and fault.rank == 0
    assert fault.message.startswith("LogSlow_Speed")
    # The same detection reported again is not a second fault.
    c2 = make()
    c2.observe(1.0, running())
    assert len(c2.attempts[0].faults) == 0


def test_nan_detection_is_its_own_fault_type() -> None:
    c = make()
    d = Detection(
        kind="NaNMetric", rule="Loss", rank=0, time=5.0, line="Batch 9 Loss: nan", value=nan
    )
    c.observe(6.0, running(detections=(d,)))
    assert c.attempts[0].faults[0].type is FaultType.NAN_METRIC


def test_job_wide_hang_is_detected_and_stacks_are_captured() -> None:
    c = make(log_rules=(HANG,))
    # node-0 matched at t=5; node-1 never logs (only rank 0 does): no hang while in time.
    activity = {"JobHang": RuleActivity(last_match_at=5.0)}
    assert c.observe(14.0, running(rules=activity)) == []
    [stop] = c.observe(16.0, running(rules=activity))
    assert isinstance(stop, StopNodes) and stop.capture_stacks and stop.mode == "process"
    fault = c.attempts[0].faults[0]
    assert fault.type is FaultType.LOG_HANG and "LogHang_JobHang" in fault.message
    # Stacks the agents captured while stopping are attached to the hang fault.
    stacks = {
        2: "pid 9 (python): state T (stopped), wchan do_signal_stop\nThread 1 (idle)",
        3: "pid 10 (python): state S (sleeping), wchan -\nThread 1 (active)",
    }
    [start] = c.observe(17.0, stopped(stacks=stacks))
    assert isinstance(start, StartNodes)  # process scope: the same agents, at once
    evidence = c.attempts[0].faults[0].evidence
    assert evidence["stacks"] == {str(k): v for k, v in stacks.items()}
    assert evidence["stopped_ranks"] == [2]
    assert c.timeline.records[0].fault.evidence["stopped_ranks"] == [2]


def test_stop_pattern_turns_the_hang_rule_off() -> None:
    c = make(log_rules=(HANG,))
    assert (
        c.observe(100.0, running(rules={"JobHang": RuleActivity(last_match_at=5.0, stopped=True)}))
        == []
    )


def test_heartbeat_timeout_names_the_rank() -> None:
    c = make(heartbeat_timeout=5.0)
    assert c.observe(3.0, running(heartbeats={1: 2.0})) == []
    [stop] = c.observe(8.0, running(heartbeats={1: 2.0}))
    assert isinstance(stop, StopNodes) and stop.capture_stacks
    fault = c.attempts[0].faults[0]
    assert fault.type is FaultType.HEARTBEAT_TIMEOUT and fault.rank == 1 and fault.node == "node-0"


def test_lost_node_gets_a_full_restart_on_a_spare() -> None:
    c = make(spares=("node-2",))
    reports = running()
    reports["node-1"] = h.lost("node-1")
    [stop] = c.observe(1.0, reports)
    assert isinstance(stop, StopNodes)
    after = stopped()
    after["node-1"] = h.lost("node-1")
    [retire, launch] = c.observe(2.0, after)
    assert retire == RetireNodes(("node-1",))  # replaced by the spare
    # Only node-1 was lost: node-0 may keep its live agent (its worker template warm).
    assert launch == LaunchNodes(("node-0", "node-2"), 1, keep=("node-0",))
    [start] = c.observe(3.0, h.ready(("node-0", "node-2")))
    assert isinstance(start, StartNodes)
    assert start.scope == "job"
    assert [a.node_id for a in start.assignments] == ["node-0", "node-2"]
    # node-2 runs node-1's ranks: it restores node-1's memory tier from its replica.
    assert [a.replica_source for a in start.assignments] == [None, "node-1"]
    assert c.spares == ()


def test_escalation_to_a_full_restart_after_process_restarts() -> None:
    c = make(max_restarts=5, escalate_after=2)
    scopes = []
    for attempt in range(3):
        c.observe(10.0 * attempt + 1, crash(attempt))
        [action] = c.observe(10.0 * attempt + 2, stopped(attempt))
        if isinstance(action, LaunchNodes):  # a full restart brings new agents up first
            [action] = c.observe(10.0 * attempt + 3, h.ready(NODES))
        assert isinstance(action, StartNodes)
        scopes.append(action.scope)
    assert scopes == ["process", "process", "job"]
    assert c.full_restarts == 1


def test_budget_exhausted_after_restarts() -> None:
    c = make(max_restarts=1)
    c.observe(1.0, crash(0))
    c.observe(2.0, stopped(0))
    c.observe(3.0, crash(1))
    [finish] = c.observe(4.0, stopped(1))
    assert isinstance(finish, Finish)
    assert "jobMaxRetryCount=1" in finish.reason


def test_timeline_measures_recovery_and_lost_steps() -> None:
    c = make()
    c.observe(1.0, running(step=50, t=0.9))
    c.note_injection(1.5, "kill:rank=3@step=50", 3, "node-1")
    c.observe(2.0, crash(0))
    c.observe(3.0, stopped(0))
    assert c.timeline.records[0].recovered_at is None
    # The new attempt resumed from the step-40 checkpoint: its first completed step is 41.
    c.observe(9.0, running(attempt=1, step=44, first=41, t=8.0))
    record = c.timeline.to_json()[0]
    assert record["fault_step"] == 50
    assert record["resumed_step"] == 40
    assert record["lost_steps"] == 10
    assert record["detected_at"] == 2.0
    assert record["recovered_at"] == 8.0
    assert record["recovery_seconds"] == 6.0
    assert record["scope"] == "process"
    assert record["evidence"]["injected"] == "kill:rank=3@step=50"
    kinds = [e.kind for e in c.drain_events()]
    assert "FaultInjected" in kinds and "Recovered" in kinds


def test_the_step_reached_counts_lines_read_late_and_a_restart_resumes_from_its_restore() -> None:
    """Issue 39: "killed at step 208, resumed from 200, reported as 0 steps lost". The
    killed rank's last lines reach the controller while the attempt stops; the new
    attempt restored step 40 and logs every tenth step (first line: 50)."""
    c = make()
    c.observe(1.0, running(step=50, t=0.9))
    c.observe(2.0, crash(0))
    late = stopped(0)
    late["node-0"] = h.report(
        "node-0", NodeState.STOPPED, 0, workers=h.workers(0, WorkerState.STOPPED),
        progress=Progress(first_step=1, first_time=0.1, step=53, time=1.9),
    )  # fmt: skip
    c.observe(3.0, late)
    restored = WorkerEvent(rank=0, seq=1, time=7.5, kind="CheckpointRestored",
                           message="rank 0 restored step 40", data={"step": 40})  # fmt: skip
    c.observe(9.0, running(attempt=1, step=50, first=50, t=8.0, events=[restored]))
    record = c.timeline.to_json()[0]
    assert (record["fault_step"], record["resumed_step"], record["lost_steps"]) == (53, 40, 13)
    [recovered] = [e.message for e in c.drain_events() if e.kind == "Recovered"]
    assert "of attempt 0 at step 53 recovered in" in recovered, recovered
    assert recovered.endswith("resumed from step 40, 13 steps lost"), recovered


def test_timeline_steps_from_worker_events_that_come_late() -> None:
    """A restore read after the attempt's first step line still sets where it resumed
    from; a resilient rank's InProcessRestart says the step its attempt reached."""
    timeline = Timeline()
    timeline.add(Fault(FaultType.WORKER_CRASH, 1.0, 0, rank=1), 20)
    [record] = timeline.progress(1, 31, 5.0)
    assert (record.resumed_step, record.lost_steps) == (30, 0)
    left = Event(4.0, "InProcessRestart", "left", 1, data={"attempt": 0, "step": 24})
    joined = Event(4.5, "AttemptJoined", "joined", 1, data={"attempt": 1, "step": 20})
    restored = Event(4.5, "CheckpointRestored", "restored", 1, data={"step": 22, "tier": "m"})
    assert (left_at(left), resume_point(joined), resume_point(restored)) == (
        (0, 24),
        (1, 20),
        (1, 22),
    )
    assert resume_point(left) is None and left_at(joined) is None
    timeline.reached(*(left_at(left) or (0, 0)))
    for event in (restored, joined):
        timeline.resumed(*(resume_point(event) or (0, 0)))
    assert (record.fault_step, record.resumed_step, record.lost_steps) == (24, 20, 4)
    assert resume_point(Event(1.0, "CheckpointRestored", "no step", 1, data={"step": True})) is None


def test_an_injection_confirmed_with_its_fault_still_marks_that_fault() -> None:
    # The agent's report of the kill and of the worker's death came together: the
    # controller saw the fault first, and hears of the injection only afterwards.
    c = make()
    c.observe(1.0, running(step=50, t=0.9))
    c.drain_events()
    c.observe(2.0, crash(0))
    c.note_injection(1.5, "kill:rank=3@step=50", 3, "node-1", step=50)
    assert c.timeline.to_json()[0]["evidence"]["injected"] == "kill:rank=3@step=50"
    events = c.drain_events()
    kinds = [e.kind for e in events]
    assert kinds.index("FaultInjected") == kinds.index("Fault") - 1
    fault = next(e for e in events if e.kind == "Fault")
    assert fault.data["evidence"]["injected"] == "kill:rank=3@step=50"
    # Nothing is left pending: the next fault is not taken for an injected one.
    c.observe(3.0, stopped(0))
    c.observe(9.0, running(attempt=1, step=44, first=41, t=8.0))
    c.observe(10.0, crash(1))
    assert "injected" not in c.timeline.to_json()[1]["evidence"]
