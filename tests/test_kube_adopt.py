"""What a new operator reads back from a TrainingJob's status (kube/adopt.py), pure."""

from __future__ import annotations

import json
from typing import Any

import control_helpers as h
from test_control_elastic import NODES, stopped
from test_control_elastic import make as elastic_make
from test_control_resume import RECORDED, make
from trainguard.control.actions import LaunchNodes, StopNodes
from trainguard.control.reports import NodeState
from trainguard.control.resume import adopt, restart
from trainguard.kube.adopt import recorded, takeover_record


def status_of(record: dict[str, Any], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """As the API server stores it: JSON, with the rest of the status around it."""
    stored: dict[str, Any] = json.loads(
        json.dumps({"phase": "Running", "takeover": record, "faults": faults})
    )
    return stored


def test_the_takeover_record_reads_back_as_what_was_recorded() -> None:
    c = make()
    c.take_over(100.0, adopt(c.config, 100.0, RECORDED, ["node-0", "node-1"]))
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
    successor.take_over(200.0, adopt(successor.config, 200.0, back, ["node-0", "node-1"]))
    assert successor.restarts == 1 and successor.attempts[-1].number == 1
    assert successor.timeline.to_json()[0]["fault_step"] == 50


def test_no_record_or_a_broken_one_means_a_new_start() -> None:
    assert recorded(None) is None
    assert recorded({"phase": "Pending"}) is None
    good = takeover_record(make())
    assert recorded(status_of(good, [])) is None  # never started: nothing to go on
    c = make()
    c.take_over(100.0, adopt(c.config, 100.0, RECORDED, ["node-0", "node-1"]))
    record = takeover_record(c)
    for broken in (
        {**record, "attempts": [{"number": "x"}]},
        {**record, "attempts": list(reversed(record["attempts"]))},
        {**record, "restarts": [{"time": 1.0, "scope": "galaxy"}]},
        {**record, "startedAt": "yesterday"},
        {**record, "attempts": [{**record["attempts"][0], "rendezvous": {"addr": "a"}}]},
    ):
        assert recorded(status_of(broken, [])) is None, broken


def test_an_elastic_job_is_taken_over_at_the_size_it_has_with_its_scaling_memory() -> None:
    c = elastic_make()
    c.set_capacity(1, ["node-1"])
    [stop] = c.observe(1.0, h.reports(NODES, NodeState.RUNNING, 0))
    assert isinstance(stop, StopNodes)
    c.observe(2.0, stopped(NODES, 0))  # restarts at 1 node, node-1 goes back to the pool
    assert c.elastic is not None
    c.elastic.failures = 2  # as after two scale-ups whose nodes did not come up
    back = recorded(status_of(takeover_record(c), c.timeline.to_json()))
    assert back is not None and back.nodes == ("node-0",)
    assert back.growth is not None and set(back.growth) == {"node-1", "node-2"}
    assert back.elastic is not None
    assert (back.elastic.failures, back.elastic.last_scaling, back.elastic.target) == (2, 2.0, 1)

    successor = elastic_make(begin=False)
    successor.take_over(10.0, adopt(successor.config, 10.0, back, list(back.nodes)))
    assert successor.nodes == ("node-0",) and set(successor.growth) == {"node-1", "node-2"}
    assert successor.current is not None and len(successor.current.assignments) == 1
    assert successor.elastic is not None and successor.elastic.failures == 2
    assert successor.elastic.last_scaling == 2.0
    # A successor that cannot adopt restarts at the recorded size, not the spec's.
    fresh = elastic_make(begin=False)
    [launch] = fresh.take_over(10.0, restart(fresh.config, 10.0, back, "the pods are gone"))
    assert isinstance(launch, LaunchNodes) and launch.node_ids == ("node-0",)
    assert fresh.checkpoints.world_size == 2  # 1 node x 2 processes
