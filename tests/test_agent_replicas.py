"""Peer replicas of the memory tier: pushed to the next node, pulled back by a replacement."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from agent_harness import AgentProcess, make_assignment, spawn_agent, start
from conftest import SCRIPTS, wait_for
from trainguard.agent.replicas import ReplicaStore, replica_peers
from trainguard.checkpoint.memory import MemoryTier

WRITER = (
    "import torch; from trainguard.checkpoint import Checkpointer;"
    "c = Checkpointer(); c.save(7, {'w': torch.arange(300_000.0)}); c.wait(); c.close()"
)


def agent_for(
    tmp_path: Path, node_id: str, worker: str = WRITER, argv: list[str] | None = None
) -> AgentProcess:
    memory = tmp_path / "shm" / node_id / "memory"
    memory.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"replicas": 1})
    return spawn_agent(
        tmp_path / node_id,
        argv or [sys.executable, "-c", worker],
        node_id=node_id,
        extra_args=[
            "--env",
            f"TRAINGUARD_CHECKPOINT_MEMORY_DIR={memory}",
            "--env",
            f"TRAINGUARD_CHECKPOINT_CONFIG={config}",
        ],
    )


def replicate(tmp_path: Path) -> tuple[AgentProcess, AgentProcess, Path, Path]:
    """node-0 saves a checkpoint; wait until node-1 holds its replica."""
    a, b = agent_for(tmp_path, "node-0"), agent_for(tmp_path, "node-1")
    urls = {"node-0": a.url, "node-1": b.url}
    for rank, agent in enumerate((a, b)):
        assignment = make_assignment(agent.node_id, nproc_per_node=1, nnodes=2, node_rank=rank)
        other = "node-1" if rank == 0 else "node-0"  # the ring of two: each other's replica
        assignment = assignment.model_copy(update={"replica_peers": (other,)})
        agent.client.start(start(assignment, {other: urls[other]}))
    memory = tmp_path / "shm" / "node-0" / "memory"
    replica = tmp_path / "shm" / "node-1" / "replicas" / "node-0"

    def replicated() -> bool:
        metas = sorted(p.name for p in memory.glob("rank-0-*.meta"))
        return bool(metas) and all(
            (replica / m).exists() and (replica / m).read_bytes() == (memory / m).read_bytes()
            for m in metas
        )

    wait_for(replicated, timeout=30.0)
    return a, b, memory, replica


def restart_node_0(tmp_path: Path, b: AgentProcess, memory: Path) -> None:
    """node-0 is lost with its RAM; a fresh agent for it pulls its memory tier back."""
    shutil.rmtree(memory)
    memory.mkdir()
    a2 = agent_for(tmp_path, "node-0", worker="pass")
    try:
        assignment = make_assignment("node-0", attempt=1, nproc_per_node=1, nnodes=2)
        assignment = assignment.model_copy(update={"replica_peers": ("node-1",)})
        a2.client.start(start(assignment, {"node-1": b.url}))
        a2.wait_state("completed", attempt=1)
    finally:
        a2.close()


def test_memory_tier_is_replicated_and_restored_after_node_loss(tmp_path: Path) -> None:
    a, b, memory, replica = replicate(tmp_path)
    try:
        a.close()
        saved = {p.name: p.read_bytes() for p in replica.iterdir()}
        restart_node_0(tmp_path, b, memory)
        assert {p.name: p.read_bytes() for p in memory.iterdir()} == saved
        tier = MemoryTier(str(memory), rank=0, world_size=2, job_id="job-test", keep=2)
        assert sorted(tier.shards()) == [7]
    finally:
        a.close()
        b.close()


def test_a_spare_in_a_lost_nodes_place_restores_that_nodes_memory_tier(tmp_path: Path) -> None:
    # node-0 is lost with its RAM; spare node-2 takes its place (node rank 0, its ranks),
    # and its assignment names node-0 as the node whose replica holds them.
    a, b, memory, replica = replicate(tmp_path)
    try:
        a.close()
        shutil.rmtree(memory)
        saved = {p.name: p.read_bytes() for p in replica.iterdir()}
        spare = agent_for(tmp_path, "node-2", worker="pass")
        try:
            assignment = make_assignment("node-2", attempt=1, nproc_per_node=1, nnodes=2)
            update = {"replica_peers": ("node-1",), "replica_source": "node-0"}
            spare.client.start(start(assignment.model_copy(update=update), {"node-1": b.url}))
            spare.wait_state("completed", attempt=1)
        finally:
            spare.close()
        restored = tmp_path / "shm" / "node-2" / "memory"
        assert {p.name: p.read_bytes() for p in restored.iterdir()} == saved
        tier = MemoryTier(str(restored), rank=0, world_size=2, job_id="job-test", keep=2)
        assert sorted(tier.shards()) == [7]
    finally:
        a.close()
        b.close()


def test_a_torn_replica_is_dropped_not_restored(tmp_path: Path) -> None:
    a, b, memory, replica = replicate(tmp_path)
    try:
        a.close()
        for data in replica.glob("*.data"):
            raw = bytearray(data.read_bytes())
            raw[100] ^= 0xFF
            data.write_bytes(bytes(raw))
        restart_node_0(tmp_path, b, memory)
        assert list(memory.glob("*.meta")) == []
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


def test_a_push_takes_the_newest_step_every_rank_has() -> None:
    from trainguard.agent.replicas import Shard, newest_whole_step

    def shard(rank: int, step: int) -> Shard:
        return Shard(f"r{rank}-{step}.meta", f"r{rank}-{step}.data", (step, 1), rank, step)

    shards = [shard(0, 10), shard(0, 20), shard(0, 30), shard(1, 10), shard(1, 20)]
    assert newest_whole_step(shards) == [shard(0, 20), shard(1, 20)]
    assert newest_whole_step([shard(0, 30), shard(1, 20)]) == []  # nothing whole yet
    assert newest_whole_step([]) == []


DCP_WORKER = [sys.executable, str(SCRIPTS / "dcp_replica.py")]


@pytest.mark.e2e
def test_a_lost_node_restores_its_dcp_step_from_its_peer(tmp_path: Path) -> None:
    """A DCP step of a DTensor, one rank per node; node-1 is lost with its memory tier.
    Its replacement pulls its rank file back from node-0's replica, and reads the
    coordinator's metadata from rank 0 (no durable tier: nothing else has them)."""

    def attempt(agent: AgentProcess, node_rank: int, number: int, mode: str) -> None:
        assignment = make_assignment(
            agent.node_id, attempt=number, nproc_per_node=1, nnodes=2, node_rank=node_rank
        )
        other = "node-1" if node_rank == 0 else "node-0"
        env = {"DCP_MODE": mode, "DCP_STORE": str(tmp_path / f"store-{number}")}
        update = {"replica_peers": (other,), "extra_env": env}
        agent.client.start(start(assignment.model_copy(update=update), {other: urls[other]}))

    a = agent_for(tmp_path, "node-0", argv=DCP_WORKER)
    b = agent_for(tmp_path, "node-1", argv=DCP_WORKER)
    urls = {"node-0": a.url, "node-1": b.url}
    try:
        for rank, agent in enumerate((a, b)):
            attempt(agent, rank, 0, "save")
        for agent in (a, b):
            agent.wait_state("completed", attempt=0)
        lost = tmp_path / "shm" / "node-1" / "memory"
        step = lost / "dcp" / "step-4"
        assert sorted(p.name for p in step.iterdir()) == ["rank-1.data", "rank-1.json"]
        held = tmp_path / "shm" / "node-0" / "replicas" / "node-1" / "dcp" / "step-4"
        wait_for(lambda: (held / "rank-1.json").exists(), timeout=30.0)
        b.close()
        shutil.rmtree(lost)
        lost.mkdir()
        b = agent_for(tmp_path, "node-1", argv=DCP_WORKER)
        urls["node-1"] = b.url
        attempt(b, 1, 1, "load")
        attempt(a, 0, 1, "load")
        for agent in (a, b):
            agent.wait_state("completed", attempt=1)
        out = {r: json.loads((tmp_path / "out" / f"rank-{r}.json").read_text()) for r in (0, 1)}
        assert out[0] == {"equal": True, "sources": {"metadata": "memory", "rank-0": "memory"}}
        assert out[1] == {"equal": True, "sources": {"metadata": "peer", "rank-1": "memory"}}
    finally:
        a.close()
        b.close()
