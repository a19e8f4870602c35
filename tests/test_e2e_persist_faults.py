"""A persist in flight when an agent dies is failed, asked for again, and the job's
durable checkpoints go on (issue 38): a real 4-rank DDP job (2 nodes x 2), memory tier
every step, durable every 20 steps.

Regression: node-1's agent SIGKILLed while ``CheckpointPersisting`` ran; the job restored
the step from memory and trained to its end, but no persist ever started again, and it
ended Succeeded with its newest durable step long behind and no word of it.

The agent is SIGSTOPped the moment the controller announces a persist (the controller
says so before it sends the request), and SIGKILLed only if the step is not committed by
then (else the next persist is tried): the kill lands before the commit, at whichever
phase the agent had reached (request not yet received, shards being written, the
committing node waiting for the other's shards).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
from pathlib import Path
from typing import IO

import pytest

from conftest import SCRIPTS, Trainguard, write_job
from trainguard.checkpoint.durable import DurableTier

pytestmark = pytest.mark.e2e
STEPS = 100
PERSISTING = re.compile(r"CheckpointPersisting: persisting step (\d+) ")


def _lines(stream: IO[str], into: queue.Queue[str], keep: list[str]) -> None:
    for line in stream:
        keep.append(line)
        into.put(line)


def _next(lines: queue.Queue[str], pattern: re.Pattern[str]) -> re.Match[str]:
    while True:
        line = lines.get(timeout=120)
        match = pattern.search(line)
        if match is not None:
            return match


@pytest.mark.parametrize(
    "target", ["node-1", "node-0", pytest.param("controller", marks=pytest.mark.long)]
)
def test_a_fault_during_a_persist_does_not_end_persisting(
    tg: Trainguard, tmp_path: Path, target: str
) -> None:
    """``node-1``: the agent of a node that writes shards; ``node-0``: the committing
    node's; ``controller``: ``trainguard run`` itself, then ``trainguard resume``."""
    command = ["python", str(SCRIPTS / "ckpt_worker.py"), "--steps", str(STEPS)]
    spec = write_job(
        tmp_path / "job.yaml",
        "persist-kill",
        [*command, "--step-sleep", "0.1"],
        runPolicy={"jobMaxRetryCount": 2},
        checkpointing={"memoryEverySteps": 1, "replicas": 1, "durableEverySteps": 20},
    )
    proc = tg.popen("run", "-f", str(spec))
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    out: list[str] = []
    readers = [
        threading.Thread(target=_lines, args=(s, lines, out), daemon=True)
        for s in (proc.stdout, proc.stderr)
    ]
    for reader in readers:
        reader.start()
    killed = None
    try:
        job_id = _next(lines, re.compile(r"job (\S+): 2 nodes")).group(1)
        _next(lines, re.compile("AttemptStarted"))
        job = tg.describe(job_id)
        pids = {n["node_id"]: n["agent_pid"] for n in job["nodes"]}
        pid = proc.pid if target == "controller" else pids[target]
        tier = DurableTier(str(Path(job["job_dir"]) / "durable"), job_id)
        while killed is None:
            step = int(_next(lines, PERSISTING).group(1))
            assert step < STEPS, "no persist was caught before its commit"
            os.kill(pid, signal.SIGSTOP)
            if step in tier.committed_steps():
                os.kill(pid, signal.SIGCONT)  # too late for this one: the next
                continue
            os.kill(pid, signal.SIGKILL)
            killed = step
        proc.wait(timeout=300)
        if target == "controller":
            resumed = tg.run("resume", job_id, timeout=300)
            out.append(resumed.stdout + resumed.stderr)
            proc.returncode = resumed.returncode
    finally:
        if proc.poll() is None:
            proc.kill()  # the controller by its pid; its agents follow it
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
    output = "".join(out)
    assert proc.returncode == 0, output[-4000:]
    job = tg.describe(job_id)
    events = [(e["kind"], e["data"].get("step"), e["message"]) for e in job["events"]]
    if target != "controller":  # a resumed controller knows nothing of the old request
        failed = [m for k, s, m in events if k == "CheckpointPersistFailed" and s == killed]
        assert failed, f"the persist of step {killed} in flight never failed:\n{output}"
    committed = [s for k, s, _ in events if k == "CheckpointCommitted"]
    assert [s for s in committed if s > killed], f"no persist after step {killed}:\n{output}"
    assert tier.committed_steps()[-1] == STEPS, "the final step is durable"
    assert job["checkpoints"]["durable_step"] == STEPS and not job["checkpoints"]["missing"]
    assert "CheckpointNotDurable" not in {k for k, _, _ in events}
    text = tg.run("describe", job_id).stdout
    assert f"Durable:   step {STEPS}" in text, text


def test_a_job_whose_steps_never_become_durable_ends_with_a_warning(
    tg: Trainguard, tmp_path: Path
) -> None:
    """The durable tier cannot be written (its path runs through a file): every persist
    fails, each an event, and the job ends Succeeded (exit 0, the training completed)
    with a warning line and ``describe`` saying its final step is not durable."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    command = ["python", str(SCRIPTS / "ckpt_worker.py"), "--steps", "20"]
    spec = write_job(
        tmp_path / "job.yaml",
        "never-durable",
        [*command, "--step-sleep", "0.05"],
        checkpointing={"durableUrl": str(blocker / "durable"), "durableEverySteps": 10},
    )
    done = tg.run("run", "-f", str(spec), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    warning = "warning: step 20, the newest the schedule asked to persist, is not in durable"
    assert re.search(rf"^\[trainguard\] {warning}", output, re.MULTILINE), output[-4000:]
    job = tg.only_job()
    assert job["phase"] == "Succeeded"
    assert job["checkpoints"] == {
        "durable_step": None,
        "asked_step": 20,
        "missing": True,
        "failed_persists": job["checkpoints"]["failed_persists"],
    }
    assert job["checkpoints"]["failed_persists"] >= 2, "step 10 and the final step 20"
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.index("CheckpointNotDurable") < kinds.index("JobSucceeded")
    text = tg.run("describe", job["id"]).stdout
    assert "Durable:   none (the schedule asked for 20: not durable)" in text, text
