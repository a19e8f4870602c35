"""What the platform tells the control plane about each node, once per poll.

The platform translates whatever it observes (an agent's ``GET /status``, a
pod's phase, a process that vanished) into these values; the controller never
sees HTTP or processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from trainguard.monitor.rules import Detection
from trainguard.monitor.worker_events import WorkerEvent


class NodeState(StrEnum):
    """The agent's state, as the agent API reports it."""

    READY = "ready"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAULTED = "faulted"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"

    @property
    def quiescent(self) -> bool:
        """No worker of this node runs (or is about to)."""
        return self in (
            NodeState.READY,
            NodeState.COMPLETED,
            NodeState.FAULTED,
            NodeState.STOPPED,
            NodeState.SHUTDOWN,
        )


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    local_rank: int
    exitcode: int | None
    signal: str | None = None
    error: str | None = None

    def describe(self) -> str:
        if self.signal:
            how = f"signal {self.signal}"
        elif self.exitcode is not None:
            how = f"exit code {self.exitcode}"
        else:
            how = "an unknown failure"
        return f"rank {self.rank} exited with {how}"


@dataclass(frozen=True)
class RankProgress:
    """Training progress of one rank in the current attempt (from logs or heartbeats)."""

    first_step: int
    first_time: float
    step: int
    time: float


@dataclass(frozen=True)
class RuleActivity:
    """What one node saw of one log rule in the current attempt."""

    last_match_at: float | None
    stopped: bool = False


@dataclass(frozen=True)
class CheckpointReport:
    """A node's checkpoint tiers: memory steps (step -> this node's ranks) and durable writes."""

    memory_steps: dict[int, frozenset[int]] = field(default_factory=dict)
    forced_steps: frozenset[int] = frozenset()  # saved with force=True: persist them
    written: tuple[int, ...] = ()
    committed: tuple[int, ...] = ()
    failed: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeReport:
    """One node as seen by the platform at one instant.

    ``reachable=False`` means the node's agent did not answer (or its process
    is gone); its other fields are then meaningless.
    """

    node_id: str
    reachable: bool
    state: NodeState = NodeState.READY
    attempt: int | None = None
    reason: str | None = None
    failures: tuple[WorkerFailure, ...] = field(default_factory=tuple)
    pids: tuple[int, ...] = field(default_factory=tuple)
    # Detection (all about ``attempt``):
    rank_pids: dict[int, int] = field(default_factory=dict)
    rules: dict[str, RuleActivity] = field(default_factory=dict)
    progress: dict[int, RankProgress] = field(default_factory=dict)
    detections: tuple[Detection, ...] = field(default_factory=tuple)
    heartbeats: dict[int, float] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    worker_events: tuple[WorkerEvent, ...] = field(default_factory=tuple)
    checkpoint: CheckpointReport = field(default_factory=CheckpointReport)
