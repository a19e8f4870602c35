"""Checkpointless recovery of the GPT example (`train.py --resilient`), 2 nodes x 2 ranks.

One run with a SIGKILLed rank (in-process restart: the hot spare takes over, state from a
peer, no step lost), a hung rank (process-level restart from the memory tier) and a
killed node (full restart from a peer's replica) must end with the weights of the same
run without faults, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Trainguard, write_job

# Hang and throughput rules time the job: no other test may share the cores.
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]

STEPS = 60
HANG_SECONDS = 8


def spec(tmp_path: Path, name: str) -> tuple[Path, Path]:
    final = tmp_path / f"final-{name}.pt"
    command = [
        "python",
        "examples/gpt/train.py",
        "--resilient",
        *("--device", "cpu"),  # 2 simulated nodes on one host: a GPU box would share a GPU
        *("--steps", str(STEPS), "--memory-ckpt-every", "10", "--step-sleep", "0.05"),
        *("--data-dir", str(tmp_path / "data"), "--save-final", str(final)),
    ]
    path = write_job(
        tmp_path / f"{name}.yaml",
        name,
        command,
        runPolicy={
            "jobMaxRetryCount": 4,
            "logMonitoringConfiguration": [
                {
                    "name": "JobHang",
                    "logPattern": ".*Loss:.*",
                    "expectedRecurringFrequencyInSeconds": HANG_SECONDS,
                }
            ],
        },
        checkpointing={"memoryKeep": 2, "replicas": 1},
        trainguard={"inProcessRestart": True, "hotSpares": 1},
    )
    return path, final


def run(tg: Trainguard, path: Path, *injections: str) -> dict[str, Any]:
    args = ["run", "-f", str(path)]
    for injection in injections:
        args += ["--inject", injection]
    done = tg.run(*args, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    listed = tg.run("list", "-o", "json", timeout=60)
    jobs = [j for j in json.loads(listed.stdout) if j["name"] == path.stem]
    return tg.describe(jobs[0]["id"])


def weights(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


def test_kill_hang_and_node_kill_end_bit_identical_to_a_run_without_faults(
    tg: Trainguard, tmp_path: Path
) -> None:
    clean_spec, clean_final = spec(tmp_path, "clean")
    run(tg, clean_spec)
    faulty_spec, faulty_final = spec(tmp_path, "faulty")
    # Rank 1 lives on node-0, where the one hot spare waits.
    job = run(
        tg,
        faulty_spec,
        "kill:rank=1@step=15",
        "hang:rank=2@step=30",
        "node-kill:node=1@step=45",
    )
    by_type = {f["type"]: f for f in job["faults"] if f["evidence"].get("injected")}
    assert set(by_type) == {"WorkerCrash", "LogHang", "NodeLost"}, job["faults"]
    killed = by_type["WorkerCrash"]
    assert killed["scope"] == "in-process"
    assert killed["lost_steps"] == 0, killed
    assert by_type["LogHang"]["scope"] == "process"
    assert by_type["NodeLost"]["scope"] == "job"
    agent_log = (Path(job["job_dir"]) / "agents" / "node-0.log").read_text()
    assert "rank 1 taken over by a spare" in agent_log

    clean, faulty = weights(clean_final), weights(faulty_final)
    assert clean.keys() == faulty.keys()
    different = [k for k in clean if not torch.equal(clean[k], faulty[k])]
    assert not different, f"weights differ from the run without faults: {different}"
