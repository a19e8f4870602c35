"""What an agent reports on ``GET /status``: the node's state and each worker's.

Shared by the agent (which builds it) and the client (which parses it), so the
wire format is defined once, here. No torch import.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)


STOP_MODES = ("graceful", "process")
"""``graceful``: SIGTERM, SIGKILL after the stop's timeout; ``process``: SIGKILL now."""
DEFAULT_STOP_TIMEOUT = 10.0  # s of SIGTERM grace when a stop names none


class AgentState(StrEnum):
    """Life cycle of one node agent.

    ``ready`` -> ``starting`` -> ``running`` -> ``completed`` | ``faulted``;
    a stop goes through ``stopping`` to ``stopped``; ``shutdown`` is final.
    """

    READY = "ready"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAULTED = "faulted"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"

    @property
    def is_active(self) -> bool:
        """Whether workers may be alive (a new attempt must not start)."""
        return self in (AgentState.STARTING, AgentState.RUNNING, AgentState.STOPPING)


class WorkerState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # exited non-zero or was killed, on its own
    STOPPED = "stopped"  # ended by the agent (a stop, or a peer's failure)


def signal_name(exitcode: int | None) -> str | None:
    """``"SIGKILL"`` for exit code -9 (torch's convention for a signalled process)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True)
class WorkerStatus:
    """One worker process. ``exitcode`` is negative when a signal ended it."""

    local_rank: int
    rank: int
    pid: int | None
    state: WorkerState
    exitcode: int | None = None
    signal: str | None = None
    error: str | None = None

    def describe_exit(self) -> str:
        """``"rank 3 exited with signal SIGKILL"`` / ``"... with exit code 3"``."""
        if self.signal is not None:
            text = f"rank {self.rank} exited with signal {self.signal}"
        else:
            text = f"rank {self.rank} exited with exit code {self.exitcode}"
        return f"{text}: {self.error}" if self.error else text

    def to_json(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "rank": self.rank,
            "pid": self.pid,
            "state": self.state.value,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "worker") -> WorkerStatus:
        obj = _expect_object(data, where)
        return cls(
            local_rank=_expect(obj, "local_rank", int, where),
            rank=_expect(obj, "rank", int, where),
            pid=_expect_optional(obj, "pid", int, where),
            state=_expect_enum(obj, "state", WorkerState, where),
            exitcode=_expect_optional(obj, "exitcode", int, where),
            signal=_expect_optional(obj, "signal", str, where),
            error=_expect_optional(obj, "error", str, where),
        )


@dataclass(frozen=True)
class AgentStatus:
    """The body of ``GET /status``."""

    node_id: str
    pid: int
    state: AgentState
    attempt: int | None
    reason: str | None
    updated_at: float
    workers: tuple[WorkerStatus, ...] = field(default_factory=tuple)
    # About ``attempt``: what the log monitor saw (``NodeLogMonitor.snapshot()``: rules,
    # progress, detections), each rank's last heartbeat, and stacks captured on a stop.
    monitor: dict[str, Any] = field(default_factory=dict)
    heartbeats: dict[str, Any] = field(default_factory=dict)
    stacks: dict[str, str] = field(default_factory=dict)
    # Events the workers reported (trainguard.monitor.worker_events), as JSON objects.
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # The node's checkpoint tiers (``DurablePersister.status()``): memory steps, durable writes.
    checkpoint: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "pid": self.pid,
            "state": self.state.value,
            "attempt": self.attempt,
            "reason": self.reason,
            "updated_at": self.updated_at,
            "workers": [w.to_json() for w in self.workers],
            "monitor": self.monitor,
            "heartbeats": self.heartbeats,
            "stacks": self.stacks,
            "events": list(self.events),
            "checkpoint": self.checkpoint,
        }

    @classmethod
    def from_json(cls, data: Any) -> AgentStatus:
        """Parse a status body; raises ``ValueError`` naming the bad field."""
        obj = _expect_object(data, "status")
        workers = obj.get("workers")
        if not isinstance(workers, list):
            raise ValueError("status.workers: expected a list")
        updated_at = obj.get("updated_at")
        if isinstance(updated_at, bool) or not isinstance(updated_at, int | float):
            raise ValueError("status.updated_at: expected a number")
        return cls(
            node_id=_expect(obj, "node_id", str, "status"),
            pid=_expect(obj, "pid", int, "status"),
            state=_expect_enum(obj, "state", AgentState, "status"),
            attempt=_expect_optional(obj, "attempt", int, "status"),
            reason=_expect_optional(obj, "reason", str, "status"),
            updated_at=float(updated_at),
            workers=tuple(
                WorkerStatus.from_json(w, f"status.workers[{i}]") for i, w in enumerate(workers)
            ),
            monitor=_optional_object(obj, "monitor"),
            heartbeats=_optional_object(obj, "heartbeats"),
            stacks=_optional_object(obj, "stacks"),
            events=tuple(e for e in obj.get("events") or [] if isinstance(e, dict)),
            checkpoint=_optional_object(obj, "checkpoint"),
        )


def _optional_object(obj: dict[str, Any], key: str) -> dict[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    return _expect_object(value, f"status.{key}")


def _expect_object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return data


def _expect(obj: dict[str, Any], key: str, kind: type[T], where: str) -> T:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    return value


def _expect_optional(obj: dict[str, Any], key: str, kind: type[T], where: str) -> T | None:
    if obj.get(key) is None:
        return None
    return _expect(obj, key, kind, where)


def _expect_enum(obj: dict[str, Any], key: str, kind: type[E], where: str) -> E:
    value = obj.get(key)
    if isinstance(value, str) and value in {m.value for m in kind}:
        return kind(value)
    allowed = ", ".join(m.value for m in kind)
    raise ValueError(f"{where}.{key}: expected one of {allowed}, got {value!r}")
