"""Step-triggered injections are carried out by the agent, at the named step."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import SCRIPTS, Trainguard


def steps_printed(log: Path) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"Step (\d+)", log.read_text())]


def test_a_step_injection_hits_the_named_step_once(tg: Trainguard) -> None:
    """10 ms steps: the kill lands within one step of step 50, and the restarted
    attempt, which passes step 50 again, is left alone (an injection fires once)."""
    done = tg.run(
        "run",
        "--nnodes",
        "2",
        "--max-restarts",
        "1",
        "--inject",
        "kill:rank=1@step=50",
        str(SCRIPTS / "step_worker.py"),
        "300",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    [event] = [e for e in job["events"] if e["kind"] == "FaultInjected"]
    assert event["rank"] == 1 and event["node"] == "node-1"
    assert event["data"]["step"] in (50, 51), event
    [fault] = job["faults"]
    assert fault["evidence"]["injected"] == "kill:rank=1@step=50"
    logs = Path(job["logs_dir"])
    killed = steps_printed(logs / "attempt-0" / "rank-1" / "stdout.log")
    assert killed[-1] in (50, 51), killed[-5:]
    assert steps_printed(logs / "attempt-1" / "rank-1" / "stdout.log")[-1] == 300
