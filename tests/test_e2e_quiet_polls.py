"""Quiet polls in a real job (control/pace.py): a job that trains steadily on one machine
is polled every 2 s, and a hang is still judged on fresh reports when its timer is due.

No ``--inject`` here (a rehearsal polls at ``pollIntervalSeconds`` throughout): the
workers themselves print steps, then all stop printing and sleep, as a job stuck in a
collective does.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from conftest import Trainguard, pid_alive, write_job

HANG_SECONDS = 6.0
"""The rule's recurring frequency: longer than a quiet interval's worth of stale
reports and a quiet poll (2 s + 2 s + 0.5 s), so the pace is quiet while lines come."""

SCRIPT = """
import sys, time
for step in range(1, 61):  # 3 s of steps
    print(f"Step {step} Loss: 1.0", flush=True)
    time.sleep(0.05)
time.sleep(3600)  # stuck, as in a collective that never completes
"""


@pytest.mark.e2e
def test_a_hang_is_found_after_its_timer_and_not_before(tg: Trainguard, tmp_path: Path) -> None:
    script = tmp_path / "steps_then_stuck.py"
    script.write_text(textwrap.dedent(SCRIPT))
    rule = {
        "name": "JobHang",
        "logPattern": ".*Loss:.*",
        "expectedRecurringFrequencyInSeconds": HANG_SECONDS,
    }
    spec = write_job(
        tmp_path / "job.yaml",
        "quiet",
        [sys.executable, str(script)],
        runPolicy={"jobMaxRetryCount": 0, "logMonitoringConfiguration": [rule]},
    )
    done = tg.run("run", "-f", str(spec), timeout=300)
    job = tg.only_job()
    assert done.returncode != 0, (done.stdout + done.stderr)[-3000:]
    for node in job["nodes"]:
        assert not any(pid_alive(p) for p in node["worker_pids"]), "orphan worker"
    [fault] = job["faults"]
    assert fault["type"] == "LogHang", fault
    since = fault["evidence"]["since"]  # the last line any rank printed
    # Not before its timer: the reports it was judged on were fresh (a line printed
    # after a quiet poll would otherwise look older than it is)...
    assert fault["detected_at"] - since > HANG_SECONDS
    # ... and at all, with slack for a loaded machine.
    assert fault["detected_at"] - since <= HANG_SECONDS + 10, fault
