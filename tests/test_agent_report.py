"""Report first: the agent notices a worker's exit at once and pushes it to the controller
before it cleans anything up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import control_helpers as h
from agent_harness import AgentProcess, make_assignment, spawn_agent, wait_for_text
from conftest import wait_for
from trainguard.agent.exits import ExitWatcher
from trainguard.agent.logs import LogLayout
from trainguard.agent.reporter import Reporter
from trainguard.platform.book import ReportBook, Taken
from trainguard.platform.inbox import Inbox
from trainguard.wire.requests import AttemptRequest
from trainguard.wire.status import NodeState, NodeStatus


def test_the_exit_watcher_calls_back_when_a_child_exits() -> None:
    exited = threading.Event()
    watcher = ExitWatcher(exited.set)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watcher.watch(proc.pid)
        assert not exited.wait(0.3)
        proc.kill()
        assert exited.wait(10.0)
    finally:
        proc.kill()
        proc.wait()
        watcher.close()


def test_the_reporter_pushes_the_newest_status_on_a_nudge(inbox: Inbox) -> None:
    book = ReportBook()
    book.reset("node-0", "node-0")
    url = inbox.register("job", "tok", lambda s: book.answered(s, push=True))
    seq = iter(range(1, 1000))
    reporter = Reporter(lambda: h.status("node-0", seq=next(seq)), "tok")
    try:
        reporter.nudge()  # no target yet: nothing is sent
        time.sleep(0.2)
        assert book.reports()["node-0"].status is None
        reporter.target(url)
        reporter.nudge()
        wait_for(lambda: book.reports()["node-0"].status is not None, timeout=30)
    finally:
        reporter.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    proc = spawn_agent(tmp_path, extra_args=["--incarnation", "node-0.7"])
    yield proc
    proc.close()


def test_a_dead_worker_is_pushed_before_the_controller_asks(
    agent: AgentProcess, inbox: Inbox
) -> None:
    pushed: list[NodeStatus] = []
    url = inbox.register("job", agent.token, lambda s: pushed.append(s) or Taken.TAKEN)
    request = AttemptRequest(assignment=make_assignment(actions="*=sleep"), report_url=url)
    agent.client.start(request)
    for rank in (0, 1):
        wait_for_text(LogLayout(agent.log_dir).stdout(0, rank), "sleeping")
    running = agent.wait_state("running")
    assert running.incarnation == "node-0.7"
    assert pushed == []  # what the controller caused (a start) is not news
    victim = running.workers[1].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    # No poll from here on: the agent tells the inbox by itself.
    wait_for(lambda: any(s.state is NodeState.FAULTED for s in pushed), timeout=30)
    faulted = next(s for s in pushed if s.state is NodeState.FAULTED)
    assert faulted.reason == "rank 1 exited with signal SIGKILL"
    assert [w.state.value for w in faulted.workers] == ["running", "failed"]


def test_a_new_attempt_never_reports_the_previous_attempts_log_findings(tmp_path: Path) -> None:
    from trainguard.agent.board import NodeBoard
    from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor

    board = NodeBoard("node-0")
    monitor = NodeLogMonitor([LogRuleSpec("oops", ".*oops.*", fault_on_match=True)])
    monitor.on_line(0, "stdout", "oops", 1.0)
    with board.lock:
        board.attach(monitor, tmp_path, None)  # type: ignore[arg-type]
        board.set(NodeState.FAULTED, attempt=0)
    assert board.snapshot(None).monitor.detections
    with board.lock:
        board.set(NodeState.STOPPED)
        assert board.admit_start(make_assignment(attempt=1), shutting_down=False)
    status = board.snapshot(None)
    # Until the supervisor attaches attempt 1's monitor, attempt 1 shows nothing.
    assert status.attempt == 1 and status.monitor.detections == ()
    assert status.monitor.rules == {} and status.monitor.progress is None
