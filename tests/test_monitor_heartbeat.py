"""`trainguard.heartbeat()` in a real worker process, and the agent-side reader."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

import trainguard
from trainguard.monitor.heartbeat import HEARTBEAT_DIR_ENV, Beat, read_heartbeats

WORKER = """
import sys, time
import trainguard
assert "torch" not in sys.modules, "trainguard must not import torch"
for step in range(int(sys.argv[1])):
    trainguard.heartbeat(step=step)
    time.sleep(float(sys.argv[2]))
trainguard.heartbeat()
"""


def run_worker(env: dict[str, str], steps: int, sleep: float) -> None:
    subprocess.run(
        [sys.executable, "-c", WORKER, str(steps), str(sleep)],
        env={**os.environ, **env},
        check=True,
        timeout=60,
    )


def test_round_trip_per_rank(tmp_path: Path) -> None:
    before = time.time()
    run_worker({HEARTBEAT_DIR_ENV: str(tmp_path), "RANK": "3"}, steps=4, sleep=0.0)
    run_worker({HEARTBEAT_DIR_ENV: str(tmp_path), "RANK": "5"}, steps=3, sleep=0.25)
    beats = read_heartbeats(tmp_path)
    assert set(beats) == {3, 5}
    assert beats[3].step in {0, 1, 2, 3, None}
    # rank 5 waited longer than the write interval: every beat was written, the last one
    # without a step
    assert beats[5].step is None
    assert before <= beats[3].time <= beats[5].time <= time.time()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-3", "rank-5"]  # no temp files


@pytest.fixture
def writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The heartbeat module in this process, writing to ``tmp_path`` as rank 1."""
    module = sys.modules["trainguard.heartbeat"]
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(module, "_last_write", float("-inf"))
    monkeypatch.setattr(module, "_last_dir", None)
    return module


def test_writes_are_throttled(
    writer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "WRITE_INTERVAL", 3600.0)
    for step in range(100):
        trainguard.heartbeat(step=step)
    assert read_heartbeats(tmp_path)[1].step == 0  # the first call writes, then none for 1 h


def test_every_call_writes_when_the_interval_has_passed(
    writer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "WRITE_INTERVAL", 0.0)
    for step in range(5):
        trainguard.heartbeat(step=step)
        assert read_heartbeats(tmp_path)[1].step == step


def test_no_op_without_the_env_var(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != HEARTBEAT_DIR_ENV}
    subprocess.run(
        [sys.executable, "-c", WORKER, "3", "0"], env=env, cwd=tmp_path, check=True, timeout=60
    )
    assert list(tmp_path.iterdir()) == []
    trainguard.heartbeat(step=1)  # in this process too (the variable is not set here)


def test_unwritable_dir_does_not_stop_training(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "deeper"
    done = subprocess.run(
        [sys.executable, "-c", WORKER, "2", "0"],
        env={**os.environ, HEARTBEAT_DIR_ENV: str(missing), "RANK": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "trainguard.heartbeat: cannot write" in done.stderr


def test_reader_skips_partial_and_garbage_files(tmp_path: Path) -> None:
    (tmp_path / "rank-0").write_text('{"step": 12, "time": 1700000000.5}')
    (tmp_path / "rank-1").write_text('{"step": 12, "ti')  # partial
    (tmp_path / "rank-2").write_bytes(b"\xff\xfe garbage")
    (tmp_path / "rank-3").write_text('{"step": "12", "time": 1.0}')
    (tmp_path / "rank-4").write_text('{"step": null, "time": 2}')
    (tmp_path / "rank-5").write_text("[1, 2]")
    (tmp_path / "rank-6").write_text('{"step": 1, "time": NaN}')
    (tmp_path / "rank-7.tmp123").write_text('{"step": 1, "time": 1.0}')
    (tmp_path / "notes").write_text("x")
    (tmp_path / "rank-8").mkdir()
    assert read_heartbeats(tmp_path) == {
        0: Beat(step=12, time=1700000000.5),
        4: Beat(step=None, time=2.0),
    }
    assert read_heartbeats(tmp_path / "missing") == {}


def test_step_must_be_an_int(tmp_path: Path) -> None:
    code = "import trainguard; trainguard.heartbeat(step='3')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, HEARTBEAT_DIR_ENV: str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "step must be an int" in done.stderr
