"""Elastic training on this machine: an unmodified script scaled down (a node preempted)
and back up (capacity returns) through process restarts at the new WORLD_SIZE."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import SCRIPTS, Trainguard, wait_for
from trainguard.platform.store import Store

WORKER = str(SCRIPTS / "world_steps.py")


def job_file(tmp_path: Path, steps: int, elastic: dict[str, Any] | None) -> Path:
    spec: dict[str, Any] = {
        "nprocPerNode": 1,
        "replicaSpecs": [
            {
                "name": "pods",
                "replicas": 2,
                "template": {
                    "spec": {
                        "containers": [{"name": "t", "command": ["python", WORKER, str(steps)]}]
                    }
                },
            }
        ],
        "trainguard": {"pollIntervalSeconds": 0.3},
    }
    if elastic is not None:
        spec["elasticPolicy"] = elastic
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"apiVersion": "trainguard.dev/v1", "kind": "TrainingJob",
                                "metadata": {"name": "elastic"}, "spec": spec}))  # fmt: skip
    return path


ELASTIC = {"minReplicas": 1, "maxReplicas": 3, "scalingTimeoutInSeconds": 1}


def sizes(job: dict[str, Any]) -> list[int]:
    return [len(e["data"]["nodes"]) for e in job["events"] if e["kind"] == "AttemptStarted"]


def started(tg: Trainguard) -> tuple[str | None, list[int]]:
    """The job's id and its attempts' sizes so far, read from the store in this process
    (polling the CLI would spawn an interpreter every 0.1 s on a 2-core machine)."""
    if not (tg.state_dir / "trainguard.db").exists():
        return None, []
    store = Store(tg.state_dir)
    try:
        jobs = store.jobs()
        if not jobs:
            return None, []
        events = store.events(jobs[0].id)
        return jobs[0].id, [len(e.data["nodes"]) for e in events if e.kind == "AttemptStarted"]
    finally:
        store.close()


def worlds(job: dict[str, Any], attempt: int) -> set[str]:
    """The WORLD_SIZE each rank of ``attempt`` printed."""
    out = set()
    for log in Path(job["logs_dir"]).glob(f"attempt-{attempt}/rank-*/stdout.log"):
        found = re.search(r"world (\d+) rank", log.read_text())
        assert found, log
        out.add(found.group(1))
    return out


def test_preempted_then_given_capacity_the_job_scales_down_and_up_and_completes(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 700, {**ELASTIC, "gracefulShutdownTimeoutInSeconds": 2})
    done = tg.run(
        "run", "-f", str(path), "--inject", "preempt:node=1@1s", "--inject", "capacity:+2@3s",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    assert sizes(job) == [2, 1, 3]
    assert [worlds(job, a) for a in range(3)] == [{"2"}, {"1"}, {"3"}]
    assert job["restarts"] == 0 and job["faults"] == []  # scalings are not faults
    scalings = [e for e in job["events"] if e["kind"] == "ElasticScaling"]
    assert [(e["data"]["from"], e["data"]["to"]) for e in scalings] == [(2, 1), (1, 3)]
    assert scalings[0]["data"]["dropped"] == ["node-1"]


def test_trainguard_scale_gives_a_running_job_more_nodes(tg: Trainguard, tmp_path: Path) -> None:
    run = tg.popen("run", "-f", str(job_file(tmp_path, 2500, ELASTIC)))
    job_id = "elastic"
    try:
        wait_for(lambda: started(tg)[1] == [2], 120)
        job_id = str(started(tg)[0])
        done = tg.run("scale", job_id, "--capacity", "3")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: started(tg)[1] == [2, 3], 120)
    finally:
        tg.run("delete", "--force", job_id, timeout=120)
        run.wait(60)


def test_scale_needs_an_elastic_running_job(tg: Trainguard, tmp_path: Path) -> None:
    run = tg.popen("run", "-f", str(job_file(tmp_path, 2500, None)))
    job_id = "elastic"
    try:
        wait_for(lambda: started(tg)[1] == [2], 120)
        job_id = str(started(tg)[0])
        done = tg.run("scale", job_id, "--capacity", "3")
        assert done.returncode == 2 and "no spec.elasticPolicy" in done.stderr
    finally:
        tg.run("delete", "--force", job_id, timeout=120)
        run.wait(60)
    bad = job_file(tmp_path, 5, {"minReplicas": 3, "maxReplicas": 4})
    done = tg.run("run", "-f", str(bad), timeout=60)
    assert done.returncode == 2
    assert "spec.elasticPolicy.minReplicas: must be <= the job's replicas (2)" in done.stderr


@pytest.mark.e2e
def test_a_script_with_trainguard_elastic_saves_and_resumes_every_sample_once(
    tg: Trainguard, tmp_path: Path
) -> None:
    """4(b): the ranks see the request at the same step, save and exit; the restarted
    job takes the epoch up where it was, at the new world size, global batch kept."""
    out = tmp_path / "out"
    out.mkdir()
    path = job_file(tmp_path, 0, {**ELASTIC, "gracefulShutdownTimeoutInSeconds": 30})
    job = json.loads(path.read_text())
    container = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    # Long enough to last at WORLD_SIZE 1 until the new nodes are up (two torch imports
    # on a busy machine) and the job grows: 400 steps of 12 samples, at least 20 s (at a
    # load of 6 and more, 250 steps ended before the two new nodes were up).
    epoch = 4800
    container["command"] = ["python", str(SCRIPTS / "elastic_train.py"), str(out), str(epoch)]
    path.write_text(json.dumps(job))
    done = tg.run(
        "run", "-f", str(path), "--inject", "preempt:node=1@1s", "--inject", "capacity:+2@4s",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    described = tg.only_job()
    assert sizes(described) == [2, 1, 3] and described["restarts"] == 0
    taken = [int(i) for f in out.glob("samples-rank-*.txt") for i in f.read_text().split()]
    assert sorted(taken) == list(range(epoch))  # every sample of the epoch, exactly once
    logs = Path(described["logs_dir"])
    batches = re.findall(
        r"global batch (\d+)", "".join(p.read_text() for p in logs.glob("*/*/stdout.log"))
    )
    assert batches and set(batches) == {"12"}
    saved = [
        p for p in logs.glob("attempt-[01]/rank-*/stdout.log") if "saved, exiting" in p.read_text()
    ]
    assert saved  # the scalings were the script's own save-and-exit, not a SIGTERM
