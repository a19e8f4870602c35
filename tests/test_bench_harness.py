"""The benchmark harness's fast parts: step arithmetic, results and tables, the scale scenario.

No torch training here; the scale scenario runs for real at a few nodes (the real
LocalRunner, JobController and agent client against fleets of simulated agents).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import TrainingJob, resolve_plan

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench.agent_cost import Cost, measure_agent, parse_cpu_seconds, parse_status  # noqa: E402
from bench.recovery import FaultRecord, checkpointless_job, log_rules  # noqa: E402
from bench.report import markdown, summary  # noqa: E402
from bench.runs import TrainArgs, TrainguardJob, process_tree  # noqa: E402
from bench.scale import measure  # noqa: E402
from bench.steps import (  # noqa: E402
    StepRecord,
    goodput,
    read_steps,
    recovery_after,
    throughput,
)
from bench.suite import (  # noqa: E402
    AGENT_GOALS,
    DETECT_GOAL_S,
    _ratios,
    agent_figures,
    paired_ratios,
    scale_results,
)


def steps(incarnation: str, first: int, last: int, t0: float, dt: float = 1.0) -> list[StepRecord]:
    return [
        StepRecord(incarnation, s, t0 + (s - first) * dt, t0 + (s - first + 1) * dt)
        for s in range(first, last + 1)
    ]


def test_recovery_is_the_next_step_of_a_later_incarnation() -> None:
    # Steps 1..25 end at 1..25; the fault at 25.5; step 26 of the faulted incarnation was
    # in flight and still completed; the restart resumes from the checkpoint at 20.
    records = steps("a.0", 1, 26, 0.0) + steps("a.1", 21, 30, 40.0)
    recovery = recovery_after(records, 25.5)
    assert recovery is not None
    assert (recovery.fault_step, recovery.resumed_step, recovery.lost_steps) == (26, 20, 6)
    assert recovery.stall_s == pytest.approx(41.0 - 25.5)
    assert recovery_after(steps("a.0", 1, 26, 0.0), 25.5) is None  # never recovered


def test_goodput_counts_each_kept_step_once() -> None:
    # 10 one-second steps, a fault, steps 6..10 redone: 10 useful seconds in a 20 s window.
    records = steps("a.0", 1, 10, 0.0) + steps("a.1", 6, 10, 15.0)
    assert goodput(records, 0.0, 20.0) == pytest.approx(10 / 20)
    assert throughput(steps("a.0", 1, 20, 0.0, dt=0.5), skip=5) == pytest.approx(2.0)


def test_step_file_tolerates_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.txt"
    path.write_text("x.0 1 1.0 2.0\nx.0 2 2.0 3.0\nx.0 3 3.")
    assert [r.step for r in read_steps(path)] == [1, 2]
    assert read_steps(tmp_path / "missing.txt") == []


def fault_side(records: list[FaultRecord]) -> dict[str, Any]:
    metrics = ("stall_s", "lost_steps", "detect_s")
    side: dict[str, Any] = {m: summary([getattr(r, m) for r in records]) for m in metrics}
    side["recovered"] = sum(r.recovered for r in records)
    side["runs"] = [r.to_json() for r in records]
    return side


def results_fixture() -> dict[str, Any]:
    ok = [FaultRecord(True, 25, 20, 8.0 + i, 5, 0.5) for i in range(3)]
    relaunch = [FaultRecord(True, 25, 20, 12.0 + i, 5, 2.0) for i in range(3)]
    failed = [FaultRecord(False, 25, note="did not recover: connectFullMesh failed")] * 3
    in_process = [FaultRecord(True, 25, 25, 0.7 + i / 10, 0, 0.5) for i in range(3)]
    recovery: dict[str, Any] = {
        "trainguard": fault_side(ok),
        "trainguard_checkpointless": fault_side(in_process),
        "baseline_relaunch": fault_side(relaunch),
        "baseline_torchrun_max_restarts": fault_side(failed),
    }
    recovery["ratio"] = paired_ratios(recovery, ("stall_s", "lost_steps", "detect_s"))
    hang: dict[str, Any] = {
        "setup": {"cap_s": 30.0},
        "trainguard": fault_side(ok),
        "baseline_torchrun": fault_side([FaultRecord(False, 25, note="> 30 s")]),
    }
    hang["ratio"] = paired_ratios(hang, ("detect_s", "stall_s"))
    hang["ratio"] |= {"detect_s_vs_baseline_torchrun_at_most": 0.5 / 30}
    overhead: dict[str, Any] = {
        "trainguard": {"steps_per_s": summary([45.0, 47.0, 46.0])},
        "baseline_torchrun": {"steps_per_s": summary([50.0, 49.0, 51.0])},
    }
    overhead["ratio"] = _ratios(overhead, ("steps_per_s",))
    figures = {
        str(n): {
            "start_s": 0.01 * n,
            "stop_s": 0.002 * n,
            "stop_broadcast_s": 0.001 * n,
            "poll_cycle_s": 0.5 + 0.004 * n,
            "controller_rss_mib": 0.01 * n,
            "controller_rss_peak_mib": 40 + 0.01 * n,
        }
        for n in (256, 1024)
    }
    agent: dict[str, Any] = {
        "goals": AGENT_GOALS,
        "trainguard": agent_figures([Cost(0.3, 0.2, 36.0, 35.0), Cost(0.4, 0.2, 37.0, 36.0)]),
        "baseline_import_torch": agent_figures([Cost(3.0, 2.0, 625.0), Cost(2.8, 1.9, 626.0)]),
    }
    agent["ratio"] = _ratios(agent, ("start_s", "cpu_s", "rss_peak_mib"))
    recovery["goals"] = {"detect_s": DETECT_GOAL_S}
    return {
        "machine": {"cpu": "test cpu", "cores": 2, "ram_gib": 8, "torch": "x", "python": "3"},
        "agent": agent,
        "recovery": recovery,
        "hang": hang,
        "overhead": overhead,
        "scale": scale_results(figures),
    }


def test_results_have_trainguard_baselines_and_ratios() -> None:
    results = results_fixture()
    recovery = results["recovery"]
    assert recovery["ratio"]["stall_s_vs_baseline_relaunch"] == pytest.approx(9.0 / 13.0)
    assert recovery["ratio"]["stall_s_vs_baseline_torchrun_max_restarts"] is None
    ratio = recovery["ratio"]["trainguard_checkpointless_stall_s_vs_baseline_relaunch"]
    assert ratio == pytest.approx(0.8 / 13.0)
    scale = results["scale"]
    assert set(scale) >= {"trainguard", "baseline_linear_from_256", "ratio"}
    assert scale["growth_exponent"]["start_s"] == pytest.approx(1.0)


def test_table_says_where_trainguard_loses_and_what_failed() -> None:
    text = markdown(results_fixture())
    lines = text.splitlines()
    assert "test cpu, 2 cores" in text
    [slower] = [line for line in lines if line.startswith("| overhead")]
    assert "**trainguard worse**" in slower and "0.92x" in slower
    relaunch, in_process = [line for line in lines if "stall" in line and "relaunch" in line]
    assert "trainguard better" in relaunch and "9.0 s (8.0 s-10.0 s)" in relaunch
    assert "(checkpointless)" in in_process and "0.80 s (0.70 s-0.90 s)" in in_process
    assert "0.06x" in in_process
    assert any("did not recover (0/3 runs)" in line for line in lines)
    assert any("none within the 30 s cap" in line and "< 0.02x" in line for line in lines)
    assert "connectFullMesh" in text  # the failed baseline's reason is in the notes
    assert "| 1024 |" in text and "N^1.00" in text
    [decision] = [line for line in lines if "fault decision | 500 ms | goal" in line]
    assert "500 ms" in decision and "<= 150 ms" in decision and "**misses the goal**" in decision
    relaunch_detect = [line for line in lines if "fault decision" in line and "relaunch" in line]
    assert len(relaunch_detect) == 2  # plain and checkpointless; torchrun measures none
    assert not [line for line in lines if "fault decision" in line and "max restarts" in line]
    [serving_goal] = [line for line in lines if "spawn -> serving" in line and "goal" in line]
    assert "0.35 s (0.30 s-0.40 s)" in serving_goal and "meets the goal" in serving_goal
    [memory] = [line for line in lines if "peak memory" in line and "import torch" in line]
    assert "36 MiB" in memory and "625 MiB" in memory and "0.06x" in memory


def test_scale_goals_are_checked_at_4096_nodes_and_growth_from_256() -> None:
    figures = {
        str(n): {
            "start_s": 0.001 * n,
            "detect_s": 0.01,
            "stop_s": 0.0001 * n * (n / 256) ** 0.2,
            "stop_broadcast_s": 0.0001 * n,
            "poll_cycle_s": 0.0002 * n,
            "controller_rss_mib": 0.01 * n,
            "controller_rss_peak_mib": 50 + 0.04 * n,
        }
        for n in (256, 1024, 4096, 16384)
    }
    scale = scale_results(figures)
    assert scale["growth_exponent_to_goal"]["start_s"] == pytest.approx(1.0)
    assert scale["growth_exponent_to_goal"]["stop_s"] == pytest.approx(1.2)
    lines = markdown({"scale": scale}).splitlines()
    [start] = [line for line in lines if line.startswith("| scale | assign + start all, 4096")]
    assert "4.1 s" in start and "<= 2.0 s" in start and "**misses the goal**" in start
    [memory] = [line for line in lines if "controller peak memory, 4096" in line]
    assert "224 MB" in memory and "**misses the goal**" in memory  # 213.84 MiB
    [growth] = [line for line in lines if "growth of fault -> last /stop, 256 -> 4096" in line]
    assert "N^1.20" in growth and "<= N^1.10" in growth and "misses" in growth
    [linear] = [line for line in lines if "assign + start all, 16384 nodes" in line]
    assert "linear growth from 256 nodes" in linear and "linear or better" in linear
    assert "| 16384 |" in "\n".join(lines) and "256 -> 4096 nodes:" in "\n".join(lines)


def test_table_only_rebuilds_the_report_and_bad_scenarios_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results_fixture()))
    run = [sys.executable, "-m", "bench"]
    done = subprocess.run(
        [*run, "--table-only", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == markdown(results_fixture())
    bad = subprocess.run(
        [*run, "--only", "recovery,speed"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "speed" in bad.stderr


def test_the_benchmark_job_is_a_valid_training_job(tmp_path: Path) -> None:
    job = TrainguardJob("bench-test", retries=3, log_rules=log_rules())
    spec = job.spec(TrainArgs(steps=10), tmp_path / "out")
    plan = resolve_plan(TrainingJob.model_validate(spec), "bench")
    assert (plan.nnodes, plan.nproc_per_node, plan.max_restarts) == (2, 2, 3)
    assert (
        "--ckpt" in spec["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
    )


def test_the_checkpointless_job_restarts_in_process_with_a_spare_on_every_node(
    tmp_path: Path,
) -> None:
    spec = checkpointless_job("bench-test", retries=3).spec(TrainArgs(steps=10), tmp_path)
    job = TrainingJob.model_validate(spec)
    assert job.spec.trainguard.in_process_restart
    assert job.spec.trainguard.hot_spares == 2  # one on each of the 2 nodes
    command = spec["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--ckpt") + 1] == "resilient"


def test_process_tree_signals_only_the_processes_it_saw(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; subprocess.Popen(['sleep','60']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(tree := process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree[0].pid == parent.pid and len(tree) == 2
        for proc in tree:
            proc.signal(signal.SIGKILL)
        assert parent.wait(30) == -signal.SIGKILL
        tree[0].signal(signal.SIGKILL)  # gone: a no-op, not an error
    finally:
        parent.kill()
        parent.wait()


def test_scale_scenario_drives_the_real_runner_at_a_few_nodes(tmp_path: Path) -> None:
    figures = measure(6, tmp_path, nproc=2)
    assert figures["phase"] == "Failed", figures
    assert "rank 6 exited with signal SIGKILL" in figures["reason"]
    for key in ("start_s", "push_s", "stop_s", "stop_broadcast_s", "poll_cycle_s"):
        assert figures[key] >= 0, (key, figures)
    # The Fault event is stamped with the loop turn's time, taken just before the turn
    # reads the reports: it may precede the failure by that much.
    assert figures["detect_s"] > -0.5, figures
    assert figures["stop_s"] >= figures["detect_s"]
    assert len(figures["poll_cycles_s"]) >= 3  # full cycles of every node, all running
    assert figures["controller_rss_peak_mib"] > 0
    assert figures["pushes"] >= 1 and not figures["push_failures"], figures


def test_agent_cost_reads_proc_and_measures_the_real_agent(tmp_path: Path) -> None:
    status = "Name:\tpython\nVmHWM:\t   36288 kB\nVmRSS:\t   35000 kB\nThreads:\t4\n"
    assert parse_status(status) == {"VmHWM": 36288, "VmRSS": 35000}
    stat = "123 (py (x) y) S 1 2 3 4 5 6 7 8 9 10 150 50 0 0 20 0 4 0 99"
    assert parse_cpu_seconds(stat, 100) == pytest.approx(2.0)
    cost = measure_agent(tmp_path)  # the agent imports no torch: well under a second
    assert cost.start_s > 0 and cost.cpu_s >= 0
    assert cost.rss_mib is not None and 0 < cost.rss_mib <= cost.rss_peak_mib


def test_a_baseline_that_recovered_sometimes_is_compared_in_those_runs_only() -> None:
    ours = [FaultRecord(True, 25, 20, stall, 0, 0.5) for stall in (8.0, 9.0, 7.0)]
    theirs = [FaultRecord(False, 25), FaultRecord(False, 25), FaultRecord(True, 25, 20, 10.5, 0)]
    res: dict[str, Any] = {"trainguard": fault_side(ours), "baseline_torchrun": fault_side(theirs)}
    res["ratio"] = paired_ratios(res, ("stall_s", "lost_steps"))
    assert res["ratio"]["stall_s_vs_baseline_torchrun"] == pytest.approx(7.0 / 10.5)
    assert res["ratio"]["lost_steps_vs_baseline_torchrun"] == 1.0  # 0 lost on both sides
    lines = markdown({"recovery": res}).splitlines()
    [stall] = [line for line in lines if "stall" in line]
    assert "10.5 s [1/3 runs]" in stall and "0.67x" in stall and "recovered in 1/3" in stall
    [lost] = [line for line in lines if "steps lost" in line]
    assert "| even" in lost


def test_lost_time_parts_add_up_to_the_window() -> None:
    """Steps of 1 s with 0.1 s gaps from t=5; a kill at 16 (decided at 16.05) after step
    10; the next incarnation resumes at step 9 at t=18 with a 2 s first step."""
    from bench.lost_time import breakdown

    old = [StepRecord("a", i, 5 + (i - 1) * 1.1, 6 + (i - 1) * 1.1) for i in range(1, 11)]
    new = [StepRecord("b", 9, 18.0, 20.0)]
    new += [StepRecord("b", k, 20.1 + (k - 10) * 1.1, 21.1 + (k - 10) * 1.1) for k in range(10, 21)]
    lost = breakdown(old + new, 0.0, 40.0, kills=[16.0], decisions=[16.05])
    assert lost["useful"] == pytest.approx(21.0)  # steps 1-8 of a, 9-20 of b
    assert lost["start-up"] == pytest.approx(5.0)
    assert lost["detection"] == pytest.approx(0.05)
    assert lost["stall"] == pytest.approx(1.95)
    assert lost["redone steps"] == pytest.approx(2.0)  # a's steps 9 and 10
    assert lost["between steps"] == pytest.approx(2.0)  # 20 gaps of 0.1 s outside the stall
    assert lost["other"] == pytest.approx(8.0)  # 15.9-16.0, and the window's end after 32.1
    assert lost["slow steps after recovery"] == pytest.approx(1.0)
    parts = ("useful", "start-up", "detection", "stall", "redone steps", "between steps", "other")
    assert sum(lost[p] for p in parts) == pytest.approx(lost["window"])
