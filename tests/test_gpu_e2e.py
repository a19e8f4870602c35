"""Jobs on a GPU: NCCL with a process restart, checkpointless recovery with CUDA visible.

Runs where CUDA is (``make gpu-check``); skipped elsewhere. One GPU holds every rank:
NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the two-rank jobs use
gloo with CUDA tensors, or a CPU training loop beside the GPU (the case that broke
before: the default group of a CUDA machine had NCCL alone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import Trainguard, write_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(tg: Trainguard, path: Path, *injections: str) -> dict[str, Any]:
    args = ["run", "-f", str(path)]
    for injection in injections:
        args += ["--inject", injection]
    done = tg.run(*args, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    listed = tg.run("list", "-o", "json", timeout=60)
    jobs = [j for j in json.loads(listed.stdout) if j["name"] == path.stem]
    return tg.describe(jobs[0]["id"])


def one_node(path: Path, nproc: int) -> Path:
    job = yaml.safe_load(path.read_text())
    job["spec"]["nprocPerNode"] = nproc
    job["spec"]["replicaSpecs"][0]["replicas"] = 1
    path.write_text(yaml.safe_dump(job))
    return path


def injected(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in job["faults"] if f["evidence"].get("injected")]


def test_a_world_of_one_on_nccl_restarts_its_killed_process(tg: Trainguard, tmp_path: Path) -> None:
    command = [
        "python", "examples/gpt/train.py", "--backend", "nccl",
        *("--steps", "40", "--ckpt-every", "10", "--step-sleep", "0.05"),
        *("--data-dir", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / "ckpt")),
    ]  # fmt: skip
    path = one_node(
        write_job(tmp_path / "nccl.yaml", "nccl", command, runPolicy={"jobMaxRetryCount": 2}), 1
    )
    job = run(tg, path, "kill:rank=0@step=25")
    faults = injected(job)
    assert [f["type"] for f in faults] == ["WorkerCrash"], job["faults"]
    assert job["phase"] == "Succeeded", job["reason"]
    log = "\n".join(p.read_text() for p in Path(job["job_dir"]).rglob("*.log"))
    assert "device cuda" in log and "Resumed from checkpoint at step 20" in log


def resilient_gpt(tmp_path: Path, name: str) -> tuple[Path, Path]:
    final = tmp_path / f"final-{name}.pt"
    command = [
        "python", "examples/gpt/train.py", "--resilient", "--backend", "gloo",
        *("--steps", "40", "--memory-ckpt-every", "10", "--step-sleep", "0.05"),
        *("--data-dir", str(tmp_path / "data"), "--save-final", str(final)),
    ]  # fmt: skip
    path = write_job(
        tmp_path / f"{name}.yaml",
        name,
        command,
        runPolicy={"jobMaxRetryCount": 3},
        checkpointing={"memoryKeep": 2},
        trainguard={"inProcessRestart": True},
    )
    return one_node(path, 2), final


def test_resilient_gpt_sharing_the_gpu_over_gloo_loses_no_step_and_matches_a_clean_run(
    tg: Trainguard, tmp_path: Path
) -> None:
    clean_spec, clean_final = resilient_gpt(tmp_path, "clean")
    run(tg, clean_spec)
    faulty_spec, faulty_final = resilient_gpt(tmp_path, "faulty")
    job = run(tg, faulty_spec, "kill:rank=1@step=15")
    (killed,) = injected(job)
    assert killed["type"] == "WorkerCrash" and killed["scope"] == "in-process", killed
    assert killed["lost_steps"] == 0, killed
    log = "\n".join(p.read_text() for p in Path(job["job_dir"]).rglob("*.log"))
    assert "device cuda" in log
    clean = torch.load(clean_final, weights_only=True)
    faulty = torch.load(faulty_final, weights_only=True)
    different = [k for k in clean if not torch.equal(clean[k], faulty[k])]
    assert not different, f"weights differ from the run without faults: {different}"


def test_bench_job_with_a_cpu_loop_beside_the_gpu_recovers_in_process(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    command = [
        "python", "bench/train.py", "--ckpt", "resilient", "--device", "cpu",
        *("--steps", "40", "--step-sleep", "0.05", "--out", str(out)),
    ]  # fmt: skip
    path = write_job(
        tmp_path / "bench.yaml",
        "bench",
        command,
        runPolicy={"jobMaxRetryCount": 3},
        checkpointing={"memoryKeep": 2},
        trainguard={"inProcessRestart": True},
    )
    job = run(tg, one_node(path, 2), "kill:rank=1@step=15")
    (killed,) = injected(job)
    assert killed["scope"] == "in-process" and killed["lost_steps"] == 0, killed
    steps = [int(line.split()[1]) for line in (out / "steps.txt").read_text().splitlines()]
    assert len(steps) == len(set(steps)) == 40, steps  # each step once: none redone
