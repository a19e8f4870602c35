"""A checkpoint state of objects (model, optimizer, RNGState): read at each save, restored
through their own load_state_dict; through a SIGKILL, bit-identical to a run without it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import trainguard.resilient as resilient
from conftest import SCRIPTS
from trainguard.checkpoint import Checkpointer, RNGState, StateMismatch

RESUME = SCRIPTS / "ckpt_resume.py"


def _model_and_adam(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _moments(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {i: dict(s) for i, s in optimizer.state_dict()["state"].items()}


def test_objects_are_read_at_each_save_and_restored_through_load_state_dict(shm: str) -> None:
    model, adam = _model_and_adam()
    state = {"model": model, "optim": adam, "rng": RNGState(), "epoch": 3}
    with Checkpointer(memory_dir=shm, environ={}) as ckpt:
        for step in (1, 2, 3):  # built before Adam's first step, saved after each
            _train(model, adam, 1)
            ckpt.save(step, state)
    saved_weights, saved_moments = model.state_dict(), _moments(adam)
    draws = torch.rand(3), random.random(), numpy.random.rand()

    fresh, fresh_adam = _model_and_adam(seed=1)
    restored = {"model": fresh, "optim": fresh_adam, "rng": RNGState(), "epoch": 0}
    with Checkpointer(memory_dir=shm, environ={}) as ckpt:
        assert ckpt.load_latest(restored) == 3
    assert restored["model"] is fresh and restored["optim"] is fresh_adam
    assert restored["epoch"] == 3
    for key, value in saved_weights.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    moments = _moments(fresh_adam)
    assert moments.keys() == saved_moments.keys() and moments, "Adam's moments came back"
    for index, saved in saved_moments.items():
        for key, value in saved.items():
            assert torch.equal(moments[index][key], value), (index, key)
    # torch's, Python's and NumPy's generators are where they were at save(3).
    assert torch.equal(torch.rand(3), draws[0])
    assert (random.random(), numpy.random.rand()) == draws[1:]


def test_rng_state_round_trips_every_generator() -> None:
    rng = RNGState()
    saved = rng.state_dict()
    first = (torch.rand(4), random.random(), numpy.random.rand(3))
    rng.load_state_dict(saved)
    again = (torch.rand(4), random.random(), numpy.random.rand(3))
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert (first[2] == again[2]).all()
    assert set(saved) >= {"torch", "python", "numpy"}


def test_a_train_state_is_a_checkpoint_state(shm: str) -> None:
    """docs/checkpointless.md's fallback: load_latest(TrainState) raised TypeError."""
    model, adam = _model_and_adam()
    _train(model, adam, 2)
    extra = {"position": 7}
    with Checkpointer(memory_dir=shm, environ={}) as ckpt:
        ckpt.save(2, resilient.TrainState(model=model, optimizer=adam, extra=extra))
    fresh, fresh_adam = _model_and_adam(seed=1)
    fresh_extra: dict[str, Any] = {"position": 0}
    state = resilient.TrainState(model=fresh, optimizer=fresh_adam, extra=fresh_extra)
    with Checkpointer(memory_dir=shm, environ={}) as ckpt:
        assert ckpt.load_latest(state) == 2
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh_extra == {"position": 7} and _moments(fresh_adam).keys() == {0, 1, 2, 3}


def test_a_mismatch_names_the_object_s_key_and_changes_nothing(shm: str) -> None:
    model, _ = _model_and_adam()
    with Checkpointer(memory_dir=shm, environ={}) as ckpt:
        ckpt.save(1, {"model": model})
    other = torch.nn.Linear(6, 5)
    before = other.weight.clone()
    with Checkpointer(memory_dir=shm, environ={}) as ckpt, pytest.raises(StateMismatch) as err:
        ckpt.load_latest({"model": other})
    assert "state['model']" in str(err.value)
    assert torch.equal(other.weight, before)


def _resume(memory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run(
        [sys.executable, str(RESUME), "--memory-dir", str(memory), *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )


def _result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


@pytest.fixture
def uninterrupted(tmp_path: Path) -> dict[str, Any]:
    return _result(_resume(tmp_path / "clean"))


def test_a_killed_run_resumes_adam_and_rng_bit_identical_from_memory_and_durable(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    killed = _resume(memory, "--durable-url", str(durable), "--kill-at", "13")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shutil.copytree(durable, tmp_path / "durable-copy")

    from_memory = _result(_resume(memory, "--durable-url", str(durable)))
    assert from_memory["start"] == 13
    assert from_memory == {**uninterrupted, "start": 13}

    # The node is gone: its memory with it. Durable has every 5th step.
    copy = str(tmp_path / "durable-copy")
    from_durable = _result(_resume(tmp_path / "new-memory", "--durable-url", copy))
    assert from_durable == {**uninterrupted, "start": 10}


def test_a_state_captured_once_resumes_to_another_result(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """What the new user saw: the old docs' snippet lost Adam's moments and the RNG."""
    memory = tmp_path / "memory"
    killed = _resume(memory, "--captured", "--kill-at", "13")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _result(_resume(memory, "--captured"))
    assert resumed["start"] == 13
    assert resumed["digest"] != uninterrupted["digest"]
    assert resumed["loss"] != uninterrupted["loss"]
