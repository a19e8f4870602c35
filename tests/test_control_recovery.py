"""The controller's detection, escalation and timeline, driven by plain reports."""

from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    ControlConfig,
    Finish,
    JobController,
    StartNodes,
    StopNodes,
)
from trainguard.control.events import FaultType
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import (
    NodeReport,
    NodeState,
    RankProgress,
    RuleActivity,
    WorkerFailure,
)
from trainguard.monitor.rules import Detection, LogRuleSpec

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
    return JobController(config, lambda attempt: Endpoint("127.0.0.1", 30000 + attempt))


def running(
    attempt: int = 0,
    step: int | None = None,
    t: float = 0.0,
    first: int | None = None,
    **extra: object,
) -> dict[str, NodeReport]:
    progress = {}
    if step is not None:
        progress = {0: RankProgress(first if first is not None else step, t, step, t)}
    reports = {
        "node-0": NodeReport(
            "node-0", True, NodeState.RUNNING, attempt, progress=progress, **extra
        ),  # type: ignore[arg-type]
        "node-1": NodeReport("node-1", True, NodeState.RUNNING, attempt),
    }
    return reports


def stopped(attempt: int = 0, **extra: object) -> dict[str, NodeReport]:
    return {
        n: NodeReport(n, True, NodeState.STOPPED, attempt, **extra)  # type: ignore[arg-type]
        for n in NODES
    }


def crash(attempt: int = 0, node: str = "node-1") -> dict[str, NodeReport]:
    reports = running(attempt)
    reports[node] = NodeReport(
        node, True, NodeState.FAULTED, attempt, "boom", (WorkerFailure(3, 1, -9, "SIGKILL"),)
    )
    return reports


def test_slow_detection_from_an_agent_stops_all() -> None:
    c = make()
    c.start(0.0)
    d = Detection("LogSlow", "Speed", 0, 5.0, "Batch 9 Speed: 10 samples/sec", 10.0)
    [stop] = c.observe(6.0, running(detections=(d,)))
    assert isinstance(stop, StopNodes) and not stop.capture_stacks
    fault = c.attempts[0].faults[0]
    assert fault.type is FaultType.LOG_SLOW and fault.rank == 0
    assert fault.message.startswith("LogSlow_Speed")
    # The same detection reported again is not a second fault.
    c2 = make()
    c2.start(0.0)
    c2.observe(1.0, running())
    assert len(c2.attempts[0].faults) == 0


def test_nan_detection_is_its_own_fault_type() -> None:
    c = make()
    c.start(0.0)
    d = Detection("NaNMetric", "Loss", 0, 5.0, "Batch 9 Loss: nan", float("nan"))
    c.observe(6.0, running(detections=(d,)))
    assert c.attempts[0].faults[0].type is FaultType.NAN_METRIC


def test_job_wide_hang_is_detected_and_stacks_are_captured() -> None:
    c = make(log_rules=(HANG,))
    c.start(0.0)
    # node-0 matched at t=5; node-1 never logs (only rank 0 does): no hang while in time.
    activity = {"JobHang": RuleActivity(5.0)}
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
    assert isinstance(start, StartNodes)
    evidence = c.attempts[0].faults[0].evidence
    assert evidence["stacks"] == {str(k): v for k, v in stacks.items()}
    assert evidence["stopped_ranks"] == [2]
    assert c.timeline.records[0].fault.evidence["stopped_ranks"] == [2]


def test_stop_pattern_turns_the_hang_rule_off() -> None:
    c = make(log_rules=(HANG,))
    c.start(0.0)
    assert c.observe(100.0, running(rules={"JobHang": RuleActivity(5.0, stopped=True)})) == []


def test_heartbeat_timeout_names_the_rank() -> None:
    c = make(heartbeat_timeout=5.0)
    c.start(0.0)
    assert c.observe(3.0, running(heartbeats={1: 2.0})) == []
    [stop] = c.observe(8.0, running(heartbeats={1: 2.0}))
    assert isinstance(stop, StopNodes) and stop.capture_stacks
    fault = c.attempts[0].faults[0]
    assert fault.type is FaultType.HEARTBEAT_TIMEOUT and fault.rank == 1 and fault.node == "node-0"


def test_lost_node_gets_a_full_restart_on_a_spare() -> None:
    c = make(spares=("node-2",))
    c.start(0.0)
    reports = running()
    reports["node-1"] = NodeReport("node-1", False)
    [stop] = c.observe(1.0, reports)
    assert isinstance(stop, StopNodes)
    after = stopped()
    after["node-1"] = NodeReport("node-1", False)
    [start] = c.observe(2.0, after)
    assert isinstance(start, StartNodes)
    assert start.scope == "job"
    assert [a.node_id for a in start.assignments] == ["node-0", "node-2"]
    assert c.spares == ()


def test_escalation_to_a_full_restart_after_process_restarts() -> None:
    c = make(max_restarts=5, escalate_after=2)
    c.start(0.0)
    scopes = []
    for attempt in range(3):
        c.observe(10.0 * attempt + 1, crash(attempt))
        [start] = c.observe(10.0 * attempt + 2, stopped(attempt))
        assert isinstance(start, StartNodes)
        scopes.append(start.scope)
    assert scopes == ["process", "process", "job"]
    assert c.full_restarts == 1


def test_budget_exhausted_after_restarts() -> None:
    c = make(max_restarts=1)
    c.start(0.0)
    c.observe(1.0, crash(0))
    c.observe(2.0, stopped(0))
    c.observe(3.0, crash(1))
    [finish] = c.observe(4.0, stopped(1))
    assert isinstance(finish, Finish)
    assert "jobMaxRetryCount=1" in finish.reason


def test_timeline_measures_recovery_and_lost_steps() -> None:
    c = make()
    c.start(0.0)
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
