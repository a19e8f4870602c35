"""Peer replicas of the memory tier: pushed to the next node, pulled back by a replacement."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from agent_harness import AgentProcess, make_assignment, spawn_agent
from trainguard.agent.replicas import ReplicaStore, replica_peers

WRITER = (
    "import os, pathlib; d = pathlib.Path(os.environ['TRAINGUARD_CHECKPOINT_MEMORY_DIR']);"
    "(d / f\"rank-{os.environ['RANK']}.bin\").write_bytes(os.urandom(3_000_000))"
)


def agent_for(tmp_path: Path, node_id: str, worker: str = WRITER) -> AgentProcess:
    memory = tmp_path / "shm" / node_id / "memory"
    memory.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"replicas": 1})
    return spawn_agent(
        tmp_path / node_id,
        [sys.executable, "-c", worker],
        node_id=node_id,
        extra_args=[
            "--env",
            f"TRAINGUARD_CHECKPOINT_MEMORY_DIR={memory}",
            "--env",
            f"TRAINGUARD_CHECKPOINT_CONFIG={config}",
        ],
    )


def wait_until(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("not reached in time")


def test_memory_tier_is_replicated_and_restored_after_node_loss(tmp_path: Path) -> None:
    a, b = agent_for(tmp_path, "node-0"), agent_for(tmp_path, "node-1")
    try:
        peers = {"node-0": a.url, "node-1": b.url}
        for rank, agent in enumerate((a, b)):
            assignment = make_assignment(agent.node_id, nproc_per_node=1, nnodes=2, node_rank=rank)
            agent.client.start(replace(assignment, peers=peers))
        original = tmp_path / "shm" / "node-0" / "memory" / "rank-0.bin"
        replica = tmp_path / "shm" / "node-1" / "replicas" / "node-0" / "rank-0.bin"
        wait_until(lambda: replica.exists() and replica.read_bytes() == original.read_bytes())
        # node-0 is lost with its RAM; a fresh agent for it pulls its memory tier back.
        a.close()
        (tmp_path / "shm" / "node-0" / "memory" / "rank-0.bin").unlink()
        a2 = agent_for(tmp_path, "node-0", worker="pass")
        try:
            assignment = make_assignment("node-0", attempt=1, nproc_per_node=1, nnodes=2)
            a2.client.start(replace(assignment, peers={"node-0": a2.url, "node-1": b.url}))
            a2.wait_state("completed", attempt=1)
            assert original.read_bytes() == replica.read_bytes()
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def test_replica_requests_need_the_token_and_plain_paths(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    agent = agent_for(tmp_path, "node-0", worker="pass")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{agent.url}/replica/node-1", timeout=10)
        assert err.value.code == 401
        request = urllib.request.Request(
            f"{agent.url}/replica/node-1/..%2Fescape", data=b"x", method="PUT"
        )
        request.add_header("Authorization", f"Bearer {agent.token}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 400
    finally:
        agent.close()


def test_replica_peers_follow_the_ring() -> None:
    peers = {"a": "A", "b": "B", "c": "C"}
    assert replica_peers("a", peers, 1) == ["B"]
    assert replica_peers("c", peers, 1) == ["A"]
    assert replica_peers("b", peers, 5) == ["C", "A"]
    assert replica_peers("a", peers, 0) == []


def test_store_refuses_escaping_paths(tmp_path: Path) -> None:
    import io

    store = ReplicaStore(tmp_path)
    with pytest.raises(ValueError):
        store.receive("node-0", "../x", io.BytesIO(b"x"), 1)
    with pytest.raises(ValueError):
        store.receive("..", "x", io.BytesIO(b"x"), 1)
