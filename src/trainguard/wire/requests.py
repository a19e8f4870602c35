"""What the controller asks of a node agent, and the assignment at the heart of it.

    POST /start     AttemptRequest   start the assignment's workers        -> 202, 409 busy
    POST /rejoin    AttemptRequest   an in-process restart into its attempt -> 202, 409
    POST /replace   ReplaceRequest   give these ranks new processes, same attempt -> 202
    POST /stop      StopRequest      stop an attempt's workers              -> 202
    POST /persist   PersistRequest   persist a memory-tier step             -> 202, 409
    POST /shutdown  (no body)        kill the workers and exit              -> 202
    POST /assign    AssignRequest    a standby agent takes its incarnation  -> 202, 409
    GET  /status                     NodeStatus                             -> 200

An agent pushes its :class:`~trainguard.wire.status.NodeStatus` to the ``report_url`` of
its latest attempt request the moment something happens (a worker exits, the state
changes), before it cleans anything up; the controller also polls ``/status``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from trainguard.wire.base import Wire
from trainguard.wire.logs import LogLimits

__all__ = [
    "Accepted",
    "AssignRequest",
    "AttemptRequest",
    "MonitorConfig",
    "NodeAssignment",
    "PersistRequest",
    "ReplaceRequest",
    "StopRequest",
]

# Bounds of every number and name a request brings (the body itself is at most 1 MiB,
# ``trainguard.agent.api.MAX_JSON_BYTES``): far above what a spec allows, low enough that
# no timer overflows and no number is too long to print.
MAX_COUNT = 2**31 - 1
"""Attempts, nodes, ranks, restarts, ids."""
MAX_STEP = 2**63 - 1
MAX_SECONDS = 366 * 86_400.0
MAX_NAME = 1024

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]

DEFAULT_STOP_TIMEOUT = 10.0  # s of SIGTERM grace when a stop names none


class MonitorConfig(Wire):
    """What the agent matches in every rank's output: HyperPod log rules (camelCase, as in
    the spec) and the progress pattern; the agent compiles and checks them."""

    log_rules: tuple[dict[str, Any], ...] = Field(default=(), max_length=1024)
    progress_pattern: str | None = None
    # How much of each rank's output the agent keeps on disk (spec.trainguard.logs).
    logs: LogLimits = LogLimits()


class NodeAssignment(Wire):
    """Everything one node agent needs to run its workers for one attempt.

    Decided by the controller (:func:`trainguard.control.assignment.assign_ranks`).
    Node rank ``i`` hosts global ranks ``[i * nproc, (i + 1) * nproc)``.
    """

    job_id: Name
    node_id: Name
    attempt: Count
    nnodes: int = Field(ge=1, le=MAX_COUNT)
    node_rank: Count
    nproc_per_node: int = Field(ge=1, le=MAX_COUNT)
    master_addr: Name
    master_port: int = Field(ge=1, le=65535)
    # The store at master_addr:master_port is the job's store service's (every rank a
    # client, torchrun's agent-store convention), not one that rank 0 hosts.
    agent_store: bool = False
    restart_count: Count
    max_restarts: Count
    role: Name = "default"
    extra_env: dict[str, str] = Field(default_factory=dict)
    monitor: MonitorConfig = MonitorConfig()
    # The nodes this node pushes its memory-tier replicas to and restores from (the next
    # ``replicas`` nodes in node-rank order); their addresses come with the request.
    replica_peers: tuple[str, ...] = ()
    # A node that took another's place in the node order (a spare for a lost node): the
    # node that last ran its ranks, under whose id the replica peers hold their memory
    # tier. None: the node's own id.
    replica_source: Name | None = None
    # In-process restarts (workers adopt trainguard.resilient): hot spare processes on
    # this node, and how long ranks have to rejoin after a restart.
    in_process: bool = False
    hot_spares: int = Field(default=0, ge=0, le=MAX_COUNT)
    barrier_timeout: float = Field(default=60.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)

    @field_validator("node_rank")
    @classmethod
    def _within_nodes(cls, value: int, info: Any) -> int:
        nnodes = info.data.get("nnodes")
        if nnodes is not None and value >= nnodes:
            raise ValueError(f"expected 0 <= node_rank < nnodes ({nnodes})")
        return value

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
            # True: every rank joins the attempt's store that the job's store service
            # serves (trainguard.rendezvous); False: rank 0 hosts a fresh one.
            "TORCHELASTIC_USE_AGENT_STORE": str(self.agent_store),
            "TRAINGUARD_JOB_ID": self.job_id,
            "TRAINGUARD_NODE_ID": self.node_id,
            "TRAINGUARD_ATTEMPT": str(self.attempt),
            "TRAINGUARD_RDZV_NAMESPACE": self.rendezvous_namespace,
        }
        env.update(self.extra_env)
        return env


class AttemptRequest(Wire):
    """``/start`` and ``/rejoin``: the assignment, where its replica peers' agents answer,
    and where to push reports."""

    assignment: NodeAssignment
    peers: dict[str, str] = Field(default_factory=dict)
    report_url: str | None = Field(default=None, max_length=2048)


MAX_NOTICE_SECONDS = 3600.0


class StopRequest(Wire):
    """Stop ``attempt`` (None: whatever runs); another attempt is left alone.

    ``capture_stacks``: dump every worker's Python stack first (a hang).
    """

    attempt: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # graceful: SIGTERM, SIGKILL after ``timeout``; process: SIGKILL now.
    mode: Literal["graceful", "process"] = "graceful"
    timeout: Seconds = DEFAULT_STOP_TIMEOUT
    capture_stacks: bool = False
    # An elastic scaling: first ask the ranks to save and exit (trainguard.elastic), and
    # give those that read such requests this long before SIGTERM.
    notice: float = Field(default=0.0, ge=0, le=MAX_NOTICE_SECONDS, allow_inf_nan=False)


class ReplaceRequest(Wire):
    """Kill these global ranks' processes (stuck in a failed attempt) and give each a hot
    spare or a new process, in ``attempt``."""

    attempt: Count
    ranks: tuple[Count, ...] = Field(min_length=1, max_length=65_536)


class PersistRequest(Wire):
    """Persist this node's memory shards of the first step at or after ``step``;
    ``commit``: also commit it once every rank's shard is durable."""

    step: Step
    world_size: int = Field(ge=1, le=MAX_COUNT)
    commit: bool = False


class StepInjection(Wire):
    """A fault to inject into ``rank`` once its output shows step ``at_step`` (a rehearsal,
    ``trainguard run --inject``): carried out by the agent that runs the rank, at the line
    itself, not at the controller's next look."""

    id: Count
    kind: Literal["kill", "hang", "slow"]
    rank: Count
    at_step: Step


class InjectRequest(Wire):
    """The step injections this agent should hold: they replace what it held (one that
    fired never fires again)."""

    injections: tuple[StepInjection, ...] = Field(default=(), max_length=1024)


class AttachRequest(Wire):
    """A controller takes over this agent's job (``trainguard resume``): push reports to
    ``report_url`` from now on, and live while controller ``pid`` (started at ``start``
    clock ticks after boot) does."""

    report_url: str = Field(min_length=1, max_length=2048)
    pid: int = Field(ge=1, le=2**22)
    start: int | None = Field(default=None, ge=0, le=MAX_STEP)


class AssignRequest(Wire):
    """A standby agent (``--standby``: a spare host's, started when the host joined) is
    given to its node: it reports ``incarnation`` from now on and runs its on-start
    health checks, with ``peers`` (rank, world, addr, port) for the connectivity check.
    Asked by its host's daemon, never by the controller.

    ``again``: a live agent that ran the node's last attempt, now idle (its workers
    stopped), takes the node's next incarnation instead of being replaced (a job restart
    that keeps it: the platform asks, for a node the controller named in
    ``LaunchNodes.keep``). Its worker template stays warm; no on-start check runs again."""

    incarnation: Name
    peers: tuple[Count, Count, Name, Count] | None = None
    again: bool = False


class Accepted(Wire):
    """The reply to an accepted request (the work goes on in the background)."""

    accepted: bool = True
    attempt: int | None = None
    step: int | None = None
