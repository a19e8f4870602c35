"""A rank that does not exit after the others did (control/exit_hang.py), and what the
controller makes of it: plain reports, no processes, no clock."""

from __future__ import annotations

import control_helpers as h
import test_control_controller
from trainguard.control.actions import Finish, JobPhase, StartNodes, StopNodes
from trainguard.control.controller import JobController
from trainguard.control.events import FaultType
from trainguard.control.exit_hang import ExitWatch, step_seconds
from trainguard.control.reports import NodeReport
from trainguard.wire.status import (
    MonitorSnapshot,
    NodeState,
    NodeStatus,
    Progress,
    WorkerState,
    WorkerStatus,
)

NODES = ("node-0", "node-1")


def worker(rank: int, state: WorkerState, cpu: float | None = None) -> WorkerStatus:
    return WorkerStatus(
        local_rank=rank % 2, rank=rank, pid=1000 + rank, state=state, cpu_seconds=cpu
    )


def status(
    node: int, states: tuple[WorkerState, WorkerState], cpu: float | None = None,
    steps: dict[int, int] | None = None,
) -> tuple[str, NodeStatus]:  # fmt: skip
    node_id = NODES[node]
    done = all(s is WorkerState.SUCCEEDED for s in states)
    s = h.status(
        node_id,
        NodeState.COMPLETED if done else NodeState.RUNNING,
        workers=[
            worker(node * 2 + i, st, cpu if st is WorkerState.RUNNING else None)
            for i, st in enumerate(states)
        ],
    )
    rank_steps = {r: (step, 0.0) for r, step in (steps or {}).items()}
    return node_id, s.model_copy(update={"monitor": MonitorSnapshot(rank_steps=rank_steps)})


RUN, OK, FAIL = WorkerState.RUNNING, WorkerState.SUCCEEDED, WorkerState.FAILED


def lingering(cpu: float | None = 1.0, steps: dict[int, int] | None = None) -> list:
    """Ranks 0-2 exited 0; rank 3 (node-1) still runs."""
    return [status(0, (OK, OK), steps=steps), status(1, (OK, RUN), cpu=cpu, steps=steps)]


def test_a_rank_idle_past_the_bound_after_the_others_exited_is_hung() -> None:
    watch = ExitWatch(60.0)
    assert watch.observe(100.0, 2, lingering(), None) is None  # the bound starts now
    assert watch.observe(159.0, 2, lingering(), None) is None
    found = watch.observe(160.0, 2, lingering(), None)
    assert found is not None and found.hung == (("node-1", 3),) and found.busy == ()
    assert found.since == 100.0 and found.bound == 60.0
    assert found.finished  # no steps to compare: idle, after every collective completed
    assert found.evidence()["judged_by"] == "idle"


def test_nothing_lingers_while_every_rank_runs_or_one_failed() -> None:
    watch = ExitWatch(1.0)
    running = [status(0, (RUN, RUN)), status(1, (RUN, RUN))]
    failed = [status(0, (OK, OK)), status(1, (FAIL, RUN))]
    done = [status(0, (OK, OK)), status(1, (OK, OK))]
    for t, current in enumerate([running, failed, done, running] * 3):
        assert watch.observe(float(t * 10), 2, current, None) is None


def test_a_node_that_does_not_report_the_attempt_holds_the_judgement() -> None:
    watch = ExitWatch(1.0)
    only = [status(1, (OK, RUN))]
    assert watch.observe(0.0, 2, only, None) is None
    assert watch.observe(100.0, 2, only, None) is None


def test_another_exit_starts_the_bound_again() -> None:
    watch = ExitWatch(60.0)
    two = [status(0, (OK, OK)), status(1, (RUN, RUN))]
    assert watch.observe(0.0, 2, two, None) is None
    assert watch.observe(50.0, 2, lingering(), None) is None  # rank 2 exited at 50
    assert watch.observe(100.0, 2, lingering(), None) is None
    assert watch.observe(110.0, 2, lingering(), None) is not None


def test_a_rank_that_computes_is_left_to_finish_and_said_to_linger() -> None:
    watch = ExitWatch(10.0)
    assert watch.observe(0.0, 2, lingering(cpu=1.0), None) is None
    busy = watch.observe(10.0, 2, lingering(cpu=9.0), None)  # 8 CPU s in 10 s
    assert busy is not None and busy.hung == () and busy.busy == (("node-1", 3),)
    assert "left to finish" in busy.message(10.0)
    # A whole bound later it is judged again, from its CPU time then.
    assert watch.observe(15.0, 2, lingering(cpu=9.1), None) is None
    hung = watch.observe(20.0, 2, lingering(cpu=9.2), None)
    assert hung is not None and hung.hung == (("node-1", 3),) and hung.since == 10.0


def test_without_cpu_times_the_bound_alone_decides() -> None:
    watch = ExitWatch(5.0)
    assert watch.observe(0.0, 2, lingering(cpu=None), None) is None
    found = watch.observe(5.0, 2, lingering(cpu=None), None)
    assert found is not None and found.hung == (("node-1", 3),)


def test_the_bound_grows_with_the_step_time() -> None:
    watch = ExitWatch(60.0)
    slow = Progress(first_step=1, first_time=0.0, step=11, time=100.0)  # 10 s a step
    assert step_seconds(slow) == 10.0 and watch.bound(slow) == 200.0
    fast = Progress(first_step=1, first_time=0.0, step=101, time=10.0)
    assert watch.bound(fast) == 60.0 and watch.bound(None) == 60.0
    assert watch.observe(0.0, 2, lingering(), slow) is None
    assert watch.observe(199.0, 2, lingering(), slow) is None
    assert watch.observe(200.0, 2, lingering(), slow) is not None


def test_its_work_was_done_only_if_it_reached_the_others_last_step() -> None:
    watch = ExitWatch(1.0)
    short = {0: 100, 1: 100, 2: 100, 3: 97}
    watch.observe(0.0, 2, lingering(steps=short), None)
    found = watch.observe(1.0, 2, lingering(steps=short), None)
    assert found is not None and found.done_step == 100 and found.unfinished == (3,)
    assert not found.finished and "had not reached step 100" in found.message(1.0)
    watch = ExitWatch(1.0)
    full = {0: 100, 1: 100, 2: 100, 3: 100}
    watch.observe(0.0, 2, lingering(steps=full), None)
    found = watch.observe(1.0, 2, lingering(steps=full), None)
    assert found is not None and found.finished and found.evidence()["judged_by"] == "steps"


def test_a_rank_that_never_reported_a_step_is_not_judged_by_steps() -> None:
    """Only rank 0 prints progress: the silent rank 3 is judged idle, not short."""
    watch = ExitWatch(1.0)
    watch.observe(0.0, 2, lingering(steps={0: 100}), None)
    found = watch.observe(1.0, 2, lingering(steps={0: 100}), None)
    assert found is not None and found.finished


def test_off_when_the_timeout_is_none() -> None:
    watch = ExitWatch(None)
    assert watch.observe(0.0, 2, lingering(), None) is None
    assert watch.observe(1e6, 2, lingering(), None) is None


# -- the controller ------------------------------------------------------------------------


def make(timeout: float | None = 30.0, max_restarts: int = 1) -> JobController:
    return test_control_controller.make(max_restarts, exit_hang_timeout=timeout)


def reports(current: list, stacks: dict[int, str] | None = None) -> dict[str, NodeReport]:
    out = {}
    for node_id, s in current:
        if stacks:
            mine = {r: t for r, t in stacks.items() if any(w.rank == r for w in s.workers)}
            s = s.model_copy(update={"stacks": mine})
        out[node_id] = NodeReport(node_id, s)
    return out


def stopped(steps: dict[int, int] | None = None, stacks: dict[int, str] | None = None) -> dict:
    """After the stop: ranks 0-2 exited 0 on their own, rank 3 was stopped."""
    current = [status(0, (OK, OK), steps=steps), status(1, (OK, WorkerState.STOPPED), steps=steps)]
    current[1] = (current[1][0], current[1][1].model_copy(update={"state": NodeState.STOPPED}))
    return reports(current, stacks)


STACK = 'pid 1003 (python): state S (sleeping), wchan futex\nThread 1003 (idle): "MainThread"\n'


def test_an_exit_hang_after_the_work_is_done_completes_the_job_with_its_stacks() -> None:
    c = make(timeout=30.0)
    assert isinstance(h.begin(c), StartNodes)
    assert c.observe(10.0, reports(lingering())) == []
    [stop] = c.observe(40.0, reports(lingering()))
    assert isinstance(stop, StopNodes) and stop.capture_stacks and stop.mode == "process"
    [fault] = c.current.faults if c.current else []
    assert fault.type is FaultType.EXIT_HANG and fault.rank == 3 and fault.node == "node-1"
    assert fault.evidence["finished"] is True and fault.evidence["ranks"] == [3]
    [finish] = c.observe(41.0, stopped(stacks={3: STACK}))
    assert isinstance(finish, Finish) and finish.phase is JobPhase.SUCCEEDED
    assert "ended as ExitHang" in finish.reason and c.restarts == 0
    [record] = c.timeline.records
    assert record.fault.evidence["stacks"] == {"3": STACK}
    kinds = [e.kind for e in c.drain_events()]
    assert kinds[-4:] == ["Fault", "StoppingAll", "AttemptEnded", "JobSucceeded"]


def test_an_exit_hang_short_of_the_last_step_is_a_fault_that_restarts() -> None:
    c = make(timeout=30.0, max_restarts=1)
    h.begin(c)
    short = {0: 100, 1: 100, 2: 100, 3: 60}
    c.observe(10.0, reports(lingering(steps=short)))
    [stop] = c.observe(40.0, reports(lingering(steps=short)))
    assert isinstance(stop, StopNodes)
    actions = c.observe(41.0, stopped(steps=short, stacks={3: STACK}))
    assert c.phase is not JobPhase.SUCCEEDED and c.restarts == 1
    assert actions and not isinstance(actions[0], Finish)


def test_a_busy_lingering_rank_is_an_event_not_a_fault() -> None:
    c = make(timeout=30.0)
    h.begin(c)
    c.observe(10.0, reports(lingering(cpu=0.0)))
    assert c.observe(40.0, reports(lingering(cpu=25.0))) == []
    events = c.drain_events()
    [linger] = [e for e in events if e.kind == "Lingering"]
    assert linger.rank == 3 and "left to finish" in linger.message
    assert c.current is not None and c.current.faults == []


def test_no_exit_hang_when_switched_off() -> None:
    c = make(timeout=None)
    h.begin(c)
    for t in (10.0, 1000.0, 100000.0):
        assert c.observe(t, reports(lingering())) == []
