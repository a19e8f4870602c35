"""The checkpointless stall's breakdown, from a job's timeline (bench/stall_breakdown.py)."""

from __future__ import annotations

from typing import Any

import pytest
from bench.stall_breakdown import breakdown


def _event(kind: str, time: float, **data: Any) -> dict[str, Any]:
    return {"kind": kind, "time": time, "data": data}


def test_the_phases_of_an_in_process_recovery_add_up_to_its_stall() -> None:
    fault = 100.0
    job = {
        "faults": [{"attempt": 0, "detected_at": fault + 0.03}],
        "events": [
            _event("FaultInjected", fault),
            _event("InProcessRestart", fault + 0.02, attempt=0),
            _event("InProcessRestart", fault + 0.05, attempt=0),
            _event("AttemptJoined", fault + 0.15, attempt=1, state_seconds=0.01),
            _event("AttemptJoined", fault + 0.20, attempt=1, state_seconds=0.04),
        ],
    }
    parts = breakdown(job, fault, 0.31)
    assert parts == pytest.approx(
        {"detect_s": 0.03, "abort_s": 0.05, "reform_s": 0.11, "state_s": 0.04, "first_step_s": 0.11}
    )
    overlap = max(parts["detect_s"], parts["abort_s"])
    assert overlap + parts["reform_s"] + 0.04 + parts["first_step_s"] == pytest.approx(0.31)


def test_no_breakdown_without_the_in_process_events() -> None:
    job = {"faults": [{"attempt": 0, "detected_at": 1.0}], "events": []}
    assert breakdown(job, 0.0, 2.0) is None
    assert breakdown({"faults": [], "events": []}, 0.0, 2.0) is None
    assert breakdown(job, 0.0, None) is None
