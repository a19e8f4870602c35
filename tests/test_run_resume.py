"""A job outlives its controller: ``kill -9`` of ``trainguard run``, then
``trainguard resume`` re-attaches to the live agents (no restart, no lost step), or,
when the agents are gone too, restarts from the newest checkpoint under the same id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import SCRIPTS, Trainguard, pid_alive, wait_for, write_job
from trainguard.platform.local import MEMORY_ROOT

STEPS = 1500  # 10 ms each: ~15 s of training, killed a few seconds in


def jobs(tg: Trainguard) -> list[dict[str, Any]]:
    listed = tg.run("list", "-o", "json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    data: list[dict[str, Any]] = json.loads(listed.stdout)
    return data


def started(tg: Trainguard, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``trainguard run ARGS`` until its job has been recorded running some steps."""
    run = tg.popen("run", *args)
    wait_for(lambda: len(jobs(tg)) == 1, timeout=120)
    job = tg.only_job()
    return run, job


def kill_controller(run: subprocess.Popen[str], tg: Trainguard, job_id: str) -> None:
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=60)
    wait_for(lambda: tg.describe(job_id)["phase"] == "Lost", timeout=60)


def rank_steps(job: dict[str, Any], rank: int) -> list[int]:
    text = (Path(job["logs_dir"]) / f"rank-{rank}.log").read_text()
    return [int(n) for n in re.findall(r"^Step (\d+)$", text, re.MULTILINE)]


def test_resume_re_attaches_to_live_agents_with_no_restart_and_no_lost_step(
    tg: Trainguard,
) -> None:
    run, job = started(
        tg, "--nnodes", "2", "--nproc-per-node", "1", str(SCRIPTS / "step_worker.py"), str(STEPS)
    )
    job_id = job["id"]
    wait_for(lambda: len(rank_steps(tg.describe(job_id), 1)) >= 100, timeout=120)
    kill_controller(run, tg, job_id)
    lost = tg.describe(job_id)
    agents = [n["agent_pid"] for n in lost["nodes"]]
    workers = [p for n in lost["nodes"] for p in n["worker_pids"]]
    assert agents and all(pid_alive(p) for p in agents + workers)  # they train on

    done = tg.run("resume", job_id, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "re-attached to the 2 node agents" in done.stderr

    after = tg.describe(job_id)
    assert after["phase"] == "Succeeded" and after["restarts"] == 0
    assert [a["phase"] for a in after["attempts"]] == ["Succeeded"]  # the same attempt
    resumed = [e for e in after["events"] if e["kind"] == "Resumed"]
    assert [e["data"]["mode"] for e in resumed] == ["reattach"]
    for rank in (0, 1):  # every step once: nothing was redone, nothing skipped
        assert rank_steps(after, rank) == list(range(1, STEPS + 1))
    assert not any(pid_alive(p) for p in agents)  # shut down at the end, as usual
    # The ranks' lines from the kill on (they went to a pipe nobody read) are on the
    # resumed controller's terminal and in the job's combined log, to the last one.
    assert re.search(r"^\[rank[01]\]: Step \d+$", done.stdout, re.MULTILINE), done.stdout[-2000:]
    combined = tg.run("logs", job_id, timeout=60)
    assert combined.returncode == 0, combined.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: Step {STEPS}\n" in combined.stdout, combined.stdout[-2000:]


@pytest.mark.e2e
def test_resume_restarts_from_the_newest_checkpoint_when_the_agents_are_gone(
    tg: Trainguard, tmp_path: Path
) -> None:
    command = ["python", str(SCRIPTS / "ckpt_worker.py"), "--steps", "60", "--step-sleep", "0.1"]
    spec = write_job(
        tmp_path / "job.yaml", "ckpt", command, nprocPerNode=1,
        checkpointing={"durableEverySteps": 10},
    )  # fmt: skip
    run, job = started(tg, "-f", str(spec))
    job_id = job["id"]

    def committed() -> bool:
        events = tg.describe(job_id)["events"]
        return any(e["kind"] == "CheckpointCommitted" and e["data"]["step"] >= 20 for e in events)

    wait_for(committed, timeout=300)
    kill_controller(run, tg, job_id)
    lost = tg.describe(job_id)
    for node in lost["nodes"]:  # the agents die too (as with their machine)
        os.killpg(node["agent_pid"], signal.SIGKILL)
    wait_for(lambda: not any(pid_alive(n["agent_pid"]) for n in lost["nodes"]), timeout=60)

    # `trainguard run` of the same spec goes on with the Lost job (as `resume ckpt` would).
    done = tg.run("run", "-f", str(spec), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"job {job_id} ran this spec and is Lost" in done.stderr
    assert "restarting from the newest checkpoint" in done.stderr
    assert [j["id"] for j in jobs(tg)] == [job_id]
    after = tg.describe(job_id)  # the same id: its durable checkpoints were found
    assert after["phase"] == "Succeeded"
    assert [a["phase"] for a in after["attempts"]] == ["Failed", "Succeeded"]
    restored = [e for e in after["events"] if e["kind"] == "CheckpointRestored"]
    assert restored and all(e["attempt"] == 1 and e["data"]["step"] >= 20 for e in restored)
    assert after["restarts"] == 0  # not a fault of the job: no restart counted


def test_agents_stop_their_workers_and_free_memory_when_no_controller_comes_back(
    tg: Trainguard, tmp_path: Path
) -> None:
    command = ["python", str(SCRIPTS / "step_worker.py"), "100000"]
    spec = write_job(
        tmp_path / "job.yaml", "orphan", command, nprocPerNode=1,
        trainguard={"controllerGraceSeconds": 3},
    )  # fmt: skip
    run, job = started(tg, "-f", str(spec))
    job_id = job["id"]
    wait_for(lambda: len(rank_steps(tg.describe(job_id), 1)) >= 10, timeout=120)
    memory = MEMORY_ROOT / job_id
    assert memory.is_dir()
    kill_controller(run, tg, job_id)
    lost = tg.describe(job_id)
    pids = [n["agent_pid"] for n in lost["nodes"]] + [
        p for n in lost["nodes"] for p in n["worker_pids"]
    ]
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=90)
    assert not memory.exists()
    logs = "".join(p.read_text() for p in (Path(lost["job_dir"]) / "agents").glob("*.log"))
    assert "nobody attached within the grace period (3 s)" in logs
    assert tg.run("delete", job_id, timeout=120).returncode == 0
