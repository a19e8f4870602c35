"""Hangs found without rules (control/no_progress.py): a job that printed progress and
stops, judged against its own step time. Plain values."""

from __future__ import annotations

import control_helpers as h
import test_control_controller
from trainguard.control.actions import StopNodes
from trainguard.control.events import FaultType
from trainguard.control.no_progress import StallWatch
from trainguard.wire.status import NodeState, Progress, WorkerState


def progress(step: int, time: float, first: tuple[int, float] = (1, 0.0)) -> Progress:
    return Progress(first_step=first[0], first_time=first[1], step=step, time=time)


RUNNING = [("node-0", h.status("node-0", workers=h.workers(0)))]


def test_a_job_that_stops_making_progress_is_hung_after_its_bound() -> None:
    watch = StallWatch(60.0)
    fast = progress(101, 10.0)  # 0.1 s a step: the floor (60 s) is the bound
    assert watch.check(69.0, fast, RUNNING) is None
    stall = watch.check(70.5, fast, RUNNING)
    assert stall is not None and stall.step == 101 and stall.bound == 60.0
    assert "no step after step 101" in stall.message(70.5, 60.5)
    assert watch.check(200.0, fast, RUNNING) is None  # once per attempt


def test_the_bound_grows_with_a_slow_job_s_step_time() -> None:
    slow = progress(11, 100.0)  # 10 s a step: 10 steps = 100 s
    watch = StallWatch(60.0)
    assert watch.check(199.0, slow, RUNNING) is None
    assert watch.check(201.0, slow, RUNNING) is not None


def test_nothing_before_the_first_step_after_a_rank_exited_or_when_off() -> None:
    assert StallWatch(5.0).check(1e6, None, RUNNING) is None  # the start is the log rules'
    one_done = [("node-0", h.status("node-0", workers=h.workers(0, WorkerState.SUCCEEDED)))]
    assert StallWatch(5.0).check(1e6, progress(10, 1.0), one_done) is None  # ExitHang's
    assert StallWatch(None).check(1e6, progress(10, 1.0), RUNNING) is None


def test_paused_time_does_not_count() -> None:
    watch = StallWatch(10.0)
    watch.clock.pause(5.0)
    watch.clock.resume(100.0)
    assert watch.check(105.0, progress(10, 1.0), RUNNING) is None  # 9 active seconds
    assert watch.check(107.0, progress(10, 1.0), RUNNING) is not None


def test_the_controller_stops_a_stalled_job_with_its_stacks() -> None:
    c = test_control_controller.make(max_restarts=1, no_progress_timeout=30.0)
    h.begin(c)
    reports = {
        n: h.report(n, NodeState.RUNNING, 0, workers=h.workers(i), progress=progress(50, 5.0))
        for i, n in enumerate(("node-0", "node-1"))
    }
    assert c.observe(30.0, reports) == []
    [stop] = c.observe(40.0, reports)
    assert isinstance(stop, StopNodes) and stop.capture_stacks
    [fault] = c.current.faults if c.current else []
    assert fault.type is FaultType.NO_PROGRESS and fault.evidence["last_step"] == 50


def test_a_rank_that_stops_while_the_others_go_on_is_hung() -> None:
    watch = StallWatch(10.0)
    status = h.status("node-1", workers=h.workers(1))
    steps = {2: (500, 50.0), 3: (80, 8.0)}  # rank 3 stopped at step 80
    with_steps = status.model_copy(
        update={"monitor": status.monitor.model_copy(update={"rank_steps": steps})}
    )
    stall = watch.check(19.0, progress(500, 50.0), [("node-1", with_steps)])
    assert stall is not None and (stall.rank, stall.node, stall.step) == (3, "node-1", 80)
    assert "rank 3 completed no step after step 80" in stall.message(19.0, 11.0)
