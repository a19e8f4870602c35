"""trainguard.data across real processes on one node's cache: two ranks fed by one reader,
the reader SIGKILLed (another rank takes over), a restarted rank resuming at the exact
batch from the cache, without reading the source again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.data.reader import open_layout

WORKER = """
import json, os, sys, time
import torch
from trainguard.data import DataCache

directory, log, out = sys.argv[1:4]
steps, pace = json.loads(sys.argv[4]), float(sys.argv[5])

class Logged(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {i}\\n")
        time.sleep(0.005)
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i)}

cache = DataCache(Logged(), 8, directory=directory, ahead=4, lookback=64, workers=2)
for step in steps:
    batch = cache.batch(step)
    with open(out, "a") as f:
        f.write(json.dumps({"step": step, "y": batch["y"].tolist()}) + "\\n")
    time.sleep(pace)
if os.environ.get("HOLD"):
    time.sleep(600)
cache.close()
"""


def _start(
    tmp: Path, name: str, rank: int, world: int, steps: list[int], pace: float, hold: bool = False
) -> subprocess.Popen[bytes]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
    env.pop("TRAINGUARD_CHECKPOINT_MEMORY_DIR", None)
    if hold:
        env["HOLD"] = "1"
    argv = [
        sys.executable,
        str(script),
        str(tmp / "cache"),
        str(tmp / "reads.log"),
        str(tmp / f"{name}.out"),
        json.dumps(steps),
        str(pace),
    ]
    return subprocess.Popen(argv, env=env)


def _results(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / f"{name}.out"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _reads(tmp: Path) -> list[tuple[int, int]]:
    path = tmp / "reads.log"
    if not path.exists():
        return []
    return [(int(p), int(i)) for p, i in (line.split() for line in path.read_text().splitlines())]


def _wait(what: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _cached(tmp: Path, step: int) -> bool:
    directories = list((tmp / "cache").glob("data-*"))
    slots = open_layout(directories[0]) if directories else None
    if slots is None:
        return False
    try:
        return bool(slots.holding(step))
    finally:
        slots.close()


def _expected(step: int, rank: int, world: int) -> list[int]:
    per = 8 // world
    return list(range(step * 8 + rank * per, step * 8 + (rank + 1) * per))


def test_two_ranks_one_reader_then_the_reader_is_killed(tmp_path: Path) -> None:
    steps = list(range(40))
    ranks = [_start(tmp_path, f"rank{r}", r, 2, steps, 0.05) for r in (0, 1)]
    try:
        _wait(
            lambda: len(_results(tmp_path, "rank0")) >= 5 and len(_results(tmp_path, "rank1")) >= 5
        )
        readers = {pid for pid, _ in _reads(tmp_path)}
        assert len(readers) == 1, f"one reader per node, not {readers}"
        reader = readers.pop()
        victim = next(p for p in ranks if p.pid == reader)
        survivor = next(p for p in ranks if p.pid != reader)
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        assert survivor.wait(120) == 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    name = f"rank{ranks.index(survivor)}"
    rank = ranks.index(survivor)
    got = _results(tmp_path, name)
    assert [r["step"] for r in got] == steps
    assert all(r["y"] == _expected(r["step"], rank, 2) for r in got)
    reads = _reads(tmp_path)
    assert {pid for pid, _ in reads} == {reader, survivor.pid}  # it took over reading
    survivor_reads = [i for pid, i in reads if pid == survivor.pid]
    assert max(survivor_reads) // 8 >= 30  # it read the steps its reader had not reached


@pytest.mark.long  # two processes in a row (torch imported twice): 30 s at load 11
def test_a_restarted_rank_resumes_from_the_cache(tmp_path: Path) -> None:
    first = _start(tmp_path, "before", 0, 1, list(range(10)), 0.0, hold=True)
    try:
        # the dead rank's reader had prefetched 4 ahead (steps 10..13) before it was killed
        _wait(lambda: _cached(tmp_path, 13))
        _wait(lambda: len(_results(tmp_path, "before")) == 10)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    # its replacement resumes at step 10 (the checkpoint's position), rolls back to 5 (in
    # the lookback) and goes on to 16
    steps = [10, 11, 12, 13, 5, 14, 15, 16]
    second = _start(tmp_path, "after", 0, 1, steps, 0.0)
    assert second.wait(120) == 0
    got = _results(tmp_path, "after")
    assert [r["step"] for r in got] == steps
    assert all(r["y"] == _expected(r["step"], 0, 1) for r in got)
    again = {i // 8 for pid, i in _reads(tmp_path) if pid == second.pid}
    assert not again & {5, 10, 11, 12, 13}, f"re-read steps {sorted(again)}"
    assert {14, 15, 16} <= again
