"""A joined host frees the memory tiers of the nodes it ran, and only those."""

from __future__ import annotations

from pathlib import Path

from trainguard.hosts.run import free_memory_tiers


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
