"""``--inject`` as a hook of the control loop: what it hands an agent goes out on its own
thread, so an agent that does not answer holds no turn of the loop up."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from trainguard.control.reports import NodeReport
from trainguard.platform.base import Observation
from trainguard.platform.book import ReportBook
from trainguard.platform.inject import Injector, parse_injection
from trainguard.platform.inject_hook import InjectionHook
from trainguard.platform.local_platform import LocalPlatform
from trainguard.platform.store import Store
from trainguard.wire.requests import InjectRequest
from trainguard.wire.status import NodeState, NodeStatus


class _SilentAgent:
    """An agent whose /inject answers only once released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.taken: list[InjectRequest] = []

    def inject(self, request: InjectRequest) -> None:
        self.release.wait(60)
        self.taken.append(request)


class _Transport:
    def __init__(self, agent: _SilentAgent) -> None:
        self.book = ReportBook()
        self.agent = agent

    def client(self, node_id: str) -> _SilentAgent:
        return self.agent


def test_an_agent_that_does_not_answer_holds_no_turn_up_and_gets_the_injections_once(
    tmp_path: Path,
) -> None:
    agent = _SilentAgent()
    platform = LocalPlatform(
        "job", Store(tmp_path / "state"), _Transport(agent), lambda *args: None,  # type: ignore[arg-type]
        memory_root=tmp_path / "memory", say=lambda line: None, pump=lambda stream: None,
        interrupted=lambda: None,
    )  # fmt: skip
    hook = InjectionHook(
        platform, Injector([parse_injection("kill:rank=1@step=5")], 2, 2, delegate_steps=True)
    )
    status = NodeStatus(
        node_id="node-0", pid=1, state=NodeState.READY, updated_at=0.0, incarnation="node-0.1"
    )
    seen = Observation({"node-0": NodeReport("node-0", status=status)})
    controller = SimpleNamespace(current=None)  # no attempt yet: only the hand-over
    try:
        hook(controller, seen)  # type: ignore[arg-type]
        hook(controller, seen)  # type: ignore[arg-type]  # a turn later: still unanswered
        assert agent.taken == []  # the turns ended while the agent was silent
        agent.release.set()
        deadline = time.monotonic() + 30
        while not agent.taken and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        hook(controller, seen)  # type: ignore[arg-type]  # handed already: not again
        time.sleep(0.2)
    finally:
        agent.release.set()
        hook.close()
    assert len(agent.taken) == 1
    assert [i.rank for i in agent.taken[0].injections] == [1]
