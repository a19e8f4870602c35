"""Checkpointless recovery of sharded models: FSDP2 and HSDP under ``resilient.loop``.

tests/scripts/fsdp_plain.py is a torchrun FSDP2 script (``--hsdp``: a 2 x 2 mesh, two
replicas of two shards); fsdp_checkpointless.py is the same with trainguard's
``init_process_group``, ``init_device_mesh``, ``fully_shard`` and ``loop``. Each fault is
a SIGKILL on 2 nodes x 2 ranks; each run ends bit-identical to the plain script's
uninterrupted run under torchrun.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SCRIPTS, Trainguard, write_job

PLAIN = SCRIPTS / "fsdp_plain.py"
CHECKPOINTLESS = SCRIPTS / "fsdp_checkpointless.py"
STEPS = 12
LOSS = re.compile(r"^(?:\[rank0\]: )?step (\d+) loss (\S+)$", re.M)


def changed_lines() -> list[str]:
    diff = difflib.unified_diff(
        PLAIN.read_text().splitlines(), CHECKPOINTLESS.read_text().splitlines(), lineterm=""
    )
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def test_an_fsdp_script_is_checkpointless_with_the_changes_of_a_ddp_one() -> None:
    """The imports, init_process_group, and the loop's body as a function."""
    changed = changed_lines()
    assert len(changed) <= 14, "\n".join(changed)
    assert "+from trainguard.resilient import fully_shard, init_device_mesh" in changed
    assert "-from torch.distributed.fsdp import fully_shard" in changed


def losses(output: str) -> list[tuple[int, str]]:
    """Each step's loss as rank 0 logs it; a step redone after a rollback is logged again,
    and must log the same loss."""
    found: dict[int, str] = {}
    for step, loss in LOSS.findall(output):
        assert found.setdefault(int(step), loss) == loss, f"step {step} redone differently"
    return sorted(found.items())


def logged_steps(output: str) -> list[int]:
    return [int(step) for step, _ in LOSS.findall(output)]


def plain_run(tmp_path: Path, *args: str) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """The plain script under torchrun, 4 ranks, no fault: its losses and final weights."""
    final = tmp_path / "plain.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = [str(PLAIN), "--steps", str(STEPS), *args, "--save-final", str(final)]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node", "4", *script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(done.stdout), torch.load(final, weights_only=True)


def trainguard_run(
    tg: Trainguard, tmp_path: Path, injection: str, *args: str, **spec: Any
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    final = tmp_path / "resilient.pt"
    command = ["python", str(CHECKPOINTLESS), "--steps", str(STEPS), "--step-sleep", "0.05"]
    command += [*args, "--save-final", str(final)]
    path = write_job(
        tmp_path / "job.yaml",
        "sharded",
        command,
        runPolicy={"jobMaxRetryCount": 2},
        trainguard={"inProcessRestart": True, "hotSpares": 1},
        **spec,
    )
    done = tg.run("run", "-f", str(path), "--inject", injection, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, tg.only_job(), torch.load(final, weights_only=True)


def assert_identical(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.e2e
@pytest.mark.exclusive
def test_hsdp_a_replaced_rank_takes_its_shards_from_its_replica_peer(
    tg: Trainguard, tmp_path: Path
) -> None:
    expected, weights = plain_run(tmp_path, "--hsdp")
    output, job, final = trainguard_run(tg, tmp_path, "kill:rank=1@step=5", "--hsdp")
    # Rank 0 survived: each step's loss once, as the uninterrupted run's. It logs the
    # loss all-reduced after the update: once it has, every rank completed the step, and
    # the kill lands between steps (see docs/sharded.md for a kill inside the update).
    assert logged_steps(output) == list(range(1, STEPS + 1)), output[-4000:]
    assert losses(output) == expected, output[-4000:]
    assert_identical(final, weights)
    [fault] = [f for f in job["faults"] if f["evidence"].get("injected")]
    assert (fault["type"], fault["scope"], fault["lost_steps"]) == ("WorkerCrash", "in-process", 0)
    # Rank 1 (shard 1 of replica 0) from rank 3 (shard 1 of replica 1).
    assert re.search(r"rank 1: joined attempt 1 .*state from peer rank 3 at step", output)


@pytest.mark.e2e
@pytest.mark.exclusive
def test_fsdp_the_ranks_roll_back_to_the_memory_tier_and_redo_the_steps_since(
    tg: Trainguard, tmp_path: Path
) -> None:
    """Plain FSDP: no rank holds the replaced rank's shards, so every rank restores the
    newest step all saved (the loop saves each step to the memory tier), and the steps
    since are redone."""
    expected, weights = plain_run(tmp_path)
    checkpointing = {"memoryKeep": 2, "replicas": 1}
    output, job, final = trainguard_run(
        tg, tmp_path, "kill:rank=1@step=5", checkpointing=checkpointing
    )
    assert losses(output) == expected, output[-4000:]
    assert_identical(final, weights)
    [fault] = [f for f in job["faults"] if f["evidence"].get("injected")]
    assert (fault["type"], fault["scope"]) == ("WorkerCrash", "in-process")
    assert fault["lost_steps"] <= 1  # the step after the newest save every rank made
    assert re.search(
        r"rank 0: joined attempt 1 .*state from checkpoint at step \d+ "
        r"\(no rank holds shard 1 at step",
        output,
    ), output[-4000:]
    restored = [e for e in job["events"] if e["kind"] == "CheckpointRestored"]
    assert sorted(e["rank"] for e in restored) == [0, 1, 2, 3], restored
    assert {e["data"]["tier"] for e in restored} == {"memory"}, restored
