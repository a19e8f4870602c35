"""Central rank assignment.

The controller, not the workers, decides who is who: every node gets its group
rank, the global ranks of its workers, the world size and where the attempt's
rendezvous lives. Workers never discover each other.

Every attempt gets its own rendezvous namespace: a fresh store (the job's store
service's, :mod:`trainguard.rendezvous`, or one that rank 0 hosts on a fresh master
port) and a distinct store prefix. A restarted group can therefore never read a
previous attempt's peer addresses, which is what breaks torchrun's own
``--max-restarts`` on gloo.

An assignment names the few peers a node talks to (its memory-tier replica peers: the
next ``replicas`` nodes in node-rank order), never the whole job: starting N nodes
costs O(N), not O(N^2). A node that takes another's place in the node order (a spare
for a lost node) is also told whose replicas hold its ranks' memory tier
(:func:`replica_sources`): the replica peers of a node rank are the same nodes before
and after the swap, and they keep what they hold under the id of the node that pushed it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.control.inprocess import hot_spares_per_node
from trainguard.wire.requests import MonitorConfig, NodeAssignment

if TYPE_CHECKING:
    from trainguard.control.config import ControlConfig

__all__ = [
    "NodeAssignment",
    "StoreEndpoint",
    "assign_attempt",
    "assign_ranks",
    "replica_peers",
    "replica_sources",
]


@dataclass(frozen=True)
class StoreEndpoint:
    """Where an attempt's rendezvous store lives: served by the job's store service
    (``hosted``: every rank is a client) or by rank 0."""

    addr: str
    port: int
    hosted: bool = False


def replica_peers(node_ids: Sequence[str], index: int, replicas: int) -> tuple[str, ...]:
    """The ``replicas`` nodes after node ``index`` in ring order (never itself)."""
    ring = [*node_ids[index + 1 :], *node_ids[:index]]
    return tuple(ring[: max(0, replicas)])


def replica_sources(before: Sequence[str], after: Sequence[str]) -> dict[str, str]:
    """For each node of ``after`` (node-rank order) that did not run in ``before`` (the
    node order that last ran ranks), the node whose place it takes: the one at its node
    rank in ``before``. Its ranks are that node's, so that node's memory-tier replicas are
    its own. Empty when the sizes differ (other ranks, another world size: no shard of
    ``before`` fits)."""
    if len(before) != len(after):
        return {}
    old = set(before)
    return {new: prev for prev, new in zip(before, after, strict=True) if new not in old}


def assign_ranks(
    job_id: str,
    node_ids: Sequence[str],
    nproc_per_node: int,
    attempt: int,
    endpoint: StoreEndpoint,
    restart_count: int,
    max_restarts: int,
    extra_env: dict[str, str] | None = None,
    monitor: MonitorConfig | None = None,
    *,
    replicas: int = 0,
    sources: Mapping[str, str] | None = None,
    in_process: bool = False,
    hot_spares: int = 0,
    barrier_timeout: float = 60.0,
) -> list[NodeAssignment]:
    """Give each node, in the order given, its group rank for ``attempt``.

    The order of ``node_ids`` is the placement decision (made by the caller);
    node rank ``i`` hosts global ranks ``[i * nproc, (i + 1) * nproc)``. ``hot_spares``
    is the job's total, spread by :func:`~trainguard.control.inprocess.hot_spares_per_node`.
    ``sources``: the nodes that take another's place, and whose (see
    :func:`replica_sources`).
    """
    if not node_ids:
        raise ValueError("no nodes to assign")
    if len(set(node_ids)) != len(node_ids):
        raise ValueError(f"duplicate node ids: {list(node_ids)}")
    if nproc_per_node < 1:
        raise ValueError("nproc_per_node must be >= 1")
    if attempt < 0 or restart_count < 0:
        raise ValueError("attempt and restart_count must be >= 0")
    spares = hot_spares_per_node(hot_spares, len(node_ids))
    taken = dict(sources or {})
    return [
        NodeAssignment(
            job_id=job_id,
            node_id=node_id,
            attempt=attempt,
            nnodes=len(node_ids),
            node_rank=node_rank,
            nproc_per_node=nproc_per_node,
            master_addr=endpoint.addr,
            master_port=endpoint.port,
            agent_store=endpoint.hosted,
            restart_count=restart_count,
            max_restarts=max_restarts,
            extra_env=dict(extra_env or {}),
            monitor=monitor or MonitorConfig(),
            replica_peers=replica_peers(node_ids, node_rank, replicas),
            replica_source=taken.get(node_id),
            in_process=in_process,
            hot_spares=spares[node_rank],
            barrier_timeout=barrier_timeout,
        )
        for node_rank, node_id in enumerate(node_ids)
    ]


def assign_attempt(
    config: ControlConfig,
    node_ids: Sequence[str],
    attempt: int,
    endpoint: StoreEndpoint,
    sources: Mapping[str, str] | None = None,
) -> tuple[NodeAssignment, ...]:
    """Every node's assignment for ``attempt`` of the job ``config`` describes
    (``sources``: see :func:`assign_ranks`)."""
    return tuple(
        assign_ranks(
            config.job_id,
            node_ids,
            config.nproc_per_node,
            attempt=attempt,
            endpoint=endpoint,
            restart_count=attempt,
            max_restarts=config.max_restarts,
            extra_env=config.extra_env,
            monitor=config.monitor(),
            replicas=config.replicas,
            sources=sources,
            in_process=config.in_process,
            hot_spares=config.hot_spares,
            barrier_timeout=config.barrier_timeout,
        )
    )
