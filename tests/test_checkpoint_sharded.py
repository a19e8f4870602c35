"""Sharded state (DTensor: FSDP2, HSDP, tensor parallel) in the Checkpointer.

The torchrun tests run ``tests/scripts/sharded_train.py`` on gloo (CPU): a SIGKILLed
FSDP2 run resumes bit-identical to an uninterrupted plain torchrun run; the same
checkpoint restores into world 2 (an elastic shrink) from memory and from the durable
tier; a tensor-parallel model round-trips, and its checkpoint restores into FSDP2. The
first tests check the region arithmetic on plain tensors, without a process group.
The torchrun ones take 15-30 s of CPU per launch of 2-4 ranks (minutes in all on the
2-core VM), so they are ``long`` (``make test-long``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SCRIPTS
from trainguard.checkpoint.sharding import Box, NotCovered, plan_copy
from trainguard.checkpoint.state import TensorEntry, flatten

TRAIN = SCRIPTS / "sharded_train.py"


def _shard(rows: slice, whole: torch.Tensor) -> tuple[TensorEntry, torch.Tensor]:
    """A saved row shard of ``whole``: its entry and a buffer holding its bytes."""
    part = whole[rows].contiguous()
    layout, _ = flatten({"w": part})
    entry = layout.entries[0]
    sharding = {"global_shape": list(whole.shape), "offsets": [rows.start, 0]}
    buffer = part.reshape(-1).view(torch.uint8).clone()
    return TensorEntry(entry.path, entry.dtype, entry.shape, 0, entry.nbytes, sharding), buffer


def test_boxes_overlap_where_both_hold_the_tensor() -> None:
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (4, 4))
    assert a.overlap(b) == Box((2, 3), (2, 3))
    assert a.within(Box((2, 3), (2, 3))) == (slice(2, 4), slice(3, 6))
    assert a.overlap(Box((4, 0), (2, 6))) is None


def test_shards_of_any_split_fill_a_whole_tensor_and_a_gap_is_refused() -> None:
    whole = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    shards = [_shard(slice(0, 3), whole), _shard(slice(3, 8), whole)]
    replica = _shard(slice(0, 3), whole)  # HSDP: another rank holds the same box
    target = torch.zeros(8, 6)
    plan_copy(target, [shards[0], replica, shards[1]], "state['w']")()
    assert torch.equal(target, whole)
    with pytest.raises(NotCovered, match=r"state\['w'\]"):
        plan_copy(torch.zeros(8, 6), [shards[1]], "state['w']")
    with pytest.raises(ValueError, match=r"float32\[8, 6\].*float32\[8, 5\]"):
        plan_copy(torch.zeros(8, 5), shards, "state['w']")


def test_a_shard_s_placement_travels_as_json() -> None:
    entry, _ = _shard(slice(3, 8), torch.zeros(8, 6))
    data = json.loads(json.dumps(entry.to_json()))
    assert data["dtensor"] == {"global_shape": [8, 6], "offsets": [3, 0]}
    assert TensorEntry.from_json(data) == entry
    data["dtensor"]["offsets"] = [4, 0]  # 4 + 5 rows > 8
    with pytest.raises(ValueError, match="outside its global shape"):
        TensorEntry.from_json(data)


# -- torchrun ---------------------------------------------------------------------------


def _torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone`` of the script; its whole process group is killed on a
    timeout (torchrun and its ranks, by the group this call created)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TORCHELASTIC"))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={nproc}", str(TRAIN), *args]
    proc = subprocess.Popen(
        argv,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    data: dict[str, Any] = json.loads(lines[-1])
    return data


@pytest.fixture(scope="module")
def fsdp_run() -> Iterator[dict[str, Any]]:
    """An uninterrupted plain FSDP2 run (world 4), and the same script SIGKILLed at step 3
    with the Checkpointer, then run again: its directories stay for the reshard tests."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = Path(tempfile.mkdtemp(prefix="tg-ckpt-sharded-", dir=base))
    try:
        plain = _result(_torchrun(4, "--plain"))
        tiers = ["--memory-dir", str(tmp / "memory"), "--durable-url", str(tmp / "durable")]
        killed = _torchrun(4, *tiers, "--kill-at", "3")
        assert killed.returncode != 0, "rank 0 SIGKILLs itself at step 3"
        resumed = _result(_torchrun(4, *tiers))
        yield {"dir": tmp, "plain": plain, "resumed": resumed}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.long
def test_fsdp2_resumes_bit_identical_after_a_sigkill(fsdp_run: dict[str, Any]) -> None:
    resumed, plain = fsdp_run["resumed"], fsdp_run["plain"]
    assert (resumed["start"], resumed["tier"]) == (3, "memory")
    assert resumed["digest"] == plain["digest"]


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.parametrize("where", ["memory", "replica", "durable", "hsdp"])
def test_an_elastic_shrink_from_4_to_2_ranks_reshards(fsdp_run: dict[str, Any], where: str) -> None:
    """World 2 restores world 4's step 6 (and world 4 as HSDP): every parameter and moment
    equals the full tensors of the uninterrupted run (the digest is over them)."""
    tmp: Path = fsdp_run["dir"]
    tier = "durable" if where in ("durable", "hsdp") else "memory"
    if where == "memory":  # the node kept world 4's slots (a restart on this node)
        args = ["--memory-dir", str(tmp / "memory")]
    elif where == "replica":
        # 2 nodes x 2 ranks restart on node 0 alone: it holds ranks 0-1 in its memory tier
        # and ranks 2-3 in the replica of node 1 its agent keeps beside it.
        node = tmp / "node-0"
        held = node / "replicas" / "node-1"
        held.mkdir(parents=True)
        shutil.copytree(
            tmp / "memory", node / "memory", ignore=shutil.ignore_patterns("rank-[23]-*")
        )
        for path in (tmp / "memory").glob("rank-[23]-*"):
            shutil.copy(path, held / path.name)
        args = ["--memory-dir", str(node / "memory")]
    else:  # a new node: its memory is empty
        args = ["--memory-dir", str(tmp / "new-memory"), "--durable-url", str(tmp / "durable")]
    world = 2
    if where == "hsdp":  # the same 4 ranks as HSDP: a 2 x 2 mesh, (Replicate, Shard(0))
        args = ["--layout", "hsdp", "--memory-dir", str(tmp / "hsdp-memory")]
        args += ["--durable-url", str(tmp / "durable")]
        world = 4
    restored = _result(_torchrun(world, *args))
    assert (restored["start"], restored["tier"]) == (6, tier)
    assert restored["digest"] == fsdp_run["plain"]["digest"]


@pytest.mark.e2e
@pytest.mark.long
def test_a_tensor_parallel_model_round_trips_and_restores_into_fsdp2(tmp_path: Path) -> None:
    memory = ["--memory-dir", str(tmp_path / "memory"), "--steps", "3"]
    trained = _result(_torchrun(2, "--layout", "tp", *memory))
    again = _result(_torchrun(2, "--layout", "tp", *memory))  # the same layout: a copy each
    assert (again["start"], again["digest"]) == (3, trained["digest"])
    as_fsdp = _result(_torchrun(2, "--layout", "fsdp", *memory))  # Shard(0)/(1) -> Shard(0)
    assert (as_fsdp["start"], as_fsdp["digest"]) == (3, trained["digest"])
