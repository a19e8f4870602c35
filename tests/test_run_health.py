"""Node health end to end on this machine: deep checks before ranks, a monitor's finding
mid-job, a replacement by hand; with spares and without (light step workers, real agents)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import SCRIPTS, Trainguard, wait_for
from test_run_elastic import started

STEPS = [str(SCRIPTS / "step_worker.py")]


def job_file(tmp_path: Path, steps: int, spares: int, **trainguard: Any) -> Path:
    """2 nodes x 1 process printing Step N every 10 ms, with ``spares`` spare nodes."""
    path = tmp_path / "job.yaml"
    job = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "health"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {
                    "name": "pods",
                    "replicas": 2,
                    "spares": spares,
                    "template": {
                        "spec": {
                            "containers": [{"name": "t", "command": ["python", *STEPS, str(steps)]}]
                        }
                    },
                }
            ],
            "runPolicy": {"jobMaxRetryCount": 2},
            "trainguard": {"pollIntervalSeconds": 0.3, **trainguard},
        },
    }
    path.write_text(json.dumps(job))
    return path


def kinds(job: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in job["events"] if e["kind"] == kind]


def nodes(tg: Trainguard, job_id: str) -> dict[str, dict[str, Any]]:
    done = tg.run("nodes", job_id, "-o", "json", timeout=60)
    assert done.returncode == 0, done.stderr
    return {n["node"]: n for n in json.loads(done.stdout)["nodes"]}


def ranks_of(job: dict[str, Any]) -> list[list[str]]:
    """Each started attempt's nodes, in node-rank order."""
    return [e["data"]["nodes"] for e in kinds(job, "AttemptStarted")]


def test_an_xid_mid_job_replaces_the_node_by_a_spare_for_good(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 400, spares=1)
    done = tg.run("run", "-f", str(path), "--inject", "xid:node=1@step=100", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    [fault] = job["faults"]
    assert fault["type"] == "NodeUnhealthy" and fault["node"] == "node-1"
    assert fault["evidence"]["code"] == 79 and fault["evidence"]["action"] == "replace"
    assert fault["evidence"]["injected"] == "xid:node=1@step=100"
    [restart] = kinds(job, "RestartScheduled")  # within one restart
    assert restart["data"]["replaced"] == {"node-1": "node-2"}
    assert ranks_of(job) == [["node-0", "node-1"], ["node-0", "node-2"]]
    health = nodes(tg, job["id"])
    assert health["node-1"]["nodeHealthStatus"] == "UnschedulablePendingReplacement"
    assert "XID 79" in health["node-1"]["reason"]
    assert health["node-2"]["nodeHealthStatus"] == "Schedulable"
    assert [e["node"] for e in kinds(job, "HealthFinding")] == ["node-1"]


def test_a_failed_deep_check_never_gets_ranks_and_a_spare_takes_its_place(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 50, spares=1, healthChecks={"onStart": ["cpu", "disk"]})
    done = tg.run("run", "-f", str(path), "--inject", "health:node=1,check=disk", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    assert ranks_of(job) == [["node-0", "node-2"]]  # node-1 never took a rank
    assert job["restarts"] == 0  # no rank ran: not a restart
    [replaced] = kinds(job, "NodesReplaced")
    assert replaced["data"]["replaced"] == {"node-1": "node-2"}
    checks = {
        (e["node"], e["data"]["name"]): e["data"]["outcome"] for e in kinds(job, "HealthCheck")
    }
    assert checks[("node-1", "disk")] == "failed" and checks[("node-1", "cpu")] == "passed"
    assert checks[("node-0", "disk")] == checks[("node-2", "disk")] == "passed"
    health = nodes(tg, job["id"])
    assert health["node-1"]["nodeHealthStatus"] == "Unschedulable"
    assert health["node-1"]["deepHealthCheckStatus"] == "Failed"
    assert health["node-2"]["deepHealthCheckStatus"] == "Passed"


def test_with_no_spare_a_failed_deep_check_fails_the_job_naming_node_and_check(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 50, spares=0, healthChecks={"onStart": ["InstanceStress"]})
    done = tg.run("run", "-f", str(path), "--inject", "health:node=0,check=memory", timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    job = tg.only_job()
    assert job["phase"] == "Failed"
    assert "node-0 is Unschedulable: its memory check failed" in job["reason"]
    assert "no spare node is left" in job["reason"]
    assert ranks_of(job) == []


def test_connectivity_reports_the_bandwidth_and_a_threshold_above_it_fails_the_nodes(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 20, spares=0, healthChecks={"onStart": ["InstanceConnectivity"]})
    done = tg.run("run", "-f", str(path), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job = tg.only_job()
    checks = kinds(job, "HealthCheck")
    assert {e["node"] for e in checks} == {"node-0", "node-1"}
    measured = [e["data"]["evidence"]["busbw_gbps"] for e in checks]
    assert all(m > 0 for m in measured), checks

    slow = tmp_path / "slow"
    slow.mkdir()
    floor = {"onStart": ["InstanceConnectivity"], "minBandwidthGbps": 100000}
    path = job_file(slow, 20, spares=0, healthChecks=floor)
    other = Trainguard(tmp_path / "state-slow")
    done = other.run("run", "-f", str(path), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    job = other.only_job()
    assert "its connectivity check failed" in job["reason"]
    assert "expected minimum 100000 GB/s" in job["reason"]


def test_a_node_replaced_by_hand_leaves_the_job(tg: Trainguard, tmp_path: Path) -> None:
    path = job_file(tmp_path, 3000, spares=1)
    run = tg.popen("run", "-f", str(path))
    job_id = "health"
    try:
        wait_for(lambda: started(tg)[1] == [2], 120)
        job_id = str(started(tg)[0])
        wrong = tg.run("node", "replace", job_id, "node-7")
        assert wrong.returncode == 2 and "has no node 'node-7'" in wrong.stderr
        asked = tg.run("node", "replace", job_id, "node-0", "--reason", "fan noise")
        assert asked.returncode == 0, asked.stderr
        wait_for(lambda: started(tg)[1] == [2, 2], 120)
        job = tg.describe(job_id)
        assert ranks_of(job)[-1] == ["node-2", "node-1"]
        assert nodes(tg, job_id)["node-0"]["reason"] == "asked for by hand: fan noise"
    finally:
        tg.run("delete", "--force", job_id, timeout=120)
        run.wait(60)


def test_bad_health_settings_and_injections_are_usage_errors(
    tg: Trainguard, tmp_path: Path
) -> None:
    path = job_file(tmp_path, 5, spares=0, healthChecks={"onStart": ["cpu", "warp-core"]})
    done = tg.run("run", "-f", str(path), timeout=60)
    assert done.returncode == 2
    assert "spec.trainguard.healthChecks.onStart" in done.stderr and "warp-core" in done.stderr
    path = job_file(tmp_path, 5, spares=0, healthChecks={"onStart": ["cpu"]})
    done = tg.run("run", "-f", str(path), "--inject", "health:node=0,check=gpu", timeout=60)
    assert done.returncode == 2
    assert "the job runs no gpu check" in done.stderr
    done = tg.run("run", "-f", str(path), "--inject", "xid:node=5@step=1", timeout=60)
    assert done.returncode == 2 and "node 5 is out of range" in done.stderr
