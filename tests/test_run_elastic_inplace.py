"""Elastic scalings in place on this machine: a resilient torch job (gloo, 3 nodes x 1
process) loses a node and gets it back without restarting its survivors, with its global
batch kept and every sample of the epoch taken once (tests/scripts/elastic_resilient.py)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import SCRIPTS, Trainguard

SCRIPT = SCRIPTS / "elastic_resilient.py"
STEPS = 450
GLOBAL_BATCH = 12


def job_file(tmp_path: Path, out: Path) -> Path:
    command = ["python", str(SCRIPT), "--out", str(out), "--steps", str(STEPS),
               "--global-batch", str(GLOBAL_BATCH)]  # fmt: skip
    spec = {
        "nprocPerNode": 1,
        "replicaSpecs": [
            {
                "name": "pods",
                "replicas": 3,
                "template": {"spec": {"containers": [{"name": "t", "command": command}]}},
            }
        ],
        "elasticPolicy": {"minReplicas": 2, "maxReplicas": 3, "scalingTimeoutInSeconds": 1,
                          "gracefulShutdownTimeoutInSeconds": 2},
        "runPolicy": {"jobMaxRetryCount": 3},
        "trainguard": {"inProcessRestart": True, "hotSpares": 0, "pollIntervalSeconds": 0.3,
                       "restartBarrierTimeoutSeconds": 60},
    }  # fmt: skip
    path = tmp_path / "job.yaml"
    job = {"apiVersion": "trainguard.dev/v1", "kind": "TrainingJob",
           "metadata": {"name": "inplace"}, "spec": spec}  # fmt: skip
    path.write_text(yaml.safe_dump(job))
    return path


def records(out: Path) -> list[dict[str, Any]]:
    lines = [line for f in out.glob("pid-*.jsonl") for line in f.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines), key=lambda r: r["time"])


def scaled_in_place(
    tg: Trainguard, job_file: Path, preempt: str, capacity: str, full: int, timeout: float
) -> dict[str, Any]:
    """Run ``job_file`` with a node preempted, then capacity back; check the job went
    ``full`` -> ``full - 1`` -> ``full`` nodes in place, with no restart and no fault."""
    done = tg.run(
        "run", "-f", str(job_file), "--inject", preempt, "--inject", capacity, timeout=timeout
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    job = tg.only_job()
    assert job["restarts"] == 0 and job["faults"] == []
    started = [e["data"] for e in job["events"] if e["kind"] == "AttemptStarted"]
    assert [(len(s["nodes"]), s["scope"]) for s in started] == [
        (full, "process"), (full - 1, "in-process"), (full, "in-process")
    ]  # fmt: skip
    scalings = [e["data"] for e in job["events"] if e["kind"] == "ElasticScaling"]
    assert [(s["from"], s["to"], s["in_place"]) for s in scalings] == [
        (full, full - 1, True), (full - 1, full, True)
    ]  # fmt: skip
    # Why each survivor left: a peer's failure, or the new attempt (never what the
    # dropped group made the function raise meanwhile).
    left = [e["message"] for e in job["events"] if e["kind"] == "InProcessRestart"]
    assert left and not [m for m in left if "process group has not been initialized" in m], left
    return job


@pytest.mark.e2e
def test_a_resilient_job_scales_down_and_up_in_place(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = scaled_in_place(
        tg, job_file(tmp_path, out), "preempt:node=1@5s", "capacity:+1@11s", full=3, timeout=600
    )
    scalings = [e["data"] for e in job["events"] if e["kind"] == "ElasticScaling"]
    assert scalings[0]["dropped"] == ["node-1"] and scalings[1]["added"] == ["node-1"]

    recs = records(out)
    starts = [r for r in recs if r["event"] == "start"]
    by_attempt: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in starts:
        by_attempt[s["attempt"]].append(s)
    # The survivors kept their processes: node-2's worker was rank 2, then rank 1.
    first = {s["rank"]: s["pid"] for s in by_attempt[0]}
    assert {s["rank"]: s["pid"] for s in by_attempt[1]} == {0: first[0], 1: first[2]}
    third = {s["rank"]: s for s in by_attempt[2]}
    assert third[0]["pid"] == first[0] and third[1]["pid"] == first[2]
    assert third[2]["pid"] not in first.values() and third[2]["source"] == "peer"
    assert {s["source"] for s in by_attempt[1]} == {"self"}
    # The global batch is kept: per rank x accumulation x world.
    for s in starts:
        assert s["per_rank"] * s["accumulation"] * s["world"] == GLOBAL_BATCH

    steps = [r for r in recs if r["event"] == "step"]
    attempts_of_step: dict[int, set[int]] = defaultdict(set)
    for r in steps:
        attempts_of_step[r["step"]].add(r["attempt"])
    assert sorted(attempts_of_step) == list(range(STEPS))
    assert [s for s, a in attempts_of_step.items() if len(a) > 1] == []  # 0 steps lost
    taken = Counter(k for r in steps for k in r["samples"])
    assert sorted(taken) == list(range(STEPS * GLOBAL_BATCH))
    assert set(taken.values()) == {1}  # every sample once
    for r in steps:  # each step's samples are its slice of the epoch
        assert all(r["step"] * GLOBAL_BATCH <= k < (r["step"] + 1) * GLOBAL_BATCH
                   for k in r["samples"])  # fmt: skip
    worlds = {r["world"] for r in steps}
    assert worlds == {2, 3}
    finals = {r["weight"] for r in recs if r["event"] == "done"}
    assert len(finals) == 1  # every rank ends with the same weights
