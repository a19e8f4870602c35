"""``resilient.loop``: a torchrun DDP script made checkpointless in a few lines.

tests/scripts/ddp_plain.py is a plain torchrun DDP script; ddp_checkpointless.py is the
same made checkpointless (docs/checkpointless.md shows the diff). The checkpointless one
runs under ``trainguard run`` with in-process restarts and a hot spare, rank 1 SIGKILLed
mid-run: it recovers in process, no step lost or redone, every loss (the final one too)
that of the plain script's uninterrupted run under torchrun. The rest runs in this process
without trainguard: the loop's steps, its checkpoint fallback, when a step counts as
complete, and the DDP made again for a new process group.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainguard.resilient as resilient
from conftest import SCRIPTS, Trainguard, write_job
from trainguard.checkpoint import Checkpointer, RNGState
from trainguard.resilient.loop import _Loop
from trainguard.resilient.run import Run, StateProgress

PLAIN = SCRIPTS / "ddp_plain.py"
CHECKPOINTLESS = SCRIPTS / "ddp_checkpointless.py"
STEPS = 40
LOSS = re.compile(r"^(?:\[rank0\]: )?step (\d+) loss (\S+)$", re.M)


def changed_lines() -> list[str]:
    """The lines ddp_checkpointless.py adds to or removes from ddp_plain.py."""
    diff = difflib.unified_diff(
        PLAIN.read_text().splitlines(), CHECKPOINTLESS.read_text().splitlines(), lineterm=""
    )
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def test_a_torchrun_script_is_checkpointless_in_at_most_ten_changed_lines() -> None:
    changed = changed_lines()
    assert len(changed) <= 10, "\n".join(changed)
    assert "-dist.init_process_group(" in "\n".join(changed)
    steps = "range(1, args.steps + 1)"  # the script's own step numbering, kept
    assert f"-for step in {steps}:" in changed
    assert any(line.startswith("+resilient.loop(train_step, " + steps) for line in changed)


def losses(output: str) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in LOSS.findall(output)]


@pytest.mark.e2e
def test_the_checkpointless_script_recovers_in_process_with_no_step_lost(
    tg: Trainguard, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    plain = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", str(PLAIN), "--steps", str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = losses(plain.stdout)
    assert [step for step, _ in expected] == list(range(1, STEPS + 1))

    command = ["python", str(CHECKPOINTLESS), "--steps", str(STEPS), "--step-sleep", "0.05"]
    node = {"name": "pods", "replicas": 1}
    node["template"] = {"spec": {"containers": [{"name": "trainer", "command": command}]}}
    spec = write_job(
        tmp_path / "job.yaml",
        "checkpointless",
        command,
        replicaSpecs=[node],
        runPolicy={"jobMaxRetryCount": 2},
        trainguard={"inProcessRestart": True, "hotSpares": 1},
    )
    done = tg.run("run", "-f", str(spec), "--inject", "kill:rank=1@step=15", timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # Rank 0 survived and logged each step once: none lost, none redone, and every loss
    # is the uninterrupted run's.
    assert losses(done.stdout) == expected, output[-4000:]

    job = tg.only_job()
    [fault] = [f for f in job["faults"] if f["evidence"].get("injected")]
    assert (fault["type"], fault["scope"], fault["lost_steps"]) == ("WorkerCrash", "in-process", 0)
    agent_log = (Path(job["job_dir"]) / "agents" / "node-0.log").read_text()
    assert "rank 1 taken over by a spare" in agent_log


# -- in this process, without trainguard ---------------------------------------------------


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _looped(memory_dir: str, steps: range) -> tuple[torch.nn.Module, list[int]]:
    """A fresh model and Adam through ``resilient.loop`` with a Checkpointer in
    ``memory_dir``: the model, and the steps the loop ran."""
    model, adam = _model_and_adam()
    calls: list[int] = []

    def train_step(step: int) -> None:
        calls.append(step)
        _step(model, adam)

    state = {"model": model, "optim": adam, "rng": RNGState()}
    with Checkpointer(memory_dir=memory_dir, environ={}) as ckpt:
        resilient.loop(train_step, steps, state, checkpoints=ckpt)
    return model, calls


def test_without_trainguard_the_loop_runs_its_steps_and_resumes_from_a_checkpoint(
    shm: str,
) -> None:
    straight, straight_adam = _model_and_adam()
    for _ in range(8):
        _step(straight, straight_adam)

    resilient.init_process_group("gloo")  # plain python: a one-rank group
    try:
        _, calls = _looped(shm, range(1, 6))
        assert calls == [1, 2, 3, 4, 5]
        assert dist.is_initialized(), "the group is the script's after the loop"
        # A new process: the loop restores step 5 from the checkpoint, runs 6 to 8.
        resumed, calls = _looped(shm, range(1, 9))
        assert calls == [6, 7, 8]
    finally:
        dist.destroy_process_group()
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def _attempt(progress: StateProgress) -> Run:
    return Run(
        rank=0,
        local_rank=0,
        world_size=1,
        attempt=0,
        state_source="self",
        progress=progress,
        interrupted=lambda: False,
    )


def test_a_step_is_complete_once_its_optimizer_stepped() -> None:
    """A collective that fails after the update (a loss all_reduce for the log) does not
    make the step run again; one that fails before it does."""
    model, adam = _model_and_adam()

    def train_step(step: int) -> None:
        if step == 3:
            raise RuntimeError("Connection reset by peer")  # before the update
        _step(model, adam)
        if step == 2:
            raise RuntimeError("Connection reset by peer")  # after it

    loop = _Loop(train_step, range(1, 6), {"model": model, "optim": adam}, None)
    progress = StateProgress(has_state=True)
    with pytest.raises(RuntimeError):
        loop(_attempt(progress))
    assert progress.steps == 2, "steps 1 and 2 are complete"
    with pytest.raises(RuntimeError):
        loop(_attempt(progress))  # the next attempt starts at step 3
    assert progress.steps == 2, "step 3 is not"
    assert not adam._optimizer_step_post_hooks, "the loop's hooks are gone"


def test_the_ddp_is_made_again_for_a_new_process_group() -> None:
    model = torch.nn.Linear(4, 1)
    hooked: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
        hooked.append(1)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp = resilient.DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook)
    assert ddp.parameters is not None and ddp.module is model
    made = []
    for _ in range(2):  # two attempts: two groups
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            ddp(torch.randn(2, 4)).sum().backward()
            made.append(ddp.ddp)
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]
    assert hooked == [1, 1], "the hook is registered on each DDP"
