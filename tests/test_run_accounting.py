"""What a fault cost, as a job records it: the step reached, the step resumed from, and
the steps lost (redone) in between."""

from __future__ import annotations

import re

from conftest import SCRIPTS, Trainguard


def test_a_crash_resumed_from_an_older_checkpoint_counts_the_steps_redone(
    tg: Trainguard,
) -> None:
    """Rank 1 dies after step 58; the restart restores step 50 and logs every tenth
    step (its first line: step 60). 8 steps were redone, not 0 (the first line alone
    said "resumed from step 59": issue 39's "killed at step 208 and resumed from 200,
    reported as 0 steps lost")."""
    done = tg.run(
        "run", "--nnodes", "2", "--max-restarts", "1",
        str(SCRIPTS / "resume_steps.py"),
        "--kill-at", "58", "--resume-from", "50", "--steps", "100",
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    [fault] = job["faults"]
    assert fault["type"] == "WorkerCrash" and fault["rank"] == 1, fault
    assert (fault["fault_step"], fault["resumed_step"], fault["lost_steps"]) == (58, 50, 8)
    [recovered] = [e["message"] for e in job["events"] if e["kind"] == "Recovered"]
    assert re.search(r"at step 58 recovered in .*; resumed from step 50, 8 steps lost",
                     recovered), recovered  # fmt: skip
    assert "8 steps lost (at step 58, resumed from step 50)" in done.stderr, done.stderr
    assert job["accounting"]["lost_steps"] > 0, job["accounting"]
