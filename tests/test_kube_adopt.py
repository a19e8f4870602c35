"""What a new operator reads back from a TrainingJob's status (kube/adopt.py), pure."""

from __future__ import annotations

import json
from typing import Any

from test_control_resume import RECORDED, make
from trainguard.control.resume import adopt
from trainguard.kube.adopt import recorded, takeover_record


def status_of(record: dict[str, Any], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """As the API server stores it: JSON, with the rest of the status around it."""
    stored: dict[str, Any] = json.loads(
        json.dumps({"phase": "Running", "takeover": record, "faults": faults})
    )
    return stored


def test_the_takeover_record_reads_back_as_what_was_recorded() -> None:
    c = make()
    adopt(c, 100.0, RECORDED, ["node-0", "node-1"])
    back = recorded(status_of(takeover_record(c), c.timeline.to_json()))
    assert back is not None
    assert back.started_at == RECORDED.started_at
    assert back.restarts == RECORDED.restarts  # the budget goes on where it was
    assert [(a.number, a.phase, a.endpoint) for a in back.attempts] == [
        (0, "Failed", RECORDED.attempts[0].endpoint),
        (1, "Running", RECORDED.attempts[1].endpoint),
    ]
    assert back.newest is not None and back.newest.started_at == RECORDED.attempts[1].started_at
    # The successor's controller adopts it just the same.
    successor = make()
    adopt(successor, 200.0, back, ["node-0", "node-1"])
    assert successor.restarts == 1 and successor.attempts[-1].number == 1
    assert successor.timeline.to_json()[0]["fault_step"] == 50


def test_no_record_or_a_broken_one_means_a_new_start() -> None:
    assert recorded(None) is None
    assert recorded({"phase": "Pending"}) is None
    good = takeover_record(make())
    assert recorded(status_of(good, [])) is None  # never started: nothing to go on
    c = make()
    adopt(c, 100.0, RECORDED, ["node-0", "node-1"])
    record = takeover_record(c)
    for broken in (
        {**record, "attempts": [{"number": "x"}]},
        {**record, "attempts": list(reversed(record["attempts"]))},
        {**record, "restarts": [{"time": 1.0, "scope": "galaxy"}]},
        {**record, "startedAt": "yesterday"},
        {**record, "attempts": [{**record["attempts"][0], "rendezvous": {"addr": "a"}}]},
    ):
        assert recorded(status_of(broken, [])) is None, broken
