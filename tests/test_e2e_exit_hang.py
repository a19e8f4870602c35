"""A rank that never exits after its work, while every other rank exited 0: the job ends
with an ExitHang (its stacks captured) within the bound, and succeeds when the rank's
work was done (control/exit_hang.py). Light workers, no torch."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from conftest import REPO, Trainguard, write_job

WORKER = REPO / "tests" / "scripts" / "linger_worker.py"
BOUND = 3.0


def run_job(tg: Trainguard, tmp_path: Path, *args: str) -> dict[str, Any]:
    spec = write_job(
        tmp_path / "job.yaml",
        "linger",
        [sys.executable, "-u", str(WORKER), *args],
        trainguard={"exitHangTimeoutSeconds": BOUND},
    )
    done = tg.run("run", "-f", str(spec), timeout=240)
    return {"run": done, "job": tg.only_job()}


def test_a_rank_that_never_exits_after_its_work_ends_as_exit_hang_and_the_job_succeeds(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = run_job(tg, tmp_path, "--linger-rank", "3")
    job = out["job"]
    assert out["run"].returncode == 0, out["run"].stderr[-3000:]
    assert job["phase"] == "Succeeded" and job["restarts"] == 0
    assert "ended as ExitHang" in job["reason"]
    [fault] = job["faults"]
    assert fault["type"] == "ExitHang" and fault["rank"] == 3 and fault["node"] == "node-1"
    evidence = fault["evidence"]
    assert evidence["finished"] is True and evidence["judged_by"] == "steps"
    # Its stacks: the process state, and py-spy's dump of the rank blocked in its wait.
    stack = evidence["stacks"]["3"]
    assert "state S" in stack and "linger_worker.py" in stack, stack
    # Within the bound: detected BOUND s (plus a poll) after the others exited.
    waited = fault["detected_at"] - evidence["lingering_since"]
    assert BOUND <= waited < BOUND + 5, waited
    text = tg.run("describe", job["id"]).stdout
    assert "ExitHang" in text and "linger_worker.py" in text  # the stacks, in describe too


def test_an_exit_hang_short_of_the_others_last_step_fails_the_job(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = run_job(tg, tmp_path, "--linger-rank", "1", "--short", "5")
    job = out["job"]
    assert out["run"].returncode == 1
    assert job["phase"] == "Failed"
    [fault] = job["faults"]
    assert fault["type"] == "ExitHang" and fault["evidence"]["finished"] is False
    assert fault["evidence"]["unfinished"] == [1]
    assert "had not reached step 20" in fault["message"]


def test_a_hang_without_any_log_rule_is_found_by_its_missing_progress(
    tg: Trainguard, tmp_path: Path
) -> None:
    """--inject hang on a job that prints Step N and has no log rule: the hung rank stops
    making progress while the other goes on; a NoProgress fault (its stacks captured)
    restarts the job, which completes."""
    worker = REPO / "tests" / "scripts" / "step_worker.py"
    spec = write_job(
        tmp_path / "job.yaml",
        "stall",
        [sys.executable, "-u", str(worker), "1200"],  # rank 0 ends 11 s after the hang
        runPolicy={"jobMaxRetryCount": 1},
        trainguard={"noProgressTimeoutSeconds": 5},  # a loaded machine stalled a step 3 s
    )
    done = tg.run("run", "-f", str(spec), "--inject", "hang:rank=1@step=100", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    job = tg.only_job()
    [fault] = job["faults"]
    assert fault["type"] == "NoProgress" and fault["rank"] == 1, fault
    assert re.search(r"rank 1 completed no step after step (9\d|10\d) for", fault["message"])
    stack = fault["evidence"]["stacks"]["1"]
    assert "state T (stopped)" in stack, stack  # the SIGSTOPped rank, as it was
    assert job["restarts"] == 1 and job["phase"] == "Succeeded"
