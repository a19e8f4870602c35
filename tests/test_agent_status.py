"""Status wire format and the exec shim (both without torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.wire.base import WireError
from trainguard.wire.status import NodeState, NodeStatus, WorkerState, WorkerStatus


def sample() -> NodeStatus:
    return NodeStatus(
        node_id="node-1",
        incarnation="node-1.2",
        pid=42,
        seq=7,
        state=NodeState.FAULTED,
        attempt=3,
        reason="rank 5 exited with signal SIGKILL",
        updated_at=1700000000.5,
        workers=(
            WorkerStatus(
                local_rank=0, rank=4, pid=100, state=WorkerState.STOPPED, exitcode=-15,
                signal="SIGTERM",
            ),
            WorkerStatus(
                local_rank=1, rank=5, pid=101, state=WorkerState.FAILED, exitcode=-9,
                signal="SIGKILL",
            ),
        ),
    )  # fmt: skip


def test_status_round_trips_through_json() -> None:
    assert NodeStatus.from_json(sample().to_json()) == sample()
    assert NodeStatus.model_validate_json(sample().model_dump_json()) == sample()


def test_describe_exit() -> None:
    worker = WorkerStatus(
        local_rank=1, rank=5, pid=101, state=WorkerState.FAILED, exitcode=3, error="ValueError: x"
    )
    assert worker.describe_exit() == "rank 5 exited with exit code 3: ValueError: x"
    assert sample().workers[1].describe_exit() == "rank 5 exited with signal SIGKILL"


def test_quiescent_means_no_worker_runs() -> None:
    assert sample().quiescent
    running = sample().workers[0].model_copy(update={"state": WorkerState.RUNNING})
    assert not sample().model_copy(update={"workers": (running,)}).quiescent
    assert not sample().model_copy(update={"state": NodeState.STOPPING, "workers": ()}).quiescent


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"state": "dancing"}, "status.state"),
        ({"pid": "42"}, "status.pid"),
        ({"updated_at": None}, "status.updated_at"),
        ({"workers": {}}, "status.workers"),
        ({"workers": [{"local_rank": 0}]}, "status.workers[0].rank"),
        ({"colour": "blue"}, "status.colour: unknown field"),
    ],
)
def test_bad_status_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(WireError, match=field.replace("[", r"\[").replace("]", r"\]")):
        NodeStatus.from_json(sample().to_json() | change, "status")


def shim(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainguard.agent.exec_worker", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=cwd)


def test_shim_execs_the_command_in_place(tmp_path: Path) -> None:
    code = "import os; print(os.getcwd())"
    result = shim(
        "--parent-pid", str(os.getpid()), "--cwd", str(tmp_path), "--", sys.executable, "-c", code
    )
    assert (result.returncode, result.stdout) == (0, f"{tmp_path}\n")


def test_shim_passes_the_exit_code_through() -> None:
    result = shim(
        "--parent-pid", str(os.getpid()), "--", sys.executable, "-c", "raise SystemExit(7)"
    )
    assert result.returncode == 7


def test_shim_refuses_when_the_agent_is_not_its_parent() -> None:
    result = shim("--parent-pid", "1", "--", "true")
    assert result.returncode == 1 and "is gone" in result.stderr


def test_shim_reports_a_missing_command() -> None:
    result = shim("--parent-pid", str(os.getpid()), "--", "no-such-command-xyz")
    assert result.returncode == 127 and "no-such-command-xyz" in result.stderr
