"""The messages between a job's hosts: joining the controller, and its host daemons.

A job on several hosts runs the same ``trainguard run ... --rdzv-endpoint HOST:PORT`` on
each. The host that owns ``HOST`` runs the controller (and node 0); every other host runs
a host daemon that joins it::

    host daemon -> controller   POST /join            JoinRequest  -> JoinReply (or 409)
    host daemon -> controller   GET  /hosts/<id>      -> HostLease   (every keepalive)
    controller  -> host daemon  POST /launch          LaunchRequest -> LaunchReply
    controller  -> host daemon  POST /shutdown        ShutdownRequest -> 202
    controller  -> host daemon  POST /partition       PartitionRequest -> 202 (rehearsal)

Every request carries the job's bearer token; the controller's server is the one agents
push their statuses to (:mod:`trainguard.platform.inbox`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainguard.wire.base import Wire
from trainguard.wire.requests import Count, Name, Seconds

__all__ = [
    "MAX_PARTITION_SECONDS",
    "HostLease",
    "JoinReply",
    "JoinRequest",
    "LaunchReply",
    "LaunchRequest",
    "PartitionRequest",
    "ShutdownRequest",
]


MAX_LEASE_EVENTS = 200  # event lines one lease carries at most (older ones are dropped)


class JoinRequest(Wire):
    """A host asks to take part in the job."""

    hostname: Name
    addr: Name  # its address toward the controller (agents bind it)
    ifname: str | None = None  # the interface of that address
    node_rank: Count | None = None  # --node-rank, when the user gave one
    host_id: Name  # unique per host daemon process: the same process joining twice
    daemon_url: Name  # where its host daemon serves /launch and /shutdown
    spec: dict[str, Any]  # the job it was started with (secrets redacted): must be the same


class JoinReply(Wire):
    """Where the host stands: a node of the job, or a spare that waits."""

    job_id: Name
    role: Literal["node", "spare"]
    node_id: Name
    lease_seconds: Seconds  # renew at least this often (GET /hosts/<host_id>)
    partition_timeout: Seconds  # stop the workers after this long without the controller
    durable_url: str  # where every host's agents write the durable tier (the same place)


class HostLease(Wire):
    """The controller's answer to a keepalive: the job's phase, the host's standing."""

    phase: str
    standing: Literal["member", "lost"]  # lost: declared lost, its work fenced off
    restarts: int = Field(default=0, ge=0)  # the job's, as the controller counts them
    finished: bool = False
    exit_code: int | None = None
    reason: str | None = None
    # The job's event lines since this host's last lease (faults, fencing, restarts,
    # scaling): every host shows the job, not only the controller's.
    events: list[str] = Field(default_factory=list, max_length=MAX_LEASE_EVENTS)


class LaunchRequest(Wire):
    """Start a node agent for ``node_id`` on this host (replacing one it runs)."""

    node_id: Name
    incarnation: Name
    peers: tuple[Count, Count, Name, Count] | None = None  # rank, world, addr, port


class LaunchReply(Wire):
    pid: int = Field(ge=1)
    port: int = Field(ge=1, le=65535)


class ShutdownRequest(Wire):
    node_id: Name


MAX_PARTITION_SECONDS = 3600.0


class PartitionRequest(Wire):
    """``--inject partition``: take this host's interface down for ``seconds`` (required,
    at most an hour: a rehearsal never leaves a host off the network for good)."""

    seconds: float = Field(gt=0, le=MAX_PARTITION_SECONDS, allow_inf_nan=False)
