"""The controller's poll pace (control/pace.py): seldom while every rank trains and no
timer is near, at ``poll_interval`` otherwise; and the transport that follows it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import control_helpers as h
from conftest import wait_for
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeReport
from trainguard.monitor.rules import LogRuleSpec
from trainguard.platform.book import ReportBook
from trainguard.platform.transport import AgentTransport
from trainguard.wire.status import NodeState, Progress, RuleActivity, WorkerState

NODES = ("node-0", "node-1")
FAST, QUIET = 0.5, 2.0


def controller(**cfg: Any) -> JobController:
    given: dict[str, Any] = {"quiet_poll_interval": QUIET, "no_progress_timeout": None, **cfg}
    config = ControlConfig(
        job_id="j", node_ids=NODES, nproc_per_node=h.NPROC, poll_interval=FAST, **given
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    return c


def training(**per_node: NodeReport) -> dict[str, NodeReport]:
    return h.reports(NODES, NodeState.RUNNING, 0, **per_node)


def pace(c: JobController, now: float, reports: Mapping[str, NodeReport]) -> float:
    c.observe(now, reports)
    return c.pace(now, reports)


def test_quiet_while_every_rank_trains_fast_while_anything_else_goes_on() -> None:
    c = controller()
    assert c.pace(0.0, h.ready(NODES)) == FAST  # launching
    assert pace(c, 1.0, training()) == QUIET
    silent = NodeReport("node-1", training()["node-1"].status, failed_contacts=1)
    assert pace(c, 2.0, training(**{"node-1": silent})) == FAST
    exited = h.report("node-1", NodeState.RUNNING, 0, workers=h.workers(1, WorkerState.SUCCEEDED))
    assert c.pace(3.0, training(**{"node-1": exited})) == FAST
    behind = h.report("node-1", NodeState.RUNNING, None)
    assert c.pace(3.0, training(**{"node-1": behind})) == FAST
    assert pace(c, 4.0, training(**{"node-0": h.crashed("node-0", 0)})) == FAST  # stopping


def test_without_a_quiet_interval_the_pace_is_always_the_poll_interval() -> None:
    c = controller(quiet_poll_interval=None)
    assert pace(c, 1.0, training()) == FAST


def test_a_hang_timer_near_makes_the_pace_fast_before_it_can_fire() -> None:
    rule = LogRuleSpec(
        name="Loss", log_pattern=".*Loss.*", expected_recurring_frequency_in_seconds=10
    )
    c = controller(log_rules=(rule,))

    def matched(at: float) -> dict[str, NodeReport]:
        activity = {"Loss": RuleActivity(last_match_at=at, matches=1)}
        return {
            n: h.report(n, NodeState.RUNNING, 0, workers=h.workers(i), rules=activity)
            for i, n in enumerate(NODES)
        }

    assert pace(c, 5.0, matched(4.9)) == QUIET  # due at 14.9: not near
    assert pace(c, 12.0, matched(4.9)) == QUIET  # 14.9 > 12 + 2 + 0.5
    assert pace(c, 12.5, matched(4.9)) == FAST  # 14.9 <= 12.5 + 2 + 0.5
    assert pace(c, 13.0, matched(12.9)) == QUIET  # it matched again


def test_the_progress_timer_makes_the_pace_fast_before_a_stall_can_be_found() -> None:
    c = controller(no_progress_timeout=5.0)
    reports = {
        n: h.report(
            n,
            NodeState.RUNNING,
            0,
            workers=h.workers(i),
            progress=Progress(step=12, time=3.0, first_step=1, first_time=0.1),
        )
        for i, n in enumerate(NODES)
    }
    assert pace(c, 1.5, reports) == QUIET  # a stall is due at 3.0 + 5
    assert pace(c, 5.6, reports) == FAST


def test_the_transport_polls_at_the_pace_and_a_shorter_one_starts_at_once() -> None:
    book = ReportBook()
    transport = AgentTransport(book, "t", poll_interval=30.0)
    transport.start()
    try:
        wait_for(lambda: len(transport.cycle_seconds) >= 1, timeout=30)
        time.sleep(0.3)
        assert len(transport.cycle_seconds) == 1  # the next one is 30 s away
        transport.pace(0.1)
        wait_for(lambda: len(transport.cycle_seconds) >= 3, timeout=30)
    finally:
        transport.close()
