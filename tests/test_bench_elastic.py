"""The elastic benchmark's figures, from synthetic step records, incarnations and events.

No job runs here: ``bench/elastic_figures.py`` (which scaling path was taken, the
time to the first step at the new size, the steps redone, the throughput of each
phase), its results and its table rows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import TrainingJob, resolve_plan

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench.elastic import (  # noqa: E402
    ElasticArgs,
    ElasticPlan,
    checkpoint_restart_job,
    in_process_job,
    paired_ratios,
    side_figures,
)
from bench.elastic_figures import (  # noqa: E402
    IN_PROCESS,
    RESTART,
    WorldRecord,
    elastic_figures,
    read_worlds,
)
from bench.report import markdown  # noqa: E402
from bench.steps import StepRecord  # noqa: E402
from bench.suite import QUICK, SCENARIOS  # noqa: E402

DT = 0.1  # seconds per step in the synthetic runs


def steps(incarnation: str, first: int, last: int, t0: float, dt: float = DT) -> list[StepRecord]:
    """Steps ``first..last`` back to back from ``t0``."""
    return [
        StepRecord(incarnation, s, t0 + (s - first) * dt, t0 + (s - first + 1) * dt)
        for s in range(first, last + 1)
    ]


def worlds(incarnation: str, pids: list[int], at: float) -> list[WorldRecord]:
    return [WorldRecord(incarnation, rank, len(pids), pid, at) for rank, pid in enumerate(pids)]


def event(kind: str, time: float, **data: Any) -> dict[str, Any]:
    return {"kind": kind, "time": time, "message": kind, "data": data}


def in_process_run() -> tuple[list[StepRecord], list[WorldRecord], list[dict[str, Any]]]:
    """3 ranks for steps 1-40 (ends at 4.0); node 2 preempted at 4.05, the two survivors
    go on in place from step 41 (ends at 4.6); capacity at 8.0, a scale-up decided at
    9.0, the new node joins: step 91 at the larger size ends at 12.1."""
    records = (
        steps("j.0", 1, 40, 0.0)
        + steps("j.1", 41, 90, 4.5, dt=0.15)  # ends at 4.65 ... 12.0
        + steps("j.2", 91, 140, 12.0)
    )
    incarnations = (
        worlds("j.0", [100, 101, 102], 0.0)
        + worlds("j.1", [100, 101], 4.4)
        + worlds("j.2", [100, 101, 200], 11.9)
    )
    events = [
        event("FaultInjected", 4.05, spec="preempt:node=2@step=40", injected=True),
        event("ElasticScaling", 4.3, **{"from": 3, "to": 2, "in_place": True}),
        event("FaultInjected", 8.0, spec="capacity:+1@step=70", injected=True),
        event("ScalingRequested", 9.0, added=["node-2"], in_place=True),
        event("ElasticScaling", 11.8, **{"from": 2, "to": 3, "in_place": True}),
    ]
    return records, incarnations, events


def restart_run() -> tuple[list[StepRecord], list[WorldRecord], list[dict[str, Any]]]:
    """The same, restarting: steps 41-43 were done before the stop but the checkpoint
    holds step 40 (3 redone); the scale-up restarts from the step it saved (0 redone)."""
    records = steps("r.0", 1, 43, 0.0) + steps("r.1", 41, 90, 7.0) + steps("r.2", 91, 140, 15.0)
    incarnations = (
        worlds("r.0", [100, 101, 102], 0.0)
        + worlds("r.1", [300, 301], 6.5)
        + worlds("r.2", [400, 401, 402], 14.5)
    )
    events = [
        event("FaultInjected", 4.05, spec="preempt:node=2@step=40", injected=True),
        event("ScalingRequested", 4.5),
        event("ElasticScaling", 6.0, **{"from": 3, "to": 2}),
        event("FaultInjected", 10.0, spec="capacity:+1@step=70", injected=True),
        event("ScalingRequested", 11.0),
        event("ElasticScaling", 13.0, **{"from": 2, "to": 3}),
    ]
    return records, incarnations, events


def test_an_in_place_scaling_is_timed_from_the_injection_and_the_decision() -> None:
    record = elastic_figures(*in_process_run())
    assert record.down_path == IN_PROCESS and record.up_path == IN_PROCESS
    assert record.down_s == pytest.approx(4.65 - 4.05)
    assert record.down_from_decision_s == pytest.approx(4.65 - 4.3)  # ElasticScaling: no request
    assert record.down_stall_s == pytest.approx(4.65 - 4.0)
    assert record.up_s == pytest.approx(12.1 - 9.0)  # from the ScalingRequested
    assert record.up_from_capacity_s == pytest.approx(12.1 - 8.0)
    assert record.up_stall_s == pytest.approx(12.1 - 12.0)  # it trained on meanwhile
    assert (record.down_lost_steps, record.up_lost_steps, record.lost_steps) == (0, 0, 0)
    assert record.steps_per_s_before == pytest.approx(1 / DT)
    assert record.steps_per_s_between == pytest.approx(1 / 0.15)
    assert record.steps_per_s_after == pytest.approx(1 / DT)
    assert record.note == "" and record.completed
    assert [s["path"] for s in record.detail["scalings"]] == [IN_PROCESS, IN_PROCESS]


def test_a_restart_is_told_by_new_pids_and_its_redone_steps_are_counted() -> None:
    record = elastic_figures(*restart_run())
    assert record.down_path == RESTART and record.up_path == RESTART
    assert record.down_s == pytest.approx(7.1 - 4.05)
    assert record.down_from_decision_s == pytest.approx(7.1 - 4.5)  # the ScalingRequested
    assert record.down_lost_steps == 3 and record.up_lost_steps == 0
    assert record.lost_steps == 3  # steps 41-43 completed twice
    assert record.up_s == pytest.approx(15.1 - 11.0)
    assert record.up_from_capacity_s == pytest.approx(15.1 - 10.0)
    assert record.steps_per_s_between == pytest.approx(1 / DT)


def test_the_event_tells_the_path_when_the_pids_are_unknown_and_a_conflict_is_noted() -> None:
    records, incarnations, events = in_process_run()
    no_pids = [w for w in incarnations if w.incarnation != "j.1"] + [
        WorldRecord("j.1", 0, 2, 100, 4.4)
    ]
    assert elastic_figures(records, no_pids, events).down_path == IN_PROCESS
    # The event says in place but every pid changed: the pids win, and it is noted.
    moved = [WorldRecord(w.incarnation, w.rank, w.world, w.pid + 1000, w.time) for w in incarnations
             if w.incarnation == "j.1"]  # fmt: skip
    mixed = [w for w in incarnations if w.incarnation != "j.1"] + moved
    record = elastic_figures(records, mixed, events)
    assert record.down_path == RESTART
    assert "3 -> 2: the event says in_place=True, the pids say kept=False" in record.note


def test_a_run_without_a_scaling_has_no_figures_and_says_why() -> None:
    records = steps("x.0", 1, 60, 0.0)
    incarnations = worlds("x.0", [1, 2, 3], 0.0)
    events = [event("FaultInjected", 3.0, spec="preempt:node=2@step=30")]
    record = elastic_figures(records, incarnations, events, completed=False, note="job Failed")
    assert record.down_s is None and record.up_s is None and record.down_path is None
    assert record.note.startswith("job Failed; an injection was not recorded")
    assert "no step at a smaller world size after the preemption" in record.note
    assert record.lost_steps == 0


def test_worlds_file_tolerates_torn_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "worlds.txt"
    assert read_worlds(path) == []
    path.write_text("j.0 0 3 100 1.5\nj.0 1 3 101 1.6\ngarbage\nj.1 0 two 100 2.0\nj.1 0 2 1")
    expected = [WorldRecord("j.0", 0, 3, 100, 1.5), WorldRecord("j.0", 1, 3, 101, 1.6)]
    assert read_worlds(path) == expected


def results() -> dict[str, Any]:
    nothing = elastic_figures(steps("x.0", 1, 60, 0.0), worlds("x.0", [1, 2, 3], 0.0), [])
    ours = [nothing, elastic_figures(*in_process_run())]
    theirs = [elastic_figures(*restart_run()), elastic_figures(*restart_run())]
    res: dict[str, Any] = {
        "goals": {"down_s_ratio": 0.2, "down_lost_steps": 0, "up_s_ratio": 0.5},
        "trainguard_in_process": side_figures(ours),
        "baseline_checkpoint_restart": side_figures(theirs),
    }
    res["ratio"] = paired_ratios(res)
    return res


def test_ratios_pair_the_repetitions_and_the_table_reports_paths_and_targets() -> None:
    res = results()
    key = "trainguard_in_process_down_s_vs_baseline_checkpoint_restart"
    assert res["ratio"][key] == pytest.approx(0.6 / 3.05)  # repetition 2 only
    assert res["trainguard_in_process"]["paths"]["down"] == {"unknown": 1, IN_PROCESS: 1}
    assert res["baseline_checkpoint_restart"]["paths"]["up"] == {RESTART: 2}
    lines = markdown({"elastic": res}).splitlines()
    [path] = [line for line in lines if "path taken" in line]
    assert "in-process 1, unknown 1 / in-process 1, unknown 1" in path
    assert "checkpoint restart | restart / restart" in path
    [down] = [line for line in lines if "preemption -> first step at the smaller size" in line]
    assert "0.60 s" in down and "3.0 s" in down and "trainguard better" in down
    [down_goal] = [line for line in lines if "scale-down time / checkpoint-restart's" in line]
    assert "<= 0.20x" in down_goal and "meets the goal" in down_goal  # 0.197x
    [up_goal] = [line for line in lines if "scale-up time / checkpoint-restart's" in line]
    assert "<= 0.50x" in up_goal and "**misses the goal**" in up_goal  # 3.1 s / 4.1 s
    [lost_goal] = [line for line in lines if "steps lost (redone) (in process) | 0 (worst" in line]
    assert "meets the goal" in lost_goal
    [notes] = [line for line in lines if "notes of trainguard in process" in line]
    assert "an injection was not recorded" in notes


def test_the_elastic_jobs_are_valid_and_differ_only_in_in_process_restarts(
    tmp_path: Path,
) -> None:
    plan = ElasticPlan()
    jobs = (in_process_job(plan), checkpoint_restart_job(plan))
    specs = [job.spec(plan.args, tmp_path) for job in jobs]
    for spec in specs:
        job = TrainingJob.model_validate(spec)
        assert resolve_plan(job, "bench").nproc_per_node == 1
        assert job.spec.elastic_policy is not None
        policy = job.spec.elastic_policy
        assert (policy.min_replicas, policy.max_replicas) == (2, 3)
    ours, theirs = (TrainingJob.model_validate(s) for s in specs)
    assert ours.spec.trainguard.in_process_restart and not theirs.spec.trainguard.in_process_restart
    containers = [s["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"] for s in specs]
    commands = [c[0]["command"] for c in containers]
    assert [c[c.index("--ckpt") + 1] for c in commands] == ["resilient", "torch"]
    for command in commands:
        assert "--elastic" in command and command[command.index("--global-batch") + 1] == "96"
    assert plan.injections() == ["preempt:node=2@step=40", "capacity:+1@step=90"]


def test_the_scenario_is_registered_and_quick_runs_it_once() -> None:
    assert "elastic" in SCENARIOS
    assert QUICK.repeats == 1 and isinstance(QUICK.elastic.args, ElasticArgs)
