"""Goodput and downtime from a job's history (trainguard.observe.account), the samples a
running job keeps (history.Trace), and the metrics they feed (observe.metrics)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainguard.control.events import Event
from trainguard.observe.account import account
from trainguard.observe.gauges import JobState
from trainguard.observe.history import JOB, SAMPLE_INTERVAL, JobHistory, SeriesSample, Trace
from trainguard.observe.metrics import Metrics


def history(
    samples: list[tuple[float, int, int]],
    faults: list[dict[str, Any]] = (),  # type: ignore[assignment]
    start: float = 0.0,
    end: float | None = 100.0,
) -> JobHistory:
    return JobHistory(
        job_id="j-1",
        name="j",
        phase="Succeeded" if end is not None else "Running",
        created_at=start,
        started_at=start,
        finished_at=end,
        faults=tuple(faults),
        samples=tuple(SeriesSample(t, attempt, JOB, step) for t, attempt, step in samples),
    )


def fault(attempt: int, kind: str = "WorkerCrash", scope: str | None = "process") -> dict[str, Any]:
    return {"type": kind, "attempt": attempt, "scope": scope}


def test_a_job_without_faults_is_startup_steps_and_a_tail() -> None:
    # One step a second, steps 1..90 completed at t = 5..94.
    acc = account(history([(5.0, 0, 1), (50.0, 0, 46), (94.0, 0, 90)]), now=1e9)
    assert acc.step_seconds == pytest.approx(1.0)
    assert acc.useful_seconds == pytest.approx(90.0)  # 4.0 (step 1 began) .. 94.0
    assert acc.goodput == pytest.approx(0.9)
    assert acc.downtime_seconds() == pytest.approx({"startup": 4.0, "other": 6.0})
    assert (acc.kept_steps, acc.lost_steps) == (90, 0)


def test_an_attempt_resumes_from_the_step_its_ranks_restored() -> None:
    """Attempt 1 restored step 30 and logs every 10 steps (first sample: step 40): the
    steps 31..40 of attempt 0 were redone; its first step alone says from 39 (1 lost)."""
    samples = [(11.0, 0, 1), (50.0, 0, 40), (70.0, 1, 40), (90.0, 1, 60)]
    restored = Event(60.0, "CheckpointRestored", "rank 0 restored step 30", 1, rank=0,
                     data={"step": 30, "tier": "memory"})  # fmt: skip
    assert account(history(samples, [fault(0)]), now=1e9).lost_steps == 1
    with_restore = replace(history(samples, [fault(0)]), events=(restored,))
    assert account(with_restore, now=1e9).lost_steps == 10


def test_steps_redone_after_a_fault_are_downtime_of_that_fault() -> None:
    # Attempt 0: steps 1..40 at t = 11..50; crash; attempt 1 resumes from step 30 (its
    # first step is 31, at t = 61) and runs to step 60 at t = 90.
    samples = [(11.0, 0, 1), (30.0, 0, 20), (50.0, 0, 40), (61.0, 1, 31), (90.0, 1, 60)]
    acc = account(history(samples, [fault(0)]), now=1e9)
    assert acc.lost_steps == 10  # steps 31..40 were done twice
    assert acc.kept_steps == 60
    spans = [(u.attempt, u.first, u.last, u.start, u.end) for u in acc.useful]
    assert spans == [(0, 1, 30, 10.0, 40.0), (1, 31, 60, 60.0, 90.0)]
    # From the end of step 30 (t = 40) to the start of step 31 again (t = 60).
    assert acc.downtime_seconds() == pytest.approx(
        {"startup": 10.0, "WorkerCrash": 20.0, "other": 10.0}
    )
    crash = next(d for d in acc.downtime if d.cause == "WorkerCrash")
    assert (crash.start, crash.end, crash.scope, crash.attempt) == (40.0, 60.0, "process", 0)
    assert acc.goodput == pytest.approx(0.6)


def test_an_attempt_whose_work_was_all_redone_keeps_nothing() -> None:
    # Attempt 1 resumes from step 0 (no checkpoint): attempt 0's steps are all lost.
    samples = [(2.0, 0, 1), (11.0, 0, 10), (21.0, 1, 1), (30.0, 1, 10)]
    acc = account(history(samples, [fault(0)], end=30.0), now=1e9)
    assert [u.attempt for u in acc.useful] == [1]
    assert acc.lost_steps == 10
    # Startup up to the job's first step (t = 1), then the crash's downtime to t = 20.
    assert acc.downtime_seconds() == pytest.approx(
        {"startup": 1.0, "WorkerCrash": 19.0, "other": 0.0}
    )
    assert acc.goodput == pytest.approx(10 / 30)


def test_a_job_recovering_now_counts_the_tail_as_its_fault() -> None:
    acc = account(history([(2.0, 0, 1), (10.0, 0, 9)], [fault(0, "LogHang", None)], end=None), 25)
    assert acc.end == 25
    assert acc.downtime_seconds() == pytest.approx({"startup": 1.0, "LogHang": 15.0, "other": 0})


def test_a_job_with_no_step_yet_is_starting_up() -> None:
    acc = account(history([], end=None), now=12.0)
    assert acc.goodput == 0.0
    assert acc.downtime_seconds() == {"startup": 12.0, "other": 0.0}
    failed = account(history([], [fault(0)], end=12.0), now=99.0)
    assert failed.downtime_seconds() == {"WorkerCrash": 12.0, "other": 0.0}


def test_the_parts_add_up_to_the_window() -> None:
    samples = [(3.0, 0, 1), (20.0, 0, 18), (31.0, 1, 11), (50.0, 1, 30), (70.0, 2, 31)]
    acc = account(history(samples, [fault(0), fault(1, "LogHang", "job")]), now=1e9)
    assert acc.useful_seconds + sum(acc.downtime_seconds().values()) == pytest.approx(100.0)
    assert acc.faults == {"WorkerCrash": 1, "LogHang": 1}


def test_the_trace_keeps_one_sample_a_second_and_each_attempts_ends() -> None:
    trace = Trace()
    for i in range(1, 301):  # 300 steps, 10 ms each
        trace.progress(0, (1, 0.01), (i, i * 0.01))
    trace.progress(1, (101, 5.0), (101, 5.0))  # attempt 0's newest step is kept
    kept = trace.take()
    assert [(s.attempt, int(s.value)) for s in kept] == [
        (0, 1),
        (0, 101),  # SAMPLE_INTERVAL after the first
        (0, 201),
        (0, 300),  # flushed when attempt 1 began
        (1, 101),
    ]
    assert SAMPLE_INTERVAL == 1.0
    assert trace.take() == []
    trace.progress(1, (101, 5.0), (120, 5.2))
    assert trace.take() == [] and trace.snapshot()[-1].value == 120  # pending, not stored
    trace.end()
    assert [int(s.value) for s in trace.take()] == [120]


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_metrics_count_events_and_show_the_accounting() -> None:
    from prometheus_client import generate_latest

    metrics = Metrics()
    job = metrics.job("demo")
    crash = {"type": "WorkerCrash", "evidence": {"injected": "kill:rank=1@step=5"}}
    job.events(
        [
            Event(0.0, "JobStarted", "started"),
            Event(10.0, "FaultInjected", "injected", data={"spec": "kill"}),
            Event(10.5, "Fault", "rank 1 died", data=crash),
            Event(11.0, "RestartScheduled", "restart", data={"scope": "process"}),
            Event(13.0, "Recovered", "back", data={"recovery_seconds": 2.5, "lost_steps": 4}),
            Event(14.0, "CheckpointRestored", "r", data={"tier": "memory", "seconds": 0.02}),
            Event(15.0, "Straggler", "rank 2 slow", data={"rank": 2}),
            Event(20.0, "JobSucceeded", "done"),
        ]
    )
    job.faults([{"type": "WorkerCrash", "scope": "process"}])
    samples_ = [(11.0, 0, 1), (30.0, 0, 20), (50.0, 0, 40), (61.0, 1, 31), (90.0, 1, 60)]
    acc = account(history(samples_, [fault(0)]), now=1e9)
    health = {"Schedulable": 2, "UnschedulablePendingReplacement": 1}
    job.state(JobState(acc, step=60, steps_per_second=1.0, nodes={"completed": 2}, health=health))
    text = generate_latest(metrics.registry).decode()
    d = (("job", "demo"),)
    assert samples(text, "trainguard_jobs_created_total") == {(): 1.0}
    assert samples(text, "trainguard_jobs_successful_total") == {(): 1.0}
    assert samples(text, "trainguard_jobs_restarted_total") == {(*d, ("scope", "process")): 1.0}
    assert samples(text, "trainguard_faults_total") == {
        (*d, ("scope", "process"), ("type", "WorkerCrash")): 1.0
    }
    assert samples(text, "trainguard_lost_steps_total") == {d: 4.0}
    assert samples(text, "trainguard_stragglers_total") == {d: 1.0}
    assert samples(text, "trainguard_jobs_restart_latency_seconds_sum") == {d: 2.5}
    assert samples(text, "trainguard_jobs_fault_detection_latency_seconds_sum") == {d: 0.5}
    assert samples(text, "trainguard_checkpoint_restore_seconds_count") == {
        (*d, ("tier", "memory")): 1.0
    }
    assert samples(text, "trainguard_goodput_ratio") == {d: pytest.approx(acc.goodput)}
    downtime = samples(text, "trainguard_downtime_seconds")
    assert downtime == {
        (("cause", cause), *d): pytest.approx(v) for cause, v in acc.downtime_seconds().items()
    }
    assert samples(text, "trainguard_nodes") == {(*d, ("state", "completed")): 2.0}
    assert samples(text, "trainguard_node_health") == {
        (*d, ("status", "Schedulable")): 2.0,
        (*d, ("status", "UnschedulablePendingReplacement")): 1.0,
    }

    job.state(JobState(acc, nodes={"running": 1}))  # a state gone reads 0, not its old count
    text = generate_latest(metrics.registry).decode()
    assert samples(text, "trainguard_nodes") == {
        (*d, ("state", "completed")): 0.0,
        (*d, ("state", "running")): 1.0,
    }
    job.forget()
    text = generate_latest(metrics.registry).decode()
    assert samples(text, "trainguard_goodput_ratio") == {}
    assert samples(text, "trainguard_jobs_restarted_total")  # counters stay


def test_save_times_are_reported_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.checkpoint import save_times

    emitted: list[dict[str, Any]] = []
    monkeypatch.setattr(
        save_times.worker_events, "emit", lambda kind, message, **data: emitted.append(data)
    )
    now = [0.0]
    times = save_times.SaveTimes(enabled=True, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] += 3.0  # a save every 3 s: the 4th is 12 s after the start
        times.add(step, 0.01 * step)
    assert emitted == [
        {"tier": "memory", "step": 4, "saves": 4, "blocking_seconds": [0.01, 0.02, 0.03, 0.04]}
    ]
    times.flush()
    assert emitted[-1]["blocking_seconds"] == [0.05] and emitted[-1]["saves"] == 1
    times.flush()
    assert len(emitted) == 2  # nothing new, no event
    quiet = save_times.SaveTimes(enabled=False)
    quiet.add(1, 0.1)
    quiet.flush()
    assert len(emitted) == 2
