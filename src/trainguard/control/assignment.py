"""Central rank assignment.

The controller, not the workers, decides who is who: every node gets its group
rank, the global ranks of its workers, the world size and where the attempt's
rendezvous lives. Workers never discover each other.

Every attempt gets its own rendezvous namespace: a fresh master port (so rank 0
hosts a fresh TCPStore) and a distinct store prefix. A restarted group can
therefore never read a previous attempt's peer addresses, which is what breaks
torchrun's own ``--max-restarts`` on gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """Where an attempt's rendezvous store lives (rank 0 hosts it)."""

    addr: str
    port: int


@dataclass(frozen=True)
class NodeAssignment:
    """Everything one node agent needs to start its workers for one attempt.

    This is the body of the agent API's ``POST /start``; it round-trips through
    JSON with :meth:`to_json` / :meth:`from_json`.
    """

    job_id: str
    node_id: str
    attempt: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    role: str = "default"
    extra_env: dict[str, str] = field(default_factory=dict)
    # What the agent matches in every rank's output: log rules and the progress pattern.
    monitor: dict[str, Any] = field(default_factory=dict)
    # Agent API URL of every node of the attempt, in node-rank order (filled by the
    # platform, which knows the addresses): where memory-tier replicas go and come from.
    peers: dict[str, str] = field(default_factory=dict)
    # In-process restarts (workers adopt trainguard.resilient): hot spare processes on
    # this node, and how long ranks have to rejoin after a restart.
    in_process: bool = False
    hot_spares: int = 0
    barrier_timeout: float = 60.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def global_ranks(self) -> list[int]:
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    @property
    def rendezvous_namespace(self) -> str:
        return f"{self.job_id}/attempt-{self.attempt}"

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """The torchrun environment contract for one worker, plus trainguard's own."""
        if not 0 <= local_rank < self.nproc_per_node:
            raise ValueError(f"local_rank {local_rank} outside [0, {self.nproc_per_node})")
        rank = self.node_rank * self.nproc_per_node + local_rank
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_NAME": self.role,
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.job_id,
            # Workers host or join a fresh per-attempt store at MASTER_PORT; there is
            # no long-lived agent store to re-use.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TRAINGUARD_JOB_ID": self.job_id,
            "TRAINGUARD_NODE_ID": self.node_id,
            "TRAINGUARD_ATTEMPT": str(self.attempt),
            "TRAINGUARD_RDZV_NAMESPACE": self.rendezvous_namespace,
        }
        env.update(self.extra_env)
        return env

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeAssignment:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown assignment fields: {sorted(unknown)}")
        return cls(**data)


def assign_ranks(
    job_id: str,
    node_ids: Sequence[str],
    nproc_per_node: int,
    attempt: int,
    endpoint: Endpoint,
    restart_count: int,
    max_restarts: int,
    extra_env: dict[str, str] | None = None,
    monitor: dict[str, Any] | None = None,
) -> list[NodeAssignment]:
    """Give each node, in the order given, its group rank for ``attempt``.

    The order of ``node_ids`` is the placement decision (made by the caller);
    node rank ``i`` hosts global ranks ``[i * nproc, (i + 1) * nproc)``.
    """
    if not node_ids:
        raise ValueError("no nodes to assign")
    if len(set(node_ids)) != len(node_ids):
        raise ValueError(f"duplicate node ids: {list(node_ids)}")
    if nproc_per_node < 1:
        raise ValueError("nproc_per_node must be >= 1")
    if attempt < 0 or restart_count < 0:
        raise ValueError("attempt and restart_count must be >= 0")
    return [
        NodeAssignment(
            job_id=job_id,
            node_id=node_id,
            attempt=attempt,
            node_rank=node_rank,
            nnodes=len(node_ids),
            nproc_per_node=nproc_per_node,
            master_addr=endpoint.addr,
            master_port=endpoint.port,
            restart_count=restart_count,
            max_restarts=max_restarts,
            extra_env=dict(extra_env or {}),
            monitor=dict(monitor or {}),
        )
        for node_rank, node_id in enumerate(node_ids)
    ]
