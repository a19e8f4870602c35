"""Taking a job over from a controller that died (``trainguard resume``).

A new controller begins from what its predecessor recorded (the store's attempts, the
restarts decided, the fault timeline) and from what the agents say now, as a
:class:`Takeover` value its :meth:`~trainguard.control.controller.JobController.take_over`
applies:

- :func:`adopt` — every node's agent still runs the newest attempt: the new controller
  takes that attempt over as running (its rendezvous and rank assignment are the
  recorded ones; ranks are assigned deterministically), with no restart and no step lost;
- :func:`restart` — the agents are gone: a new attempt starts on fresh agents, numbered
  after the recorded ones, and the workers resume from the newest checkpoint in any
  tier (the job keeps its id, so its durable prefix is found). It does not count
  against the restart budget: the job's own code did not fail.

Pure, like the rest of the package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.control.actions import AttemptPhase, JobPhase
from trainguard.control.assignment import StoreEndpoint, assign_attempt
from trainguard.control.attempt import Attempt, new_watch
from trainguard.control.config import ControlConfig
from trainguard.control.decision import NextAttempt
from trainguard.control.events import EventKind, Fault, FaultType, Note
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.timeline import FaultRecord

__all__ = ["Recorded", "RecordedAttempt", "RecordedElastic", "Takeover", "adopt", "restart"]


@dataclass(frozen=True)
class RecordedAttempt:
    number: int
    phase: str
    started_at: float
    ended_at: float | None = None
    reason: str | None = None
    endpoint: StoreEndpoint | None = None


@dataclass(frozen=True)
class RecordedElastic:
    """What an elastic job's sizing watch remembers (control/elastic.py)."""

    failures: int = 0
    last_scaling: float | None = None
    target: int | None = None


@dataclass(frozen=True)
class Recorded:
    """What the dead controller left behind."""

    started_at: float
    attempts: tuple[RecordedAttempt, ...]
    restarts: tuple[RestartRecord, ...] = ()
    faults: tuple[Mapping[str, Any], ...] = ()  # FaultRecord.to_json() each
    # Elastic jobs: the nodes of the newest attempt (node-rank order; empty: the spec's),
    # the ids left to grow onto, and the sizing watch's memory.
    nodes: tuple[str, ...] = ()
    growth: tuple[str, ...] | None = None
    elastic: RecordedElastic | None = None

    @property
    def newest(self) -> RecordedAttempt | None:
        return self.attempts[-1] if self.attempts else None


@dataclass(frozen=True)
class Takeover:
    """How a new controller begins a job its predecessor ran (applied by
    :meth:`JobController.take_over <trainguard.control.controller.JobController.take_over>`):
    the job as recorded, then the adopted attempt running (the last of ``attempts``) or,
    ``next``, a new one."""

    started_at: float
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    growth: tuple[str, ...]
    elastic: RecordedElastic | None
    history: tuple[RestartRecord, ...]
    faults: tuple[FaultRecord, ...]
    attempts: tuple[Attempt, ...]
    phase: JobPhase
    event: Note
    next: NextAttempt | None = None


def adopt(config: ControlConfig, now: float, recorded: Recorded, nodes: Sequence[str]) -> Takeover:
    """Take the newest recorded attempt over as running on ``nodes`` (in node-rank order)."""
    newest = recorded.newest
    if newest is None or newest.endpoint is None:
        raise ValueError("no recorded attempt with a rendezvous to adopt")
    ended = _ended(config, now, recorded, nodes, upto=newest.number)
    number, endpoint = newest.number, newest.endpoint
    watch, running = new_watch(config, number, now), AttemptPhase.RUNNING
    # Its faults' recovery was recorded before (or never will be).
    attempt = Attempt(number, newest.started_at, tuple(nodes), watch, phase=running, recovered=True)
    attempt.endpoint = endpoint
    attempt.assignments = assign_attempt(config, attempt.nodes, number, endpoint)
    message = (
        f"controller resumed: re-attached to the {len(nodes)} node agents of attempt "
        f"{attempt.number}, which kept training"
    )
    data = {"mode": "reattach", "nodes": list(nodes)}
    event = Note(EventKind.RESUMED, message, attempt.number, data=data)
    return _takeover(config, recorded, nodes, (*ended, attempt), JobPhase.RUNNING, event)


def restart(config: ControlConfig, now: float, recorded: Recorded, why: str) -> Takeover:
    """Start a new attempt on fresh agents (the old ones are gone: ``why``)."""
    newest = recorded.newest
    nodes = recorded.nodes or config.node_ids  # an elastic job restarts at the size it had
    ended = _ended(config, now, recorded, nodes, upto=newest.number + 1 if newest else 0)
    message = f"controller resumed: {why}; restarting from the newest checkpoint"
    event = Note(EventKind.RESUMED, message, data={"mode": "restart", "why": why})
    plan = NextAttempt(RestartScope.JOB, tuple(nodes))
    return _takeover(config, recorded, nodes, ended, JobPhase.PENDING, event, plan)


def _takeover(
    config: ControlConfig,
    recorded: Recorded,
    nodes: Sequence[str],
    attempts: tuple[Attempt, ...],
    phase: JobPhase,
    event: Note,
    plan: NextAttempt | None = None,
) -> Takeover:
    """The pool, the restarts and faults as recorded."""
    growth = config.elastic_node_ids if recorded.growth is None else recorded.growth
    return Takeover(
        started_at=recorded.started_at,
        nodes=tuple(nodes),
        spares=tuple(s for s in config.spare_node_ids if s not in nodes),
        growth=tuple(n for n in growth if n not in nodes),
        elastic=recorded.elastic,
        history=recorded.restarts,
        faults=tuple(_fault_record(f) for f in recorded.faults),
        attempts=attempts,
        phase=phase,
        event=event,
        next=plan,
    )


def _ended(
    config: ControlConfig, now: float, recorded: Recorded, nodes: Sequence[str], upto: int
) -> tuple[Attempt, ...]:
    """The recorded attempts before ``upto``, as they ended."""
    attempts = []
    for r in recorded.attempts:
        if r.number >= upto:
            break
        ended = Attempt(r.number, r.started_at, tuple(nodes), new_watch(config, r.number, now))
        ended.endpoint, ended.reason = r.endpoint, r.reason
        ended.ended_at = r.ended_at if r.ended_at is not None else now
        ended.phase = _ended_phase(r.phase)
        if ended.phase.value != r.phase:
            ended.reason = "its controller died"
        ended.recovered = True
        attempts.append(ended)
    return tuple(attempts)


def _ended_phase(phase: str) -> AttemptPhase:
    """An attempt that was not over when its controller died ended with it: Failed."""
    value = AttemptPhase(phase) if phase in AttemptPhase.__members__.values() else None
    if value in (AttemptPhase.SUCCEEDED, AttemptPhase.FAILED, AttemptPhase.STOPPED):
        return value
    return AttemptPhase.FAILED


def _fault_record(data: Mapping[str, Any]) -> FaultRecord:
    fault = Fault(
        type=FaultType(data["type"]),
        time=float(data["time"]),
        attempt=int(data["attempt"]),
        node=data.get("node"),
        rank=data.get("rank"),
        step=data.get("step"),
        message=str(data.get("message", "")),
        evidence=dict(data.get("evidence") or {}),
    )
    return FaultRecord(
        fault,
        float(data["detected_at"]),
        data.get("fault_step"),
        data.get("scope"),
        data.get("recovered_at"),
        data.get("resumed_step"),
    )
