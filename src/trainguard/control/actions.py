"""The control plane's vocabulary: job phases, the controller's configuration and its actions.

The platform builds a :class:`ControlConfig` from the job plan and carries out
the :data:`Action` values the controller returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.control.assignment import NodeAssignment
from trainguard.control.persist import DurableCadence, PersistCheckpoint
from trainguard.control.policy import PolicyConfig, RestartScope
from trainguard.monitor.rules import LogRuleSpec


class JobPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    STOPPING = "Stopping"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


class AttemptPhase(StrEnum):
    RUNNING = "Running"
    STOPPING = "Stopping"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"


@dataclass(frozen=True)
class ControlConfig:
    """What the controller needs to know about a job; built by the platform from the plan."""

    job_id: str
    node_ids: tuple[str, ...]
    nproc_per_node: int
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig.from_spec(None, 0))
    spare_node_ids: tuple[str, ...] = ()
    log_rules: tuple[LogRuleSpec, ...] = ()
    progress_pattern: str | None = None
    heartbeat_timeout: float | None = None
    stop_grace_seconds: float = 10.0
    # Extra time, beyond the grace period, that nodes get to report a stop.
    stop_slack_seconds: float = 15.0
    active_deadline_seconds: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # When to persist checkpoints to the durable tier (None: never; the agents write).
    durable: DurableCadence | None = None
    # After the last rank exits 0: how long to wait for its newest checkpoint to be durable.
    final_persist_timeout: float = 120.0
    # In-process restarts after worker crashes (the script adopts trainguard.resilient):
    # hot spare processes for the whole job, and how long ranks have to rejoin.
    in_process: bool = False
    hot_spares: int = 0
    barrier_timeout: float = 60.0

    @property
    def world_size(self) -> int:
        return len(self.node_ids) * self.nproc_per_node

    @property
    def max_restarts(self) -> int:
        return self.policy.job_max_retry_count

    def monitor_json(self) -> dict[str, Any]:
        """What each agent needs to match log lines (sent with ``/start``)."""
        return {
            "log_rules": [r.to_json() for r in self.log_rules],
            "progress_pattern": self.progress_pattern,
        }


@dataclass(frozen=True)
class StartNodes:
    attempt: int
    assignments: tuple[NodeAssignment, ...]
    # "process": same node agents; "job": the platform replaces every node agent first.
    scope: str = RestartScope.PROCESS.value


@dataclass(frozen=True)
class RejoinNodes:
    """An in-process restart into ``attempt``: live workers rejoin, dead ranks are replaced."""

    attempt: int
    assignments: tuple[NodeAssignment, ...]


@dataclass(frozen=True)
class StopNodes:
    attempt: int
    node_ids: tuple[str, ...]
    mode: str  # "process" (kill now) or "graceful" (SIGTERM, then SIGKILL)
    timeout: float
    capture_stacks: bool = False


@dataclass(frozen=True)
class Finish:
    phase: JobPhase
    reason: str


Action = StartNodes | RejoinNodes | StopNodes | Finish | PersistCheckpoint
