"""The loop's parts without processes: the report book, the drive loop over a fake
platform, the inbox over real HTTP, and the contact verdicts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import control_helpers as h
from agent_harness import TOKEN, request_json
from conftest import wait_for
from trainguard.agent.server import AgentHTTPServer, ServerLimits
from trainguard.control.actions import JobPhase, LaunchNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.contact import (
    Contact,
    ContactRule,
    contact,
    launch_verdict,
    lost_reason,
    shown_state,
)
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeReport, NodeState, Refusal
from trainguard.platform.base import Cancel, Observation
from trainguard.platform.book import ReportBook, Taken
from trainguard.platform.drive import deliveries, drive
from trainguard.platform.inbox import Inbox
from trainguard.platform.transport import AgentTransport, Delivery
from trainguard.wire.requests import StopRequest
from trainguard.wire.status import NodeStatus, WorkerState

NODES = ("node-0", "node-1")
COUNT = ContactRule(3)  # one machine: 3 failed contacts in a row, however short


# -- contact ----------------------------------------------------------------------------


def test_silence_is_evidence_until_the_threshold_and_gone_is_lost_at_once() -> None:
    up = h.report("n", NodeState.RUNNING)
    assert contact(up, COUNT) is Contact.UP
    assert contact(NodeReport("n", up.status, failed_contacts=2), COUNT) is Contact.UP
    silent = NodeReport("n", up.status, failed_contacts=3, error="timed out")
    assert contact(silent, COUNT) is Contact.LOST
    assert lost_reason(silent, COUNT) == (
        "n lost: its agent did not answer 3 contacts in a row (limit 3) (last: timed out)"
    )
    assert contact(h.lost("n"), COUNT) is Contact.LOST
    assert contact(NodeReport("n"), COUNT) is Contact.PENDING
    assert contact(None, COUNT) is Contact.PENDING


def test_the_state_users_see_is_the_controllers_verdict_lost_after_included() -> None:
    # Across hosts (lost_after 8 s): 3 failed contacts over 2 s of silence leave the node
    # up; trainguard status and a TrainingJob's status show its agent's state, not lost.
    rule = ControlConfig("job", NODES, 2, lost_after=8.0).contact_rule
    assert rule == ContactRule(3, 8.0)
    quiet = NodeReport("n", h.status("n"), failed_contacts=3, silent_for=2.0)
    assert contact(quiet, rule) is Contact.UP
    assert shown_state(quiet, rule) is NodeState.RUNNING
    longer = replace(quiet, silent_for=8.5)
    assert contact(longer, rule) is Contact.LOST
    assert shown_state(longer, rule) is Contact.LOST
    assert shown_state(NodeReport("n"), rule) is Contact.PENDING
    assert shown_state(quiet, COUNT) is Contact.LOST  # one machine: the count alone


def test_launch_waits_for_idle_agents_and_loses_late_ones() -> None:
    reports = {"a": h.report("a", NodeState.READY, None), "b": NodeReport("b")}
    assert launch_verdict(("a", "b"), reports, COUNT, False, 60.0) == ([], ["b"])
    lost, waiting = launch_verdict(("a", "b"), reports, COUNT, True, 60.0)
    assert lost == [("b", "b lost: its agent was not ready within 60s")] and waiting == []


def test_a_node_waiting_for_a_host_waits_within_the_bound_and_is_lost_after_it() -> None:
    # Launch at t=100, no host for "b" since t=108; host_wait 600 s, start timeout 60 s.
    waiting_b = {"b": NodeReport("b", awaiting_host=108.0)}
    late = True  # the attempt's launch deadline (100 + 60) has passed
    assert launch_verdict(("b",), waiting_b, COUNT, late, 60.0, now=300.0, host_wait=600.0) == (
        [],
        ["b"],
    )
    lost, waiting = launch_verdict(("b",), waiting_b, COUNT, late, 60.0, now=708.0, host_wait=600.0)
    assert lost == [("b", "b lost: no host joined to run it within 600s")] and waiting == []
    # A host came at t=300: its agent's start timeout counts from its launch, not the
    # attempt's.
    launched = {"b": NodeReport("b", launched_at=300.0)}
    assert launch_verdict(("b",), launched, COUNT, late, 60.0, now=330.0, host_wait=600.0) == (
        [],
        ["b"],
    )
    lost, _ = launch_verdict(("b",), launched, COUNT, late, 60.0, now=361.0, host_wait=600.0)
    assert lost == [("b", "b lost: its agent was not ready within 60s")]


# -- the book ---------------------------------------------------------------------------


def test_the_book_keeps_the_newest_status_of_the_current_agent_only() -> None:
    book = ReportBook()
    book.reset("node-0", "node-0.1")
    status = h.status("node-0", NodeState.RUNNING, seq=5).model_copy(
        update={"incarnation": "node-0.1"}
    )
    assert book.answered(status) is Taken.TAKEN
    assert book.answered(status.model_copy(update={"seq": 4})) is Taken.STALE  # an older poll
    replaced = status.model_copy(update={"incarnation": "node-0.0", "seq": 9})
    assert book.answered(replaced) is Taken.FOREIGN
    book.failed("node-0", "refused")
    book.failed("node-0", "refused")
    assert book.reports()["node-0"].failed_contacts == 2
    assert book.answered(status.model_copy(update={"seq": 6})) is Taken.TAKEN
    report = book.reports()["node-0"]
    assert report.failed_contacts == 0 and report.status is not None and report.status.seq == 6
    book.gone("node-0", "its agent process exited")
    assert book.reports()["node-0"].gone == "its agent process exited"
    book.reset("node-0", "node-0.2")  # a fresh agent: nothing known of it
    assert book.reports()["node-0"] == NodeReport("node-0")


def test_a_push_wakes_the_loop_and_a_poll_does_not() -> None:
    book = ReportBook()
    book.reset("node-0", "node-0")
    status = h.status("node-0")
    book.answered(status)
    began = time.monotonic()
    book.wait(0.2)
    assert time.monotonic() - began >= 0.15
    threading.Timer(0.05, lambda: book.answered(status, push=True)).start()
    began = time.monotonic()
    book.wait(5.0)
    assert time.monotonic() - began < 2.0


class _Node:
    """An agent's node that is always ready (for an in-process agent server)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def snapshot(self) -> NodeStatus:
        return h.status(self.node_id).model_copy(update={"incarnation": self.node_id})


def test_a_poll_of_a_few_nodes_takes_each_answer_and_times_out_a_silent_agent() -> None:
    """One thread polls a few nodes at once: an agent that never answers (its port
    accepts, nothing reads) does not hold up the others' answers, and gets a failed
    contact after the timeout; a node whose kept-alive connection the agent closed is
    asked again on a new one."""
    book = ReportBook()
    quick_idle = ServerLimits(idle_seconds=0.3)  # the agents close idle connections soon
    nodes = [_Node(f"node-{i}") for i in (0, 1)]
    servers = [AgentHTTPServer("127.0.0.1", 0, n, TOKEN, limits=quick_idle) for n in nodes]  # type: ignore[arg-type]
    silent = socket.create_server(("127.0.0.1", 0))
    for node, server in zip(nodes, servers, strict=True):
        server.start()
        book.reset(node.node_id, node.node_id)
        book.located(node.node_id, f"http://127.0.0.1:{server.port}")
    book.reset("quiet", "quiet")
    book.located("quiet", f"http://127.0.0.1:{silent.getsockname()[1]}")
    transport = AgentTransport(book, TOKEN, poll_interval=1.0, timeout=1.0)
    try:
        transport.poll()
        reports = book.reports()
        assert all(reports[n.node_id].status is not None for n in nodes)
        assert reports["quiet"].failed_contacts == 1 and "timed out" in str(reports["quiet"].error)
        wait_for(lambda: all(s.connection_count() == 0 for s in servers), timeout=10.0)
        book.failed("node-0", "before")  # the next answer clears it
        transport.poll(["node-0", "node-1"])  # on kept-alive connections the agents closed
        assert book.reports()["node-0"].failed_contacts == 0
    finally:
        transport.close()
        silent.close()
        for server in servers:
            server.stop()


# -- the loop ---------------------------------------------------------------------------


class FakePlatform:
    """Nodes that come up at once and do what they are told; records every call."""

    def __init__(self, refuse: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.calls: list[tuple[str, Any]] = []
        self.reports: dict[str, NodeReport] = {}
        self.refuse = refuse
        self.cancel: Cancel | None = None
        self.turns = 0
        self.paces: list[float] = []

    def launch(self, request: LaunchNodes) -> None:
        self.calls.append(("launch", request.node_ids))
        self.reports.update(h.ready(request.node_ids))

    def retire(self, node_ids: Sequence[str]) -> None:
        self.calls.append(("retire", tuple(node_ids)))

    def send(self, sent: Sequence[Delivery]) -> list[Refusal]:
        refused = []
        for d in sent:
            self.calls.append((d.request, d.node_id))
            if d.request in self.refuse:
                refused.append(Refusal(d.node_id, d.request, d.attempt, "409 no"))
                continue
            if d.request == "start":
                rank = NODES.index(d.node_id)
                self.reports[d.node_id] = h.report(
                    d.node_id,
                    NodeState.COMPLETED,
                    d.attempt,
                    workers=h.workers(rank, WorkerState.SUCCEEDED),
                )
            if d.request == "stop":
                self.reports[d.node_id] = h.report(d.node_id, NodeState.STOPPED, d.attempt)
        return refused

    def wait(self, timeout: float) -> None:
        self.turns += 1

    def pace(self, interval: float) -> None:
        self.paces.append(interval)

    def observe(self, now: float) -> Observation:
        return Observation(dict(self.reports), self.cancel)

    def announce(self, controller: JobController) -> None:
        self.calls.append(("announce", [e.kind for e in controller.drain_events()]))

    def record(self, controller: JobController, observation: Observation | None) -> None:
        self.calls.append(("record", controller.phase.value))


def controller(**kw: Any) -> JobController:
    config = ControlConfig("job", NODES, 2, **kw)
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def test_drive_launches_starts_and_ends_with_the_job() -> None:
    platform = FakePlatform()
    c = controller()
    drive(c, platform, clock=lambda: 1.0)
    assert c.phase is JobPhase.SUCCEEDED
    sent = [call for call in platform.calls if call[0] not in ("record", "announce")]
    assert sent == [("launch", NODES), ("start", "node-0"), ("start", "node-1")]
    assert platform.calls[-1] == ("record", "Succeeded")


def test_the_decisions_are_told_before_they_are_carried_out() -> None:
    # A /stop to a cut-off host waits out its timeout: the fault that caused it is said
    # first, not after.
    platform = FakePlatform()
    c = controller()
    drive(c, platform, clock=lambda: 1.0)
    launch = platform.calls.index(("launch", NODES))
    told = [kinds for call, kinds in platform.calls[:launch] if call == "announce"]
    assert any("NodesLaunching" in kinds for kinds in told), platform.calls
    start = platform.calls.index(("start", "node-0"))
    told = [kinds for call, kinds in platform.calls[launch:start] if call == "announce"]
    assert any("AttemptStarted" in kinds for kinds in told), platform.calls


def test_drive_gives_refusals_back_to_the_controller_at_once() -> None:
    platform = FakePlatform(refuse={"start"})
    c = controller()
    drive(c, platform, clock=lambda: 1.0)
    assert c.phase is JobPhase.FAILED
    assert "refused /start of attempt 0" in (c.reason or "")


def test_drive_stops_on_a_cancel() -> None:
    platform = FakePlatform()
    platform.cancel = Cancel("deleted by user")
    c = controller()
    drive(c, platform, clock=lambda: 1.0)
    assert (c.phase, c.reason) == (JobPhase.STOPPED, "deleted by user")


def test_a_stop_action_is_one_delivery_per_node() -> None:
    from trainguard.control.actions import StopNodes

    [a, b] = deliveries(StopNodes(3, NODES, "process", 0.0, capture_stacks=True))
    assert (a.node_id, b.node_id, a.request, a.attempt) == ("node-0", "node-1", "stop", 3)
    assert a.payload == StopRequest(attempt=3, mode="process", timeout=0.0, capture_stacks=True)


# -- the inbox --------------------------------------------------------------------------


def post(url: str, body: bytes, token: str | None) -> tuple[int, dict[str, Any]]:
    return request_json(url, "POST", body, token)


def test_the_inbox_takes_a_jobs_pushes_with_its_token_only(inbox: Inbox) -> None:
    book = ReportBook()
    book.reset("node-0", "node-0")
    url = inbox.register("job-a", "secret", lambda s: book.answered(s, push=True))
    assert url.startswith("http://127.0.0.1:") and url.endswith("/report/job-a")
    body = h.status("node-0", NodeState.FAULTED).model_dump_json().encode()
    assert post(url, body, "wrong")[0] == 401
    assert post(url, body, None)[0] == 401
    assert post(url.replace("job-a", "job-b"), body, "secret")[0] == 401  # no such job
    code, reply = post(url, b'{"node_id": "node-0"}', "secret")
    assert code == 400 and reply["error"] == "status.pid: missing"
    assert post(url, body, "secret") == (202, {"accepted": True})
    status = book.reports()["node-0"].status
    assert status is not None and status.state is NodeState.FAULTED
    stranger = h.status("node-9").model_dump_json().encode()
    assert post(url, stranger, "secret")[0] == 409
    older = h.status("node-0", NodeState.RUNNING, seq=-1).model_dump_json().encode()
    assert post(url, older, "secret") == (202, {"accepted": True})  # accepted, dropped
    assert book.reports()["node-0"].status.state is NodeState.FAULTED  # type: ignore[union-attr]
    inbox.unregister("job-a")
    assert post(url, body, "secret")[0] == 401  # the job ended
