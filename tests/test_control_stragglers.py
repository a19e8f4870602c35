"""Stragglers: each rank's pace against the job's median, from plain samples (no clock)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import pytest

import control_helpers as h
from trainguard.control.actions import Action, JobPhase, LaunchNodes, RetireNodes, StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.events import FaultType
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeReport
from trainguard.control.stragglers import (
    MAX_SAMPLES,
    StepSample,
    Straggler,
    StragglerAction,
    StragglerWatch,
)
from trainguard.monitor.progress import ProgressMatcher
from trainguard.monitor.rules import NodeLogMonitor
from trainguard.wire.status import Beat, MonitorSnapshot, NodeState, NodeStatus, Progress

Pace = Callable[[int, int], float]
"""``pace(rank, step)``: seconds that ``step`` took on ``rank``."""


class Job:
    """Ranks that each progress at their own pace; their samples as agents report them."""

    def __init__(self, ranks: int, pace: Pace, start: Mapping[int, float] | None = None) -> None:
        self.pace = pace
        self.step = dict.fromkeys(range(ranks), 0)
        self.time = {r: (start or {}).get(r, 0.0) for r in range(ranks)}

    def advance(self, rank: int) -> StepSample:
        self.step[rank] += 1
        self.time[rank] += self.pace(rank, self.step[rank])
        return StepSample(self.step[rank], self.time[rank])

    def run(self, watch: StragglerWatch, steps: int, attempt: int = 0) -> list[Straggler]:
        """Every rank advances ``steps`` steps; the watch sees every sample."""
        found = []
        nodes = {rank: f"n{rank}" for rank in self.step}
        for _ in range(steps):
            found += watch.observe(attempt, {r: self.advance(r) for r in self.step}, nodes)
        return found


def one_slow(rank: int = 3, after: int = 20, factor: float = 3.0, until: int = 10**9) -> Pace:
    return lambda r, s: 0.1 * factor if r == rank and after < s <= until else 0.1


def test_a_slow_rank_is_reported_once_within_the_window() -> None:
    watch = StragglerWatch(1.3, 20)
    job = Job(4, one_slow(rank=3, after=20))
    assert job.run(watch, 20) == []
    found = job.run(watch, 20)
    [straggler] = found
    assert (straggler.rank, straggler.node, straggler.window) == (3, "n3", 20)
    assert straggler.step <= 20 + 20  # within the window after it slowed down
    assert straggler.ratio >= 1.3
    assert straggler.median_seconds_per_step == pytest.approx(0.1)
    assert job.run(watch, 40) == []  # once, while it stays slow
    assert watch.paces()[3] == pytest.approx(0.3)
    assert watch.paces()[0] == pytest.approx(0.1)
    assert straggler.message.startswith("rank 3 (n3) is a straggler: ")
    assert "x the median step time (" in straggler.message
    assert "s over 20 steps)" in straggler.message
    data = straggler.to_json()
    assert set(data) == {
        "rank", "node", "step", "ratio", "seconds_per_step", "median_seconds_per_step", "window"
    }  # fmt: skip
    json.dumps(data)


def test_a_fully_slow_window_gives_the_exact_ratio() -> None:
    watch = StragglerWatch(1.3, 10)
    job = Job(3, one_slow(rank=1, after=0, factor=2.0))
    [straggler] = job.run(watch, 11)  # a full window: steps 1 to 11
    assert straggler.rank == 1 and straggler.step == 11
    assert straggler.seconds_per_step == pytest.approx(0.2)
    assert straggler.ratio == pytest.approx(2.0)


def test_a_uniform_slowdown_of_every_rank_reports_nothing() -> None:
    # Every rank slows down 5x at step 30, each a little out of phase with the others.
    watch = StragglerWatch(1.3, 20)
    job = Job(8, lambda r, s: 0.5 if s > 30 else 0.1, start={r: 0.013 * r for r in range(8)})
    assert job.run(watch, 200) == []
    assert all(pace == pytest.approx(0.5) for pace in watch.paces().values())


def test_a_rank_back_under_the_threshold_is_reported_again_when_it_slows_again() -> None:
    watch = StragglerWatch(1.3, 10)
    slow = {3: (11, 30), 2: (200, 10**9)}  # rank: (slow from, until)
    job = Job(4, lambda r, s: 0.3 if r in slow and slow[r][0] <= s <= slow[r][1] else 0.1)
    found = job.run(watch, 60)
    assert [s.rank for s in found] == [3]  # slow, then back to normal
    assert 3 not in watch._reported  # re-armed
    job.pace = lambda r, s: 0.3 if r == 3 else 0.1
    assert [s.rank for s in job.run(watch, 20)] == [3]


def test_a_new_attempt_starts_afresh() -> None:
    watch = StragglerWatch(1.3, 10)
    job = Job(4, one_slow(rank=3, after=0))
    assert [s.rank for s in job.run(watch, 20)] == [3]
    # Attempt 1: the ranks start again (from a checkpoint), same pace.
    again = Job(4, one_slow(rank=3, after=0), start=dict.fromkeys(range(4), 100.0))
    assert again.run(watch, 5, attempt=1) == []
    assert watch.paces() == {} and watch.attempt == 1
    assert [s.rank for s in again.run(watch, 10, attempt=1)] == [3]


def test_memory_is_bounded_and_the_pace_exact_over_a_long_window() -> None:
    watch = StragglerWatch(1.3, 10_000)
    job = Job(2, lambda r, s: 0.01 if r == 0 else 0.02)
    job.run(watch, 30_000)
    for pace in watch._ranks.values():
        assert len(pace.samples) <= MAX_SAMPLES
        first, last = pace.samples[0], pace.samples[-1]
        span = last[0] - first[0]
        assert 10_000 <= span <= 10_000 + pace.spacing
    assert watch.paces() == {0: pytest.approx(0.01), 1: pytest.approx(0.02)}


def test_sparse_samples_give_the_exact_pace() -> None:
    # Polled every 7th step for rank 0, every 3rd for the others: the times are the
    # ranks' own line times, so the paces are exact however sparse.
    watch = StragglerWatch(1.3, 20)
    job = Job(4, one_slow(rank=0, after=0, factor=2.0))
    found = []
    for step in range(1, 61):
        for rank in range(4):
            sample = job.advance(rank)
            if step % (7 if rank == 0 else 3) == 0:
                found += watch.observe(0, {rank: sample})
    assert [s.rank for s in found] == [0]
    assert found[0].step == 28  # its first poll with a full window (steps 7 to 28)
    assert watch.paces() == {
        0: pytest.approx(0.2),
        1: pytest.approx(0.1),
        2: pytest.approx(0.1),
        3: pytest.approx(0.1),
    }


def test_needs_two_ranks_with_a_full_window() -> None:
    watch = StragglerWatch(1.3, 10)
    job = Job(2, one_slow(rank=1, after=0, factor=5.0))
    assert job.run(watch, 9) == []
    assert watch.paces() == {} and watch.median() is None
    lonely = StragglerWatch(1.3, 10)
    assert Job(1, lambda r, s: 1.0).run(lonely, 50) == []
    assert lonely.median() is None


def test_without_a_threshold_paces_are_measured_but_nobody_reported() -> None:
    watch = StragglerWatch(None, 10)
    assert Job(4, one_slow(after=0)).run(watch, 30) == []
    assert watch.paces()[3] == pytest.approx(0.3)


def test_stale_repeated_and_rewound_samples() -> None:
    watch = StragglerWatch(1.3, 2)
    assert watch.observe(0, {0: (5, 1.0)}) == []
    assert watch.observe(0, {0: (5, 1.0)}) == []  # the same sample, polled again
    watch.observe(0, {0: (6, 2.0), 1: (6, 2.0)})
    watch.observe(0, {0: (7, 3.0), 1: (8, 3.0)})
    assert watch.paces() == {0: pytest.approx(1.0), 1: pytest.approx(0.5)}
    watch.observe(0, {0: (2, 9.0)})  # the rank restarted within the attempt: start afresh
    assert watch.paces() == {1: pytest.approx(0.5)}


@pytest.mark.parametrize(
    ("threshold", "window"), [(1.0, 20), (float("nan"), 20), (1.3, 1), (1.3, 10_001), (1.3, True)]
)
def test_bad_parameters_are_refused(threshold: float, window: int) -> None:
    with pytest.raises(ValueError):
        StragglerWatch(threshold, window)


# -- from the agents' reports ---------------------------------------------------------


def node_status(
    node: str, rank_steps: Mapping[int, tuple[int, float]], beats: Mapping[int, Beat] = {}
) -> NodeStatus:
    base = h.status(node, workers=h.workers(int(node[-1])))
    step, t = max(rank_steps.values(), default=(0, 0.0))
    progress = Progress(first_step=1, first_time=0.0, step=step, time=t) if rank_steps else None
    monitor = MonitorSnapshot(rank_steps=dict(rank_steps), progress=progress)
    return base.model_copy(update={"monitor": monitor, "heartbeats": dict(beats)})


def test_a_heartbeat_with_a_step_is_preferred_to_the_progress_line() -> None:
    # Rank 0's heartbeats give steps (every 0.2 s), its lines every 0.1 s; rank 1 beats
    # without a step, so its lines count.
    watch = StragglerWatch(1.3, 2)
    for step in range(1, 4):
        lines = {0: (step, 0.1 * step), 1: (step, 0.1 * step)}
        beats = {0: Beat(step=step, time=0.2 * step), 1: Beat(time=9.0)}
        watch.observe_statuses(0, [("node-0", node_status("node-0", lines, beats))])
    assert watch.paces() == {0: pytest.approx(0.2), 1: pytest.approx(0.1)}
    assert watch._ranks[0].beat and not watch._ranks[1].beat


def test_the_node_monitor_reports_each_ranks_latest_step_on_the_wire() -> None:
    monitor = NodeLogMonitor([], ProgressMatcher())
    monitor.on_line(0, "stdout", "Step 1", 10.0)
    monitor.on_line(1, "stdout", "Step 1", 10.5)
    monitor.on_line(0, "stdout", "Step 2", 11.0)
    monitor.on_line(0, "stdout", "loss 3.2", 11.2)
    snap = monitor.snapshot()
    assert snap.rank_steps == {0: (2, 11.0), 1: (1, 10.5)}
    again = MonitorSnapshot.from_json(snap.to_json())
    assert again.rank_steps == {0: (2, 11.0), 1: (1, 10.5)}
    assert MonitorSnapshot.from_json({}).rank_steps == {}


def test_statuses_already_seen_are_skipped() -> None:
    watch = StragglerWatch(1.3, 2)
    status = node_status("node-0", {0: (5, 1.0)})
    watch.observe_statuses(0, [("node-0", status)])
    assert watch._seen["node-0"] is status
    watch._ranks.clear()
    watch.observe_statuses(0, [("node-0", status)])
    assert watch._ranks == {}  # the same status object is not read twice


# -- the controller ---------------------------------------------------------------


NODES = ("node-0", "node-1")


def controller(action: StragglerAction = "report") -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig(3, None, None, None, max_num_repeat_offenders_to_avoid=1),
        spare_node_ids=("node-2",),
        straggler_window=10,
        straggler_action=action,
    )
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def running(step: int, attempt: int = 0, slow_rank: int = 3) -> dict[str, NodeReport]:
    """Both nodes at ``step``: every rank 0.1 s per step, ``slow_rank`` 0.3 s."""

    def at(rank: int) -> tuple[int, float]:
        return step, step * (0.3 if rank == slow_rank else 0.1)

    out = {}
    for index, node in enumerate(NODES):
        status = node_status(node, {r: at(r) for r in (2 * index, 2 * index + 1)})
        status = status.model_copy(update={"attempt": attempt})
        out[node] = NodeReport(node, status, host=f"host-{node}")
    return out


def test_the_controller_records_a_straggler_event_and_goes_on() -> None:
    c = controller()
    h.begin(c)
    c.drain_events()
    for step in range(1, 12):
        assert c.observe(float(step), running(step)) == []
    [event] = [e for e in c.drain_events() if e.kind == "Straggler"]
    assert (event.rank, event.node, event.attempt) == (3, "node-1", 0)
    assert event.message == (
        "rank 3 (node-1) is a straggler: 3.0x the median step time "
        "(0.300 s vs 0.100 s over 10 steps)"
    )
    assert event.data["rank"] == 3 and event.data["node"] == "node-1"
    assert event.data["ratio"] == pytest.approx(3.0)
    assert event.data["seconds_per_step"] == pytest.approx(0.3)
    assert event.data["median_seconds_per_step"] == pytest.approx(0.1)
    assert event.data["window"] == 10
    assert c.phase is JobPhase.RUNNING and c.attempts[0].faults == []
    assert c.stragglers.paces() == {
        0: pytest.approx(0.1),
        1: pytest.approx(0.1),
        2: pytest.approx(0.1),
        3: pytest.approx(0.3),
    }


def test_with_restart_a_straggler_is_a_fault_and_its_node_is_replaced() -> None:
    c = controller("restart")
    h.begin(c)
    actions: list[Action] = []
    for step in range(1, 12):
        actions = c.observe(float(step), running(step))
        if actions:
            break
    [stop] = actions
    assert isinstance(stop, StopNodes) and stop.mode == "process"
    [fault] = c.attempts[0].faults
    assert fault.type is FaultType.STRAGGLER and str(fault.type) == "Straggler"
    assert (fault.rank, fault.node, fault.step) == (3, "node-1", 11)
    assert fault.evidence["window"] == 10
    events = c.drain_events()
    assert [e.kind for e in events if e.kind in ("Straggler", "Fault")] == ["Straggler", "Fault"]
    retire, launch = c.observe(20.0, h.reports(NODES, NodeState.STOPPED))
    assert retire == RetireNodes(("node-1",))
    assert isinstance(launch, LaunchNodes)  # a full job restart, without node-1
    assert launch.node_ids == ("node-0", "node-2")
    assert launch.avoid_hosts == ("host-node-1",)  # maxNumRepeatOffendersToAvoid: 1
    [scheduled] = [e for e in c.drain_events() if e.kind == "RestartScheduled"]
    assert scheduled.data == {"scope": "job", "replaced": {"node-1": "node-2"}}
