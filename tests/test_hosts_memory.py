"""A joined host frees the memory tiers of the nodes it ran, and only those: when it
leaves the job, and before a node's first agent since it joined (an earlier job's tier
by the same name is never restored from)."""

from __future__ import annotations

from pathlib import Path

from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.daemon import HostDaemon
from trainguard.hosts.run import free_memory_tiers
from trainguard.wire.hosts import JoinReply, LaunchRequest


def _tier(root: Path, node_id: str) -> None:
    (root / node_id / "memory" / "step-00000010").mkdir(parents=True)
    (root / node_id / "memory" / "step-00000010" / "rank-0.pt").write_bytes(b"x")
    (root / node_id / "replicas").mkdir()


def test_only_this_hosts_nodes_are_freed(tmp_path: Path) -> None:
    job_root = tmp_path / "job-abc"
    for node_id in ("node-0", "node-1", "node-2"):
        _tier(job_root, node_id)
    free_memory_tiers(job_root, ["node-1", "node-2"])
    assert sorted(p.name for p in job_root.iterdir()) == ["node-0"]  # another host's node


def test_the_jobs_directory_goes_with_its_last_node(tmp_path: Path) -> None:
    job_root = tmp_path / "job-abc"
    _tier(job_root, "node-1")
    free_memory_tiers(job_root, ["node-1", "node-9"])  # node-9: launched, never wrote
    assert not job_root.exists()
    free_memory_tiers(job_root, ["node-1"])  # already gone: nothing to do, no error


class _FakeNode:
    """What the daemon needs of a launched node: it serves at once, never exits."""

    console = None
    pid = 4242

    def port(self) -> int:
        return 1

    def exited(self) -> str | None:
        return None

    def shutdown(self, reason: str | None) -> None:
        pass


def test_a_node_ids_first_launch_since_the_join_is_announced_not_its_relaunches() -> None:
    first: list[tuple[str, str]] = []
    launched: list[str] = []

    def launcher(node_id: str, incarnation: str, peers: object) -> _FakeNode:
        launched.append(f"{node_id}.{incarnation}")
        return _FakeNode()

    daemon = HostDaemon(
        JobEndpoint("127.0.0.1", 1),
        "token",
        LocalAddress("127.0.0.1", "lo"),
        {},
        lambda reply: launcher,  # type: ignore[arg-type,return-value]
        first_launch=lambda reply, node_id: first.append((reply.job_id, node_id)),
    )
    try:
        reply = JoinReply(
            job_id="job-abc", role="node", node_id="node-1", lease_seconds=1.0,
            partition_timeout=10.0, durable_url="/tmp/durable",
        )  # fmt: skip
        daemon.reply = reply
        daemon._launcher = launcher  # type: ignore[assignment]  # what run() sets on a join
        daemon._ready.set()
        for node_id, incarnation in (("node-1", "1"), ("node-1", "2"), ("node-3", "1")):
            daemon._start_agent(LaunchRequest(node_id=node_id, incarnation=incarnation))
        assert launched == ["node-1.1", "node-1.2", "node-3.1"]
        assert first == [("job-abc", "node-1"), ("job-abc", "node-3")]  # not node-1.2
        assert daemon.launched == {"node-1", "node-3"}  # freed when the host leaves
    finally:
        daemon.server.close()
