"""trainguard inside a real Slurm allocation (tests/slurm_cluster.py: slurmctld and one
slurmd per network-namespace host). Needs root; skipped elsewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.e2e, pytest.mark.long]

STEPS = str(REPO / "tests" / "scripts" / "step_worker.py")
Make = Callable[..., SlurmCluster]


def spec_file(tmp: Path, command: list[str], replicas: int = 2, **extra: Any) -> Path:
    spec: dict[str, Any] = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "slurmjob"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {
                    "name": "workers",
                    "replicas": replicas,
                    "template": {"spec": {"containers": [{"name": "t", "command": command}]}},
                }
            ],
            "runPolicy": {"jobMaxRetryCount": 2},
            **extra,
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def batch_script(state: Path, *run_args: str) -> str:
    """A hand-written sbatch script: `trainguard run` as a user would put it."""
    args = " ".join(run_args)
    return (
        "#!/bin/sh\n"
        f"export TRAINGUARD_STATE_DIR={state}\n"
        f"cd {REPO}\n"
        f"exec {sys.executable} -m trainguard.cli run {args}\n"
    )


def describe(state: Path) -> dict[str, Any]:
    env = {**os.environ, "TRAINGUARD_STATE_DIR": str(state)}
    run = [sys.executable, "-m", "trainguard.cli"]
    jobs = json.loads(subprocess.run([*run, "list", "-o", "json"], env=env, capture_output=True,
                                     text=True, check=True, cwd=REPO).stdout)  # fmt: skip
    [job] = [j for j in jobs if "slurm" in j["id"]]
    done = subprocess.run([*run, "describe", job["id"], "-o", "json"], env=env,
                          capture_output=True, text=True, check=True, cwd=REPO)  # fmt: skip
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_a_batch_script_runs_the_job_on_the_allocation_and_a_killed_rank_restarts(
    slurm_cluster: Make, tmp_path: Path
) -> None:
    """2 replicas in a 3-node allocation (the third node is the job's spare); rank 1 is
    SIGKILLed and restarted; the job completes and the Slurm job with it."""
    cluster = slurm_cluster(3)
    spec = spec_file(tmp_path, [sys.executable, "-u", STEPS, "300"])
    script = batch_script(tmp_path / "state", "-f", str(spec), "--inject", "kill:rank=1@step=100")
    job = cluster.sbatch(script, "--nodes=3", "--no-kill")
    record = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    out = cluster.output(job)
    assert record["JobState"] == "COMPLETED", out[-4000:]
    assert "controller and node 0 on node0; 2 more nodes join" in out
    data = describe(tmp_path / "state")
    assert data["phase"] == "Succeeded" and data["restarts"] == 1
    [fault] = data["faults"]
    assert fault["type"] == "WorkerCrash" and fault["rank"] == 1
    hosts = sorted(n["agent_url"].split("//")[1].split(":")[0] for n in data["nodes"])
    assert len(set(hosts)) == 2  # two nodes of the allocation, not loopback


def test_a_node_cut_off_is_drained_and_the_job_goes_on_in_place_on_the_spare(
    slurm_cluster: Make, tmp_path: Path
) -> None:
    """The GPT example in resilient mode, 2 replicas and a spare node: node1 is cut off;
    Slurm's node is drained with a reason naming trainguard, the spare takes its ranks in
    place, and no step is lost."""
    cluster = slurm_cluster(3)
    spec = yaml.safe_load((REPO / "examples" / "gpt" / "job-resilient.yaml").read_text())
    spec["spec"]["trainguard"]["partitionTimeoutSeconds"] = 10
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    job = cluster.sbatch(
        batch_script(tmp_path / "state", "-f", str(path)), "--nodes=3", "--no-kill"
    )
    cluster.wait_state(job, {"RUNNING"}, 60)
    wait_for(lambda: "Batch 120" in cluster.output(job), 240, "training never reached 120")
    found = re.search(r"host (\S+) \(\S+\) joined as node-1 \(node\)", cluster.output(job))
    assert found is not None, cluster.output(job)[-3000:]
    [lost] = [h for h in cluster.hosts.hosts if h.name == found.group(1)]
    cluster.hosts.cut(lost)
    record = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 400)
    out = cluster.output(job)
    assert record["JobState"] == "COMPLETED", out[-4000:]
    assert f"Slurm node {lost.name} drained (NodeLost)" in out, out[-4000:]
    node = cluster.node(lost.name)
    assert "trainguard: NodeLost of node-1" in node.get("Reason", ""), node
    recovered = re.search(r"recovered in [\d.]+s \(in-process restart\); resumed from step "
                          r"\d+, (\d+) steps lost", out)  # fmt: skip
    assert recovered is not None and recovered.group(1) == "0", out[-4000:]
    cluster.hosts.restore(lost)


def test_scancel_stops_every_rank_and_the_job_says_so(slurm_cluster: Make, tmp_path: Path) -> None:
    cluster = slurm_cluster(2)
    spec = spec_file(tmp_path, [sys.executable, "-u", STEPS, "100000"])
    job = cluster.sbatch(
        batch_script(tmp_path / "state", "-f", str(spec)), "--nodes=2", "--no-kill"
    )
    wait_for(lambda: "Step 200" in cluster.output(job), 180, "never trained")
    cluster.command("scancel", str(job))
    cluster.wait_state(job, {"CANCELLED"}, 60)
    wait_for(lambda: describe(tmp_path / "state")["phase"] != "Running", 60, "still Running")
    data = describe(tmp_path / "state")
    assert data["phase"] == "Stopped", cluster.output(job)[-3000:]
    wait_for(lambda: not _workers_alive(), 30, "workers still alive")


def _workers_alive() -> bool:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if STEPS in (proc / "cmdline").read_text().replace("\0", " "):
                    state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        return True
            except OSError:
                continue
    return False


def test_submit_runs_the_job_and_with_no_node_left_it_requeues_and_resumes_from_durable(
    slurm_cluster: Make, tmp_path: Path
) -> None:
    """``trainguard submit --slurm``: 2 replicas, no spare, in a 3-node partition. node-1's
    host is cut off: it is drained, no node of the allocation is left to replace it, so
    the job requeues itself; Slurm runs it again on the two nodes left, and the run
    resumes the same trainguard job from its checkpoint and completes."""
    cluster = slurm_cluster(3)
    state = tmp_path / "state"
    command = [sys.executable, "-u", str(REPO / "tests" / "scripts" / "ckpt_worker.py"),
               "--steps", "150", "--step-sleep", "0.1"]  # fmt: skip
    spec = spec_file(
        tmp_path,
        command,
        checkpointing={"durableUrl": str(tmp_path / "durable"), "durableEverySteps": 10},
        trainguard={"partitionTimeoutSeconds": 10, "maxRequeues": 2},
    )
    env = {**cluster.env, "TRAINGUARD_STATE_DIR": str(state)}
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "submit", "--slurm", "-f", str(spec),
         "--time=20"], env=env, capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = re.search(r"Submitted Slurm job (\d+)", done.stdout)
    assert found is not None, done.stdout
    job = int(found.group(1))
    [script] = (state / "slurm").glob("slurmjob-*.sbatch")
    assert "#SBATCH --nodes=2" in script.read_text() and "--no-kill" in script.read_text()

    def output() -> str:
        path = state / "slurm" / f"slurmjob-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    wait_for(lambda: "Batch 40 " in output(), 240, "training never reached step 40")
    joined = re.search(r"host (\S+) \(\S+\) joined as node-1 \(node\)", output())
    assert joined is not None, output()[-3000:]
    [lost] = [h for h in cluster.hosts.hosts if h.name == joined.group(1)]
    cluster.hosts.cut(lost)
    record = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 420)
    out = output()
    assert record["JobState"] == "COMPLETED", out[-4000:]
    assert record["Restarts"] == "1", record
    assert f"Slurm node {lost.name} drained (NodeLost)" in out, out[-4000:]
    assert "requeuing Slurm job" in out and "(requeued 1 times)" in out, out[-4000:]
    restored = [int(s) for s in re.findall(r"rank \d+ attempt \d+ restored step (\d+)", out)]
    assert restored and min(restored) >= 10, out[-4000:]  # not from the start
    assert "saved step 150" in out
    data = describe(state)
    assert data["id"] == f"slurmjob-slurm{job}" and data["phase"] == "Succeeded", data["phase"]
    cluster.hosts.restore(lost)
