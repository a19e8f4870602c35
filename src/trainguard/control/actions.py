"""The controller's phases, and the actions it returns for the platform to carry out.

Every action names nodes by id; :func:`trainguard.platform.drive.drive` turns each into
node lifecycle calls (launch, retire) or agent requests (start, rejoin, replace, stop,
persist) and sends them, concurrently, to every node named.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainguard.control.persist import PersistCheckpoint
from trainguard.control.policy import RestartScope
from trainguard.wire.requests import NodeAssignment

__all__ = [
    "Action",
    "AttemptPhase",
    "Finish",
    "JobPhase",
    "LaunchNodes",
    "PersistCheckpoint",
    "RejoinNodes",
    "ReplaceRanks",
    "RetireNodes",
    "StartNodes",
    "StopMode",
    "StopNodes",
]


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
    LAUNCHING = "Launching"  # its nodes' agents are coming up; no worker runs yet
    RUNNING = "Running"
    STOPPING = "Stopping"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"


@dataclass(frozen=True)
class LaunchNodes:
    """Bring up a fresh agent for each node (replacing a live one with the same id).

    ``avoid_hosts``: machines the new nodes should not land on (where the platform places
    nodes). The controller waits for every node to answer before it starts the attempt.
    ``keep``: nodes whose live agent may take the new incarnation instead (idle, healthy:
    the platform decides, and launches a fresh one otherwise), so that its worker
    template stays warm.
    """

    node_ids: tuple[str, ...]
    attempt: int
    avoid_hosts: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()


@dataclass(frozen=True)
class RetireNodes:
    """These nodes leave the job (replaced by spares): shut their agents down."""

    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class StartNodes:
    """Start ``attempt``'s workers on every node of its assignments."""

    attempt: int
    assignments: tuple[NodeAssignment, ...]
    scope: RestartScope = RestartScope.PROCESS


@dataclass(frozen=True)
class RejoinNodes:
    """An in-process restart into ``attempt``: live workers rejoin, dead ranks are replaced."""

    attempt: int
    assignments: tuple[NodeAssignment, ...]


@dataclass(frozen=True)
class ReplaceRanks:
    """Give these ranks of ``node_id`` new processes in ``attempt`` (they are stuck)."""

    attempt: int
    node_id: str
    ranks: tuple[int, ...]


class StopMode(StrEnum):
    """How an attempt's ranks are stopped."""

    PROCESS = "process"  # kill now
    GRACEFUL = "graceful"  # SIGTERM, then SIGKILL after the grace


@dataclass(frozen=True)
class StopNodes:
    attempt: int
    node_ids: tuple[str, ...]
    mode: StopMode
    timeout: float
    capture_stacks: bool = False
    notice: float = 0.0  # elastic scaling: ranks that read requests get this to save and exit


@dataclass(frozen=True)
class Finish:
    phase: JobPhase
    reason: str


Action = (
    LaunchNodes
    | RetireNodes
    | StartNodes
    | RejoinNodes
    | ReplaceRanks
    | StopNodes
    | Finish
    | PersistCheckpoint
)
