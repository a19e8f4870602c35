"""A spare host is kept warm: its daemon starts the spare node's agent as a standby when
the host joins, and the node's launch only hands it its incarnation. A launch of another
node id, or the host's fencing, stops the standby. Real agent processes (fake workers)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_harness import make_assignment, spawn_agent, start, stop
from conftest import FAKE_WORKER, pid_alive, wait_for
from trainguard.agent.client import AgentClient, AgentError
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.daemon import HostDaemon
from trainguard.platform.node import AgentLauncher
from trainguard.spec.health import HealthOptions
from trainguard.spec.plan import NodeGroupPlan
from trainguard.wire.hosts import JoinReply, LaunchRequest
from trainguard.wire.requests import AssignRequest

TOKEN = "warm-spare-token-0123456789"


@pytest.fixture
def spare(tmp_path: Path) -> Iterator[HostDaemon]:
    """A daemon that joined as the spare ``node-2`` (the join itself is not made)."""
    (tmp_path / "token").write_text(TOKEN)
    command = (sys.executable, str(FAKE_WORKER), "--out", str(tmp_path / "out"))
    groups = {
        n: NodeGroupPlan("workers", 1, 1, command, {}, str(tmp_path)) for n in ("node-1", "node-2")
    }
    launcher = AgentLauncher(tmp_path, tmp_path / "token", groups, {})
    daemon = HostDaemon(
        JobEndpoint("127.0.0.1", 1), TOKEN, LocalAddress("127.0.0.1", "lo"), {},
        lambda reply: launcher,
    )  # fmt: skip
    reply = JoinReply(
        job_id="job-abc", role="spare", node_id="node-2", lease_seconds=1.0,
        partition_timeout=10.0, durable_url=str(tmp_path / "durable"),
    )  # fmt: skip
    daemon.reply = reply
    daemon._launcher = launcher  # what run() sets on a join
    daemon._ready.set()
    try:
        yield daemon
    finally:
        daemon.agents.shutdown_all()  # every agent, by its own process (never by name)
        daemon.server.close()


def _client(port: int) -> AgentClient:
    return AgentClient(f"http://127.0.0.1:{port}", TOKEN, timeout=10.0)


def _standby(daemon: HostDaemon) -> tuple[int, int]:
    """Warm the spare as run() does on a spare's join; the standby's (pid, port)."""
    assert daemon.reply is not None
    daemon._warm_spare(daemon.reply, daemon.agents.generation)
    node = daemon.agents.nodes["node-2"]
    port = node.port()
    assert node.pid is not None and port is not None
    return node.pid, port


def test_the_spares_launch_takes_over_its_standby_agent(spare: HostDaemon) -> None:
    pid, port = _standby(spare)
    client = _client(port)
    assert client.status().incarnation == "node-2.standby"
    reply = spare._start_agent(
        LaunchRequest(node_id="node-2", incarnation="node-2.7", peers=(1, 2, "127.0.0.1", 1))
    )
    assert (reply.pid, reply.port) == (pid, port)  # the same warm agent, not a new one
    assert client.status().incarnation == "node-2.7"
    with pytest.raises(AgentError) as refused:  # given once only
        client.assign(AssignRequest(incarnation="node-2.8"))
    assert refused.value.status == 409
    client.close()


def test_a_launch_of_another_node_stops_the_standby(spare: HostDaemon) -> None:
    pid, _ = _standby(spare)
    reply = spare._start_agent(LaunchRequest(node_id="node-1", incarnation="node-1.3"))
    assert reply.pid != pid
    wait_for(lambda: not pid_alive(pid), timeout=30.0)
    assert set(spare.agents.nodes) == {"node-1"}


def test_a_fenced_spare_stops_its_standby(spare: HostDaemon) -> None:
    pid, _ = _standby(spare)
    spare.agents.shutdown_all()  # what a failed lease (or one saying "lost") does
    wait_for(lambda: not pid_alive(pid), timeout=30.0)


def test_a_standby_asked_for_before_a_fence_does_not_start_after_it(spare: HostDaemon) -> None:
    assert spare.reply is not None
    generation = spare.agents.generation
    spare.agents.shutdown_all()  # the lease failed before the standby's start came round
    spare._warm_spare(spare.reply, generation)
    assert spare.agents.nodes == {}


def test_a_standby_agent_runs_no_check_and_no_attempt_until_assigned(tmp_path: Path) -> None:
    """``--standby``: its on-start checks wait for ``POST /assign``, and ``/start`` is
    refused until then; assigned, it reports the incarnation it was given."""
    health = HealthOptions.model_validate({"onStart": ["cpu"], "continuous": []}).settings()
    agent = spawn_agent(
        tmp_path, extra_args=["--incarnation", "node-0.standby", "--standby",
                              "--health", health.to_json()],
    )  # fmt: skip
    try:
        client = agent.client
        time.sleep(1.0)  # long enough for the cpu check, had it started
        status = client.status()
        assert status.incarnation == "node-0.standby"
        assert status.health is not None and status.health.deep == "InProgress"
        with pytest.raises(AgentError) as refused:
            client.start(start(make_assignment()))
        assert refused.value.status == 409
        client.assign(AssignRequest(incarnation="node-0.3", peers=None))
        wait_for(lambda: client.status().health.deep == "Passed", timeout=60.0)  # type: ignore[union-attr]
        assert client.status().incarnation == "node-0.3"
        client.close()
    finally:
        agent.close()


def test_a_live_idle_agent_takes_the_next_incarnation_again(tmp_path: Path) -> None:
    """A job restart that keeps a node's agent (``LaunchNodes.keep``): ``POST /assign``
    with ``again`` gives a live agent the new incarnation, only while it is idle; it then
    runs the next attempt. A standby, or an agent whose workers run, refuses (409): its
    node gets a fresh agent."""
    agent = spawn_agent(tmp_path, extra_args=["--incarnation", "node-0.1"])
    try:
        client = agent.client
        client.start(start(make_assignment(actions="*=sleep")))
        agent.wait_state("running", attempt=0)
        with pytest.raises(AgentError) as refused:
            client.assign(AssignRequest(incarnation="node-0.3", again=True))
        assert refused.value.status == 409 and "not idle" in str(refused.value)
        client.stop(stop(attempt=0, mode="process"))
        agent.wait_state("stopped", attempt=0)
        client.assign(AssignRequest(incarnation="node-0.3", again=True))
        assert client.status().incarnation == "node-0.3"
        client.start(start(make_assignment(attempt=1, actions="*=sleep")))
        status = agent.wait_state("running", attempt=1)
        assert status.incarnation == "node-0.3" and len(status.workers) == 2
        client.close()
    finally:
        agent.close()
    standby = spawn_agent(tmp_path / "standby", extra_args=["--standby"])
    try:
        with pytest.raises(AgentError) as refused:
            standby.client.assign(AssignRequest(incarnation="node-0.3", again=True))
        assert refused.value.status == 409
    finally:
        standby.close()
