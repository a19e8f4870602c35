"""The agent's HTTP API: authentication, validation, the status format, the client's errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from agent_harness import (
    TOKEN,
    AgentProcess,
    free_port,
    make_assignment,
    request_json,
    spawn_agent,
    start,
)
from trainguard.agent.client import AgentClient, AgentError, AgentUnreachable
from trainguard.wire.status import NodeStatus


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = spawn_agent(tmp_path_factory.mktemp("agent-api"))
    yield proc
    proc.close()


def call(
    agent: AgentProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    token: str | None = TOKEN,
) -> tuple[int, dict[str, Any]]:
    return request_json(agent.url + path, method, body, token)


def start_body(**changes: Any) -> bytes:
    assignment = make_assignment().to_json() | changes
    return json.dumps({"assignment": assignment}).encode()


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_requests_without_the_token_are_refused_and_do_nothing(
    agent: AgentProcess, token: str | None
) -> None:
    for method, path, body in [
        ("POST", "/start", start_body()),
        ("POST", "/stop", b"{}"),
        ("POST", "/shutdown", b""),
        ("GET", "/status", None),
        ("GET", "/nowhere", None),
    ]:
        code, reply = call(agent, method, path, body, token=token)
        assert code == 401, (method, path)
        assert "token" in reply["error"]
    status = agent.client.status()
    assert (status.state.value, status.attempt, status.workers) == ("ready", None, ())
    assert not (agent.log_dir / "attempt-0").exists()
    assert agent.proc.poll() is None


def test_client_with_a_wrong_token_gets_401(agent: AgentProcess) -> None:
    with pytest.raises(AgentError) as refused:
        AgentClient(agent.url, "not-the-token").status()
    assert refused.value.status == 401


def test_status_has_exactly_the_documented_fields(agent: AgentProcess) -> None:
    code, reply = call(agent, "GET", "/status")
    assert code == 200
    assert set(reply) == {
        "node_id",
        "incarnation",
        "pid",
        "seq",
        "state",
        "attempt",
        "reason",
        "updated_at",
        "workers",
        "monitor",
        "heartbeats",
        "stacks",
        "events",
        "checkpoint",
        "injected",
        "hot_spares",
        "warming",
        "health",
    }
    assert reply["node_id"] == "node-0" and reply["pid"] == agent.proc.pid
    assert reply["state"] == "ready" and reply["attempt"] is None and reply["workers"] == []
    assert isinstance(reply["updated_at"], float)
    assert NodeStatus.from_json(reply).to_json() == reply


def test_unknown_paths_and_methods(agent: AgentProcess) -> None:
    assert call(agent, "GET", "/nowhere")[0] == 404
    assert call(agent, "GET", "/start")[0] == 405
    assert call(agent, "POST", "/status", b"{}")[0] == 405


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b"{not json", "malformed JSON"),
        (b"[]", "expected a JSON object"),
        (b"", "got nothing"),
        (b'{"nothing": 1}', "assignment: missing"),
        (json.dumps({"assignment": 3}).encode(), "assignment: expected a JSON object"),
        (start_body(attempt="one"), "assignment.attempt"),
        (start_body(attempt=-1), "assignment.attempt"),
        (start_body(nproc_per_node=True), "assignment.nproc_per_node"),
        (start_body(node_rank=1, nnodes=1), "assignment.node_rank"),
        (start_body(master_port=70000), "assignment.master_port"),
        (start_body(node_id="node-7"), "assignment.node_id"),
        (start_body(extra_env={"A": 1}), "assignment.extra_env"),
        (start_body(colour="blue"), "colour"),
    ],
)
def test_bad_start_bodies_get_400_naming_the_field(
    agent: AgentProcess, body: bytes, names: str
) -> None:
    code, reply = call(agent, "POST", "/start", body)
    assert code == 400
    assert names in reply["error"]
    assert agent.client.status().state.value == "ready"


def test_missing_assignment_field_is_named(agent: AgentProcess) -> None:
    assignment = make_assignment().to_json()
    del assignment["master_addr"]
    body = json.dumps({"assignment": assignment}).encode()
    code, reply = call(agent, "POST", "/start", body)
    assert (code, reply["error"]) == (400, "assignment.master_addr: missing")


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b'{"mode": "in-process"}', "stop.mode"),
        (b'{"attempt": "0"}', "stop.attempt"),
        (b'{"timeout": -1}', "stop.timeout"),
        (b'{"force": true}', "force"),
    ],
)
def test_bad_stop_bodies_get_400(agent: AgentProcess, body: bytes, names: str) -> None:
    code, reply = call(agent, "POST", "/stop", body)
    assert code == 400
    assert names in reply["error"]


def test_client_reports_refusals_with_the_message(agent: AgentProcess) -> None:
    with pytest.raises(AgentError) as refused:
        agent.client.start(start(make_assignment(node_id="node-9")))
    assert refused.value.status == 400
    assert "assignment.node_id" in str(refused.value)
    assert not isinstance(refused.value, AgentUnreachable)


def test_client_raises_unreachable_when_nobody_listens() -> None:
    client = AgentClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout=2)
    with pytest.raises(AgentUnreachable) as unreachable:
        client.status()
    assert unreachable.value.status is None
