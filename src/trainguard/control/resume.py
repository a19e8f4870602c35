"""Taking a job over from a controller that died (``trainguard resume``).

A controller is rebuilt from what its predecessor recorded (the store's attempts, the
restarts decided, the fault timeline) and from what the agents say now:

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

from trainguard.control.actions import Action, AttemptPhase
from trainguard.control.assignment import StoreEndpoint, assign_attempt
from trainguard.control.attempt import Attempt
from trainguard.control.controller import JobController, JobPhase
from trainguard.control.decision import NextAttempt
from trainguard.control.events import EventKind, Fault, FaultType
from trainguard.control.persist import CheckpointPlanner
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.timeline import FaultRecord

__all__ = ["Recorded", "RecordedAttempt", "RecordedElastic", "adopt", "restart"]


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


def adopt(c: JobController, now: float, recorded: Recorded, nodes: Sequence[str]) -> None:
    """Take the newest recorded attempt over as running on ``nodes`` (in node-rank order)."""
    newest = recorded.newest
    if newest is None or newest.endpoint is None:
        raise ValueError("no recorded attempt with a rendezvous to adopt")
    _restore(c, now, recorded, nodes, upto=newest.number)
    attempt = Attempt(newest.number, newest.started_at, tuple(nodes), c._watch(newest.number, now))
    attempt.phase = AttemptPhase.RUNNING
    attempt.endpoint = newest.endpoint
    attempt.assignments = assign_attempt(c.config, attempt.nodes, attempt.number, newest.endpoint)
    attempt.recovered = True  # its faults' recovery was recorded before (or never will be)
    c.attempts.append(attempt)
    c.phase = JobPhase.RUNNING
    c._event(
        now,
        EventKind.RESUMED,
        f"controller resumed: re-attached to the {len(nodes)} node agents of attempt "
        f"{attempt.number}, which kept training",
        attempt=attempt.number,
        data={"mode": "reattach", "nodes": list(nodes)},
    )


def restart(c: JobController, now: float, recorded: Recorded, why: str) -> list[Action]:
    """Start a new attempt on fresh agents (the old ones are gone: ``why``)."""
    newest = recorded.newest
    nodes = recorded.nodes or c.nodes  # an elastic job restarts at the size it had
    _restore(c, now, recorded, nodes, upto=newest.number + 1 if newest else 0)
    c._event(
        now,
        EventKind.RESUMED,
        f"controller resumed: {why}; restarting from the newest checkpoint",
        data={"mode": "restart", "why": why},
    )
    return c._new_attempt(now, NextAttempt(RestartScope.JOB, c.nodes), {})


def _restore(
    c: JobController, now: float, recorded: Recorded, nodes: Sequence[str], upto: int
) -> None:
    """The recorded attempts before ``upto`` (as they ended), restarts and faults."""
    if c.phase is not JobPhase.PENDING:
        raise RuntimeError(f"job already started (phase {c.phase})")
    c.started_at = recorded.started_at
    c.nodes = tuple(nodes)
    world = len(c.nodes) * c.config.nproc_per_node  # an elastic job's, not the spec's
    c.checkpoints = CheckpointPlanner(c.config.durable, world, now)
    c.spares = tuple(s for s in c.config.spare_node_ids if s not in c.nodes)
    if recorded.growth is not None:
        c.growth = tuple(n for n in recorded.growth if n not in c.nodes)
    if c.elastic is not None and recorded.elastic is not None:
        c.elastic.failures = recorded.elastic.failures
        c.elastic.last_scaling = recorded.elastic.last_scaling
        c.elastic.target = recorded.elastic.target
    c.history = list(recorded.restarts)
    c.record.timeline.records = [_fault_record(f) for f in recorded.faults]
    for r in recorded.attempts:
        if r.number >= upto:
            break
        ended = Attempt(r.number, r.started_at, tuple(nodes), c._watch(r.number, now))
        ended.endpoint, ended.reason = r.endpoint, r.reason
        ended.ended_at = r.ended_at if r.ended_at is not None else now
        ended.phase = _ended_phase(r.phase)
        if ended.phase.value != r.phase:
            ended.reason = "its controller died"
        ended.recovered = True
        c.attempts.append(ended)


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
