"""Worker events: written by the worker, read by the agent, added once by the controller."""

from __future__ import annotations

from pathlib import Path

import pytest

import control_helpers as h
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeState
from trainguard.monitor import worker_events
from trainguard.monitor.worker_events import EVENT_DIR_ENV, read_events


def test_emit_and_read_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    worker_events.emit("CheckpointRestored", "restored step 7", step=7, tier="memory")
    worker_events.emit("CheckpointCommitted", "step 8 committed", step=8)
    (tmp_path / "rank-3.jsonl").open("a").write('{"seq": 99, "kind": "half')  # being written
    [first, second] = read_events(tmp_path)
    assert (first.rank, first.kind, first.data) == (
        3,
        "CheckpointRestored",
        {"step": 7, "tier": "memory"},
    )
    assert second.seq > first.seq and second.kind == "CheckpointCommitted"


def test_a_worker_cannot_report_a_controllers_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: a worker writes its event file itself; a JobSucceeded of its making
    would be printed as "[trainguard] ... JobSucceeded" and enter the timeline."""
    monkeypatch.setenv(EVENT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    worker_events.emit("JobSucceeded", "all ranks completed (FAKE)")
    worker_events.emit("CheckpointRestored", "restored step 7", step=7)
    assert [e.kind for e in read_events(tmp_path)] == ["CheckpointRestored"]


def test_emit_is_a_no_op_outside_trainguard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(EVENT_DIR_ENV, raising=False)
    worker_events.emit("Anything", "nothing happens")
    assert read_events(tmp_path) == []


def test_controller_adds_each_worker_event_once() -> None:
    c = JobController(ControlConfig("job", ("n0",), 1), lambda a, n: StoreEndpoint("127.0.0.1", 1))
    h.begin(c)
    event = worker_events.WorkerEvent(
        rank=0, seq=1, time=0.5, kind="CheckpointRestored", message="restored", data={"step": 3}
    )
    report = {"n0": h.report("n0", NodeState.RUNNING, 0, events=(event,))}
    c.observe(1.0, report)
    c.observe(2.0, report)
    restored = [e for e in c.drain_events() if e.kind == "CheckpointRestored"]
    assert len(restored) == 1 and restored[0].node == "n0" and restored[0].data == {"step": 3}
