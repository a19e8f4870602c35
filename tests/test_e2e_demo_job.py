"""The demo job spec trains the GPT example on 2 nodes x 2 processes under trainguard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, Trainguard

pytestmark = pytest.mark.e2e


def test_demo_job_trains_to_completion_on_four_ranks(tg: Trainguard, tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "examples/gpt/job.yaml").read_text())
    container = spec["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    container["args"] = ["--steps", "30", "--ckpt-every", "10", "--data-dir", str(tmp_path)]
    short = tmp_path / "job.yaml"
    short.write_text(yaml.safe_dump(spec))
    done = tg.run("run", "-f", str(short), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = r"\[rank0\]: Batch 30 Loss: \d+\.\d{5}, Speed: [\d.]+ samples/sec"
    assert re.search(line, done.stdout)
    assert "logs:" in done.stderr and "state:" in done.stderr
    job = tg.only_job()
    assert job["phase"] == "Succeeded"
    assert job["world_size"] == 4
    assert [n["ranks"] for n in job["nodes"]] == [[0, 1], [2, 3]]
    # The example checkpoints into the job's own directory, which trainguard gives it.
    assert (Path(job["job_dir"]) / "checkpoints").is_dir()


def test_make_demo_shows_a_fault_recovered_in_process_with_no_step_lost(
    tg: Trainguard, tmp_path: Path
) -> None:
    """`make demo`'s own commands (read from the Makefile): the job ends with a line
    saying what the fault cost, then the report's paths."""
    import shlex
    import subprocess

    dry = subprocess.run(
        ["make", "-n", "-s", "demo", "VENV=.venv"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = [line for line in dry.stdout.splitlines() if "trainguard run" in line]
    [run_line] = lines
    argv = shlex.split(run_line)
    assert argv[0].endswith("trainguard") and argv[1] == "run"
    done = tg.run(*argv[1:], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = re.search(
        r"1 fault: WorkerCrash \(rank 3\) recovered in [\d.]+s by an in-process restart, "
        r"0 steps lost",
        done.stderr,
    )
    assert summary is not None, done.stderr[-3000:]
    job = tg.only_job()
    report = tg.run("report", job["id"], "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0 and (tmp_path / "report.html").is_file()
