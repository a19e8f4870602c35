"""The agent <-> worker control files, the sync plan and the state encoding (no processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainguard.resilient import AttemptInterrupted, Run, TrainState, is_collective_failure
from trainguard.resilient.protocol import (
    CONTROL_DIR_ENV,
    EXIT_BARRIER_TIMEOUT,
    Ack,
    ProtocolError,
    ResilientAttempt,
    SpareAssignment,
    read_ack,
    read_attempt,
    read_spare,
    write_ack,
    write_attempt,
    write_spare,
)
from trainguard.resilient.run import StateProgress
from trainguard.resilient.sync import (
    Offer,
    SyncPlan,
    Transfer,
    decode_state,
    encode_state,
    plan_sync,
)


def test_control_files_round_trip(tmp_path: Path) -> None:
    assert read_attempt(tmp_path) is None
    assert read_spare(tmp_path, 0) is None
    assert read_ack(tmp_path, 3) is None
    attempt = ResilientAttempt(
        attempt=2, master_addr="127.0.0.1", master_port=29500, world_size=4,
        barrier_timeout_seconds=30.0,
    )  # fmt: skip
    write_attempt(tmp_path, attempt)
    write_spare(tmp_path, 1, SpareAssignment(rank=3, local_rank=1, attempt=2))
    write_ack(tmp_path, 3, Ack(attempt=2, pid=1234, step=17, state_source="peer"))
    assert read_attempt(tmp_path) == attempt
    assert read_spare(tmp_path, 1) == SpareAssignment(rank=3, local_rank=1, attempt=2)
    assert read_ack(tmp_path, 3) == Ack(attempt=2, pid=1234, step=17, state_source="peer")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ack-rank-3.json",
        "attempt.json",
        "spare-1.json",
    ]
    assert json.loads((tmp_path / "attempt.json").read_text())["barrier_timeout_seconds"] == 30.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"attempt": 1}', "master_addr: missing"),
        (
            '{"attempt": "1", "master_addr": "h", "master_port": 1, "world_size": 1,'
            ' "barrier_timeout_seconds": 1}',
            "attempt: Input should be a valid integer",
        ),
        (
            '{"attempt": 1, "master_addr": "h", "master_port": 1, "world_size": 0,'
            ' "barrier_timeout_seconds": 1}',
            "world_size: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_attempt_file_names_the_file_and_field(
    tmp_path: Path, content: str, message: str
) -> None:
    (tmp_path / "attempt.json").write_text(content)
    with pytest.raises(ProtocolError, match=message) as info:
        read_attempt(tmp_path)
    assert str(tmp_path / "attempt.json") in str(info.value)


def test_bad_ack_state_source_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "ack-rank-0.json").write_text(
        '{"attempt": 1, "pid": 1, "step": 0, "state_source": "disk"}'
    )
    with pytest.raises(ProtocolError, match="state_source: Input should be 'self', 'peer'"):
        read_ack(tmp_path, 0)


NO_STATE = "no rank holds state"


@pytest.mark.parametrize(
    ("offers", "plan"),
    [
        ([Offer(False, 0), Offer(False, 0)], SyncPlan((), 0, True, NO_STATE)),
        ([Offer(True, 5), Offer(True, 5), Offer(True, 5)], SyncPlan((), 5)),
        ([Offer(False, 0), Offer(True, 5), Offer(True, 5)], SyncPlan((Transfer(1, (0,)),), 5)),
        (
            [Offer(True, 4), Offer(True, 5), Offer(False, 0), Offer(True, 5)],
            SyncPlan((Transfer(1, (0, 2)),), 5),
        ),
    ],
)
def test_sync_source_is_the_lowest_rank_with_the_most_steps(
    offers: list[Offer], plan: SyncPlan
) -> None:
    assert plan_sync(offers) == plan


@pytest.mark.parametrize(
    ("offers", "plan"),
    [
        # HSDP, 2 replicas x 2 shards: rank 1 (shard 1) is replaced, rank 3 holds shard 1.
        (
            [Offer(True, 8, 0), Offer(False, 0, 1), Offer(True, 8, 0), Offer(True, 8, 1)],
            SyncPlan((Transfer(3, (1,)),), 8),
        ),
        # One rank of each shard replaced: each takes its own shard's holder's state.
        (
            [Offer(False, 0, 0), Offer(True, 8, 1), Offer(True, 8, 0), Offer(False, 0, 1)],
            SyncPlan((Transfer(2, (0,)), Transfer(1, (3,))), 8),
        ),
        # Plain FSDP: the replaced rank's shard has no other holder: all roll back.
        (
            [Offer(True, 8, 0), Offer(False, 0, 1)],
            SyncPlan((), 8, True, "no rank holds shard 1 at step 8"),
        ),
        # Shard 1's holders completed one step less than shard 0's: no common step in memory.
        (
            [Offer(True, 8, 0), Offer(True, 7, 1), Offer(True, 8, 0), Offer(True, 7, 1)],
            SyncPlan((), 8, True, "no rank holds shard 1 at step 8"),
        ),
    ],
)
def test_each_shard_comes_from_a_holder_of_the_same_shard(
    offers: list[Offer], plan: SyncPlan
) -> None:
    assert plan_sync(offers) == plan


def test_state_moves_to_a_fresh_model_and_optimizer_without_pickling() -> None:
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    torch.manual_seed(1)
    model, optimizer = make()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    extra = {"samples": 15, "name": "run-a"}
    meta, data = encode_state(TrainState(model, optimizer, extra), steps=3)

    torch.manual_seed(2)
    fresh_model, fresh_optimizer = make()  # AdamW without state before its first step
    fresh_extra: dict[str, object] = {}
    steps = decode_state(TrainState(fresh_model, fresh_optimizer, fresh_extra), meta, data)

    assert steps == 3 and fresh_extra == extra
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    moments = optimizer.state_dict()["state"][0]
    received = fresh_optimizer.state_dict()["state"][0]
    assert torch.equal(moments["exp_avg"], received["exp_avg"])
    assert torch.equal(moments["step"], received["step"])


def test_train_state_rejects_a_state_with_other_parts() -> None:
    with pytest.raises(ValueError, match="state has parts"):
        TrainState(torch.nn.Linear(1, 1)).load_state_dict({"model": {}, "optimizer": {}})


def test_gloo_errors_are_collective_failures_and_user_errors_are_not() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: "
        "Connection reset by peer"
    )
    assert is_collective_failure(gloo)
    assert is_collective_failure(dist.DistBackendError("nccl failed"))
    assert is_collective_failure(AttemptInterrupted("newer attempt"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("bad batch"))


def test_run_counts_steps_and_stops_at_a_newer_attempt() -> None:
    progress = StateProgress(has_state=True, steps=4)
    newer = False
    run = Run(
        rank=0,
        local_rank=0,
        world_size=1,
        attempt=1,
        state_source="self",
        progress=progress,
        interrupted=lambda: newer,
    )
    assert run.start_step == 4
    with pytest.raises(ValueError, match=r"run.completed\(5\): expected step 4"):
        run.completed(5)
    run.completed(4)
    newer = True
    with pytest.raises(AttemptInterrupted):
        run.completed(5)
    assert progress.steps == 6


def test_rejoining_keeps_one_rank_prefix_on_uncaught_errors(tmp_path: Path) -> None:
    # torch wraps sys.excepthook in a "[rankN]: " prefixer at every init_process_group;
    # after three attempts a traceback must still carry the prefix once per line.
    script = """
import socket, sys, time
from trainguard.resilient.group import AttemptGroup
from trainguard.resilient.protocol import ResilientAttempt

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

group = AttemptGroup(0.02, 60.0)
for n in range(3):
    attempt = ResilientAttempt(
        attempt=n, master_addr="127.0.0.1", master_port=port(), world_size=1,
        barrier_timeout_seconds=60.0,
    )
    group.join(attempt, 0, time.monotonic() + 60, lambda: False)
    group.abort()
raise RuntimeError("boom")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "[rank0]: RuntimeError: boom" in done.stderr, done.stderr
    assert "[rank0]: [rank0]:" not in done.stderr


def test_run_splits_the_global_batch_and_deals_the_rest_of_the_epoch() -> None:
    def run(rank: int, world: int, steps: int) -> Run:
        progress = StateProgress(has_state=True, steps=steps)
        return Run(rank=rank, local_rank=0, world_size=world, attempt=1,
                   state_source="self", progress=progress, interrupted=lambda: False)  # fmt: skip

    split = run(0, 3, 5).batch_split(12, max_per_rank=2)
    assert (split.per_rank, split.accumulation_steps) == (2, 2)
    # Step 5 onwards (60 samples taken at 12 a step): rank 1's micro-batches of step 5.
    shard = run(1, 3, 5).shard(120, split)
    assert [shard.batch(0), shard.batch(1)] == [[62, 63], [68, 69]]
    with pytest.raises(ValueError, match="split is for world size 3, this attempt has 4"):
        run(0, 4, 5).shard(120, split)


def test_an_attempt_file_may_renumber_the_node_ranks(tmp_path: Path) -> None:
    attempt = ResilientAttempt(attempt=3, master_addr="h", master_port=1, world_size=4,
                      barrier_timeout_seconds=5.0, ranks=(2, 3))  # fmt: skip
    write_attempt(tmp_path, attempt)
    assert read_attempt(tmp_path) == attempt
    old = {"attempt": 1, "master_addr": "h", "master_port": 1, "world_size": 1,
           "barrier_timeout_seconds": 5.0}  # fmt: skip
    (tmp_path / "attempt.json").write_text(json.dumps(old))
    assert read_attempt(tmp_path).ranks == ()  # type: ignore[union-attr]


def test_a_rank_0_that_cannot_host_the_store_gives_up_at_once(tmp_path: Path) -> None:
    """Its port taken (by anything on any address: the store binds them all), rank 0
    exits with EXIT_BARRIER_TIMEOUT at once instead of waiting out the barrier: no rank
    could join, and the controller restarts the job on another port."""
    script = """
import torch
import trainguard.resilient as resilient

state = resilient.TrainState(model=torch.nn.Linear(1, 1))

@resilient.restartable(state)
def train(run):
    raise AssertionError("joined an attempt whose store could not be hosted")

train()
"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        attempt = ResilientAttempt(attempt=0, master_addr="127.0.0.1", master_port=port,
                          world_size=2, barrier_timeout_seconds=600.0)  # fmt: skip
        write_attempt(tmp_path, attempt)
        env = {**os.environ, CONTROL_DIR_ENV: str(tmp_path), "RANK": "0", "LOCAL_RANK": "0"}
        # Far less than the barrier's 600 s: waiting it out fails the test.
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180
        )
    assert done.returncode == EXIT_BARRIER_TIMEOUT, done.stderr
    assert f"rank 0 cannot host the rendezvous store on port {port}" in done.stderr
