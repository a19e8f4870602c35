"""Events and faults: the values the control plane records and reasons about."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class FaultType(StrEnum):
    """What went wrong. Names follow HyperPod's agent where one exists."""

    WORKER_CRASH = "WorkerCrash"
    # A resilient worker gave up joining an in-process restart (it exited with 75).
    BARRIER_GIVEN_UP = "RestartBarrierGivenUp"
    # A rank had not joined an in-process restart when its barrier timeout passed.
    BARRIER_MISSED = "RestartBarrierMissed"
    LOG_HANG = "LogHang"
    LOG_SLOW = "LogSlow"
    LOG_FAULT = "LogFault"
    NAN_METRIC = "NaNMetric"
    HEARTBEAT_TIMEOUT = "HeartbeatTimeout"
    NODE_LOST = "NodeLost"
    NODE_STOP_TIMEOUT = "NodeStopTimeout"
    # The agent answered but refused the attempt's /start (or /rejoin, /replace).
    START_REFUSED = "StartRefused"
    REJOIN_REFUSED = "RejoinRefused"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # A rank much slower than the job's median, with stragglerAction: restart.
    STRAGGLER = "Straggler"
    # A node failed an on-start (deep) health check: it never takes ranks.
    HEALTH_CHECK_FAILED = "HealthCheckFailed"
    # A monitor found a node unhealthy (an XID, a lost GPU, a full disk, ...), or someone
    # asked for the node to be replaced.
    NODE_UNHEALTHY = "NodeUnhealthy"
    # A rank still running, idle, well after every other rank exited 0 (control/exit_hang.py).
    EXIT_HANG = "ExitHang"
    # No new step for much longer than the job's own step time (control/no_progress.py).
    NO_PROGRESS = "NoProgress"

    @property
    def is_hang(self) -> bool:
        """Faults where the workers are alive but stuck: their stacks are worth capturing."""
        return self in (
            FaultType.LOG_HANG,
            FaultType.HEARTBEAT_TIMEOUT,
            FaultType.EXIT_HANG,
            FaultType.NO_PROGRESS,
        )

    @property
    def loses_node(self) -> bool:
        """Faults after which the node is not used for the next attempt: its agent cannot
        be trusted (lost, did not stop, refused), or it made a rank straggle."""
        return self in (
            FaultType.NODE_LOST,
            FaultType.NODE_STOP_TIMEOUT,
            FaultType.START_REFUSED,
            FaultType.STRAGGLER,
            FaultType.HEALTH_CHECK_FAILED,
            FaultType.NODE_UNHEALTHY,
        )


class EventKind(StrEnum):
    """What a timeline entry records. The values are the kinds written to the store, the
    wire, metrics labels and Kubernetes Event reasons: never change one."""

    # The controller's
    JOB_STARTED = "JobStarted"
    JOB_SUCCEEDED = "JobSucceeded"
    JOB_FAILED = "JobFailed"
    JOB_STOPPED = "JobStopped"
    STOP_REQUESTED = "StopRequested"
    STOPPING_ALL = "StoppingAll"
    NODES_LAUNCHING = "NodesLaunching"
    ATTEMPT_STARTED = "AttemptStarted"
    ATTEMPT_ENDED = "AttemptEnded"
    FAULT = "Fault"
    FAULT_INJECTED = "FaultInjected"
    RESTART_SCHEDULED = "RestartScheduled"
    RECOVERED = "Recovered"
    RESUMED = "Resumed"
    SCRIPT_ERROR = "ScriptError"
    STRAGGLER = "Straggler"
    LINGERING = "Lingering"
    NODE_REPLACING = "NodeReplacing"
    NODES_REPLACED = "NodesReplaced"
    STUCK_RANKS_REPLACED = "StuckRanksReplaced"
    NODE_PREEMPTED = "NodePreempted"
    SCALING_REQUESTED = "ScalingRequested"
    SCALE_UP_PREPARING = "ScaleUpPreparing"
    ELASTIC_SCALING = "ElasticScaling"
    ELASTIC_SCALING_FAILED = "ElasticScalingFailed"
    CHECKPOINT_PERSISTING = "CheckpointPersisting"
    CHECKPOINT_NOT_DURABLE = "CheckpointNotDurable"
    CHECKPOINT_PERSIST_FAILED = "CheckpointPersistFailed"
    NODE_HEALTH = "NodeHealth"
    HEALTH_CHECK = "HealthCheck"
    HEALTH_FINDING = "HealthFinding"
    # Named by the Kubernetes status's warnings; nothing records it today.
    POD_LOST = "PodLost"
    # A worker's (monitor/worker_events.py WORKER_KINDS); the controller also records
    # CheckpointSaved and CheckpointCommitted of its own.
    CHECKPOINT_RESTORED = "CheckpointRestored"
    CHECKPOINT_SKIPPED = "CheckpointSkipped"
    CHECKPOINT_SAVED = "CheckpointSaved"
    CHECKPOINT_COMMITTED = "CheckpointCommitted"
    CHECKPOINT_MEMORY_FULL = "CheckpointMemoryFull"
    IN_PROCESS_RESTART = "InProcessRestart"
    ATTEMPT_JOINED = "AttemptJoined"
    CUDA_UNHEALTHY = "CudaUnhealthy"
    BARRIER_TIMEOUT = "BarrierTimeout"


@dataclass(frozen=True)
class Note:
    """An event to record (``attempt`` None: the current attempt's): the planners', the
    health book's and the checkpoint planner's news, recorded by the controller."""

    kind: EventKind
    message: str
    attempt: int | None = None
    node: str | None = None
    data: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Fault:
    """One observed fault: a value, not a string."""

    type: FaultType
    time: float
    attempt: int
    node: str | None = None
    rank: int | None = None
    step: int | None = None
    message: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["type"] = str(self.type)
        return data


@dataclass(frozen=True)
class Event:
    """One entry of a job's timeline."""

    time: float
    kind: str
    message: str
    attempt: int | None = None
    node: str | None = None
    rank: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
