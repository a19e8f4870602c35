"""Every host shows the job: the controller's event lines go to each joined host with its
next lease, each line once, from the host's join on."""

from __future__ import annotations

from trainguard.hosts.roster import Roster
from trainguard.hosts.service import EVENTS_KEPT, HostsService
from trainguard.wire.hosts import MAX_LEASE_EVENTS


def _service() -> HostsService:
    return HostsService(Roster(("node-0", "node-1"), (), {}), "t", lease_seconds=1.0,
                        partition_timeout=60.0)  # fmt: skip


def test_each_host_gets_each_line_once_from_its_join_on() -> None:
    service = _service()
    service.publish("12:00:00 JobStarted: before h1 joined")
    service._handed.setdefault("h1", service._published)  # what a join does
    service.publish("12:00:01 Fault: node-1 lost")
    service.publish("12:00:02 AttemptStarted: attempt 1")
    assert service._unseen("h1") == [
        "12:00:01 Fault: node-1 lost",
        "12:00:02 AttemptStarted: attempt 1",
    ]
    assert service._unseen("h1") == []
    service.publish("12:00:03 JobSucceeded: done")
    assert service._unseen("h1") == ["12:00:03 JobSucceeded: done"]


def test_a_host_far_behind_gets_the_newest_lines_a_lease_can_hold() -> None:
    service = _service()
    service._handed["h1"] = 0
    for n in range(EVENTS_KEPT + 50):
        service.publish(f"line {n}")
    lines = service._unseen("h1")
    assert len(lines) == MAX_LEASE_EVENTS
    assert lines[-1] == f"line {EVENTS_KEPT + 49}"
