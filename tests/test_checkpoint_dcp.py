"""DCP save/async_save/load through trainguard's tiers (memory, durable on a local path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.dcp import (
    TieredStorageReader,
    TieredStorageWriter,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_MEMORY_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("TRAINGUARD_JOB_ID", "dcpjob")
    for name in ("TRAINGUARD_CHECKPOINT_CONFIG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optim.step()
    extra = {"step": seed, "name": f"run-{seed}", "ints": torch.arange(5, dtype=torch.int64)}
    return {"model": model.state_dict(), "optim": optim.state_dict(), "extra": extra}


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_save_load_round_trip_is_bit_identical(tmp_path: Path) -> None:
    saved = _state(1)
    dcp.save(saved, storage_writer=TieredStorageWriter(step=100))
    target = _state(2)
    reader = TieredStorageReader()
    dcp.load(target, storage_reader=reader)
    _assert_same(saved, target)
    assert reader.loaded_step == 100
    assert reader.sources["rank-0"] == "memory"


def test_async_save_with_durable_round_trip(tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    saved = _state(3)
    done = dcp.async_save(
        saved, storage_writer=TieredStorageWriter(step=7, durable_url=url, durable=True)
    )
    done.result(timeout=60)
    assert (tmp_path / "durable/dcp/dcpjob/step-0000000007/COMMITTED").exists()
    target = _state(4)
    dcp.load(target, storage_reader=TieredStorageReader(step=7, durable_url=url))
    _assert_same(saved, target)


def test_newest_step_is_loaded_and_old_memory_steps_pruned(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        dcp.save(_state(step), storage_writer=TieredStorageWriter(step=step, memory_keep=2))
    steps = sorted(os.listdir(tmp_path / "shm/dcp"))
    assert steps == ["step-3", "step-4"]
    target = _state(9)
    dcp.load(target, storage_reader=TieredStorageReader())
    _assert_same(_state(4), target)
    older = _state(9)
    dcp.load(older, checkpoint_id="step-3", storage_reader=TieredStorageReader())
    _assert_same(_state(3), older)


def test_metadata_is_json_not_pickle(tmp_path: Path) -> None:
    dcp.save(_state(1), storage_writer=TieredStorageWriter(step=5))
    raw = (tmp_path / "shm/dcp/step-5/metadata.json").read_bytes()
    assert not raw.startswith(b"\x80")  # no pickle protocol header
    doc = json.loads(raw)
    assert doc["kind"] == "dcp-metadata" and doc["world_size"] == 1
    assert "model.0.weight" in doc["metadata"]["state_dict_metadata"]
    rank_meta = json.loads((tmp_path / "shm/dcp/step-5/rank-0.json").read_bytes())
    assert rank_meta["checksum"].startswith("xxh3_128:")


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_rank_file_gives_clear_error(tmp_path: Path) -> None:
    dcp.save(_state(1), storage_writer=TieredStorageWriter(step=11))
    _corrupt(tmp_path / "shm/dcp/step-11/rank-0.data")
    with pytest.raises(CheckpointException) as info:  # a BaseException, not an Exception
        dcp.load(_state(2), storage_reader=TieredStorageReader())
    text = str(info.value)
    assert "step 11" in text and "rank 0" in text and "rank-0.data" in text
    assert "checksum mismatch" in text


def test_missing_rank_file_gives_clear_error(tmp_path: Path) -> None:
    dcp.save(_state(1), storage_writer=TieredStorageWriter(step=12))
    os.unlink(tmp_path / "shm/dcp/step-12/rank-0.data")
    with pytest.raises(CheckpointException, match=r"step 12 rank 0: .*rank-0\.data"):
        dcp.load(_state(2), storage_reader=TieredStorageReader())


def test_corrupt_memory_falls_back_to_durable(tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    saved = _state(5)
    dcp.save(saved, storage_writer=TieredStorageWriter(step=20, durable=True, durable_url=url))
    _corrupt(tmp_path / "shm/dcp/step-20/rank-0.data")
    _corrupt(tmp_path / "shm/dcp/step-20/metadata.json")
    target = _state(6)
    reader = TieredStorageReader(durable_url=url)
    dcp.load(target, storage_reader=reader)
    _assert_same(saved, target)
    assert reader.sources == {"metadata": "durable", "rank-0": "durable"}


def test_durable_only_after_memory_is_gone(tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    saved = _state(7)
    dcp.save(saved, storage_writer=TieredStorageWriter(step=30, durable=True, durable_url=url))
    shutil.rmtree(tmp_path / "shm")
    target = _state(8)
    dcp.load(target, storage_reader=TieredStorageReader(durable_url=url))
    _assert_same(saved, target)


def test_no_checkpoint_and_bad_arguments() -> None:
    with pytest.raises(CheckpointException, match="no DCP checkpoint"):
        dcp.load(_state(1), storage_reader=TieredStorageReader())
    with pytest.raises(ValueError, match="durable_url"):
        TieredStorageWriter(step=1, durable=True)
    with pytest.raises(ValueError, match="step"):
        TieredStorageWriter(step="latest")  # type: ignore[arg-type]
    with pytest.raises(CheckpointException, match="no step"):
        dcp.save(_state(1), storage_writer=TieredStorageWriter())


_WORKER = textwrap.dedent(
    """
    import atexit, sys, time, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from trainguard.checkpoint.dcp import TieredStorageReader, TieredStorageWriter
    # torch 2.13's gloo thread may free the last work after the interpreter began to end,
    # and abort the process (docs/development.md): let it take the GIL first.
    atexit.register(time.sleep, 0.1)
    rank, url = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {"shared": torch.randn(4, 4, generator=g),
                f"own{rank}": torch.randn(3, generator=g) + rank, "meta": {"seed": seed}}
    saved = state(1)
    dcp.save(saved, storage_writer=TieredStorageWriter(step=3, durable=True, durable_url=url))
    target = state(2)
    reader = TieredStorageReader(durable_url=url)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(saved["shared"], target["shared"]), rank
    assert torch.equal(saved[f"own{rank}"], target[f"own{rank}"]), rank
    assert target["meta"] == {"seed": 1}, target["meta"]
    dist.destroy_process_group()
    print("OK", rank, reader.loaded_step)
    """
)


def test_two_ranks_over_gloo(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["WORLD_SIZE"] = "2"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "durable")],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=90) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, err[-3000:]
        assert f"OK {rank} 3" in out
    files = sorted(os.listdir(tmp_path / "shm/dcp/step-3"))
    assert files == ["metadata.json", "rank-0.data", "rank-0.json", "rank-1.data", "rank-1.json"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
