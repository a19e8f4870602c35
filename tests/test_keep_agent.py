"""A job restart after a lost node keeps the other nodes' live agents (their worker
templates warm): the platform hands each the new incarnation (``LaunchNodes.keep``,
``POST /assign`` with ``again``) instead of starting a fresh agent. One machine, light
step workers: node-1's agent is SIGKILLed (``node-kill``), the spare takes its ranks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import SCRIPTS, Trainguard

pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]


def test_a_lost_node_is_replaced_and_the_other_nodes_keep_their_agents(
    tg: Trainguard, tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    command = [sys.executable, "-u", str(SCRIPTS / "step_worker.py"), "1000"]
    spec.write_text(yaml.safe_dump({
        "apiVersion": "trainguard.dev/v1", "kind": "TrainingJob", "metadata": {"name": "keep"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [{
                "name": "workers", "replicas": 2, "spares": 1,
                "template": {"spec": {"containers": [{"name": "t", "command": command}]}},
            }],
            "runPolicy": {"jobMaxRetryCount": 2},
        },
    }))  # fmt: skip
    run = tg.popen("run", "-f", str(spec), "--inject", "node-kill:node=1@3s")
    try:
        deadline, first = time.monotonic() + 120, None
        while first is None:
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            listed = tg.run("list", "-o", "json", timeout=60)
            jobs = json.loads(listed.stdout) if listed.returncode == 0 else []
            nodes = tg.describe(jobs[0]["id"])["nodes"] if jobs else []
            first = next((n["agent_pid"] for n in nodes if n["node_id"] == "node-0"), None)
            time.sleep(0.2)
        out, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, (out[-3000:], err[-3000:])
    job = tg.only_job()
    [lost] = [f for f in job["faults"] if f["type"] == "NodeLost"]
    assert lost["node"] == "node-1" and job["restarts"] == 1, job["faults"]
    nodes = {n["node_id"]: n for n in job["nodes"]}
    assert nodes["node-2"]["ranks"] == [1], nodes  # the spare took node-1's rank
    assert nodes["node-0"]["agent_pid"] == first, nodes  # the same agent, kept
