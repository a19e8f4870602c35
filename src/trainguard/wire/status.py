"""What a node agent reports: its state, each worker's, and what it saw of them.

The body of ``GET /status`` and of the pushes an agent makes to its controller
(:mod:`trainguard.wire.requests`). The controller reads these values as they are: a
worker's exit is a :class:`WorkerStatus` from the agent to the fault it becomes.
"""

from __future__ import annotations

import signal as signals
from enum import StrEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from trainguard.wire.base import Wire
from trainguard.wire.health import HealthReport

__all__ = [
    "Beat",
    "CheckpointStatus",
    "Detection",
    "DetectionKind",
    "MemoryStep",
    "MonitorSnapshot",
    "NodeState",
    "NodeStatus",
    "Progress",
    "RuleActivity",
    "WorkerEvent",
    "WorkerState",
    "WorkerStatus",
    "signal_name",
]


class NodeState(StrEnum):
    """Life cycle of one node agent (the one state enum of the control plane).

    ``ready`` -> ``starting`` -> ``running`` -> ``completed`` | ``faulted``; a stop goes
    through ``stopping`` to ``stopped``; ``shutdown`` is final. ``faulted`` is reported the
    moment a worker fails, while its peers may still run: they stop when the controller
    says so.
    """

    READY = "ready"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAULTED = "faulted"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"


class WorkerState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # exited non-zero or was killed, on its own
    STOPPED = "stopped"  # ended by the agent (a stop, or a replacement)


def signal_name(exitcode: int | None) -> str | None:
    """``"SIGKILL"`` for exit code -9 (a signalled process, as ``subprocess`` reports it)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signals.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class WorkerStatus(Wire):
    """One worker process. ``exitcode`` is negative when a signal ended it."""

    local_rank: int = Field(ge=0)
    rank: int = Field(ge=0)
    pid: int | None = None
    state: WorkerState
    exitcode: int | None = None
    signal: str | None = None
    error: str | None = None
    traceback: str | None = None  # the failed worker's last Python traceback
    # In-process restarts (resilient workers): the newest attempt this rank joined (its
    # acknowledgement) and the newest attempt it left after a fault.
    joined: int | None = None
    left: int | None = None
    # A running worker's CPU time so far (user + system, seconds): a rank that lingers
    # after the others exited is hung only while it uses none (control/exit_hang.py).
    cpu_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def describe_exit(self) -> str:
        """``"rank 3 exited with signal SIGKILL"`` / ``"... with exit code 3: <error>"``."""
        if self.signal is not None:
            text = f"rank {self.rank} exited with signal {self.signal}"
        else:
            text = f"rank {self.rank} exited with exit code {self.exitcode}"
        return f"{text}: {self.error}" if self.error else text


class RuleActivity(Wire):
    """What one node saw of one log rule in the current attempt."""

    last_match_at: float | None = None
    matches: int = 0
    stopped: bool = False


class Progress(Wire):
    """Training progress in the current attempt, from the ranks' log lines: the first
    completed step seen (and when), and the latest (and when). A node reports its ranks'
    together: the earliest first step, the latest step."""

    first_step: int
    first_time: float
    step: int
    time: float

    def merge(self, other: Progress | None) -> Progress:
        """Both together: the earlier first step, the later latest step."""
        if other is None:
            return self
        first = min(self, other, key=lambda p: (p.first_time, p.first_step))
        latest = max(self, other, key=lambda p: (p.step, p.time))
        return Progress(
            first_step=first.first_step, first_time=first.first_time,
            step=latest.step, time=latest.time,
        )  # fmt: skip


DetectionKind = Literal["LogSlow", "LogFault", "NaNMetric"]


class Detection(Wire):
    """A fault seen in one rank's output line. The metric may be NaN (that is the point):
    on the wire a non-finite value is the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``, so the JSON stays strict."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    kind: DetectionKind
    rule: str
    rank: int
    time: float
    line: str
    value: float | None = None

    @field_validator("value", mode="before")
    @classmethod
    def _non_finite(cls, value: object) -> object:
        if isinstance(value, str) and value.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            return float(value)
        return value

    @property
    def reason(self) -> str:
        """HyperPod-style reason: ``LogSlow_<rule>``, ``LogFault_<rule>``, ``NaNMetric_<rule>``."""
        return f"{self.kind}_{self.rule}"


class MonitorSnapshot(Wire):
    """What the node's log monitor saw in the current attempt. ``rank_steps``: each rank's
    latest completed step and the unix time its line was read (the controller's
    straggler watch compares the ranks' paces; a few numbers per rank)."""

    rules: dict[str, RuleActivity] = Field(default_factory=dict)
    progress: Progress | None = None
    detections: tuple[Detection, ...] = ()
    rank_steps: dict[int, tuple[int, float]] = Field(default_factory=dict)


class Beat(Wire):
    """A rank's latest heartbeat: its step (if it gave one) and its unix time."""

    step: int | None = None
    time: float = Field(allow_inf_nan=False)


class WorkerEvent(Wire):
    """An event a worker reported for the job's timeline (a checkpoint restored, ...)."""

    rank: int
    seq: int
    time: float
    kind: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class MemoryStep(Wire):
    """One step in a node's memory tier: the local ranks holding it, and whether a worker
    saved it with ``force=True`` (persist it)."""

    ranks: tuple[int, ...] = ()
    force: bool = False


class CheckpointStatus(Wire):
    """A node's checkpoint tiers: memory steps and the durable writes of its agent."""

    memory_steps: dict[int, MemoryStep] = Field(default_factory=dict)
    persisting: int | None = None
    written: tuple[int, ...] = ()
    committed: tuple[int, ...] = ()
    failed: dict[int, str] = Field(default_factory=dict)


class InjectedFault(Wire):
    """A step injection this agent carried out: the rank's step when it hit, and the pid."""

    id: int = Field(ge=0)
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    pid: int
    time: float


class NodeStatus(Wire):
    """One node agent's report: ``GET /status``, and what it pushes to the controller.

    ``incarnation`` names the agent process (the platform gives it at launch): a report
    of a replaced agent is never taken for its successor's. ``seq`` grows with every
    change the agent makes to its state or workers.
    """

    node_id: str
    incarnation: str = ""
    pid: int
    seq: int = 0
    state: NodeState
    attempt: int | None = None
    reason: str | None = None
    updated_at: float
    workers: tuple[WorkerStatus, ...] = ()
    # About ``attempt``: the log monitor's view, each rank's last heartbeat, the stacks
    # captured on a stop, and the events the workers reported.
    monitor: MonitorSnapshot = MonitorSnapshot()
    heartbeats: dict[int, Beat] = Field(default_factory=dict)
    stacks: dict[int, str] = Field(default_factory=dict)
    events: tuple[WorkerEvent, ...] = ()
    checkpoint: CheckpointStatus = CheckpointStatus()
    injected: tuple[InjectedFault, ...] = ()  # step injections carried out (rehearsals)
    hot_spares: int = Field(default=0, ge=0)  # idle hot spare processes, ready to take a rank
    # The worker template is still importing (a start now waits for it): a node an
    # elastic scale-up brings up joins once it is warm, while the job trains on.
    warming: bool = False
    health: HealthReport = HealthReport()  # deep checks and monitors' findings (wire/health.py)

    @property
    def live_workers(self) -> int:
        return sum(1 for w in self.workers if w.state is WorkerState.RUNNING)

    @property
    def quiescent(self) -> bool:
        """No worker of this node runs, or is about to."""
        if self.state in (NodeState.STARTING, NodeState.RUNNING, NodeState.STOPPING):
            return False
        return self.live_workers == 0

    def failed_workers(self) -> tuple[WorkerStatus, ...]:
        return tuple(w for w in self.workers if w.state is WorkerState.FAILED)
