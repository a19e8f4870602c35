"""The job controller: a state machine over attempts, driven by node reports.

Pure logic. The platform calls :meth:`JobController.start`, then
:meth:`JobController.observe` on every poll with the time and a report per node,
and carries out the returned actions (start workers, stop workers, finish).
Nothing here sleeps, reads a clock or opens a socket, so every branch is unit
tested with plain values.

Assumptions the decisions rely on:
- a node report is only evidence about the attempt it names; reports about an
  older attempt (an agent that has not processed the latest ``/start`` yet) are
  ignored for success and fault decisions;
- any fault on any rank stops every rank of the attempt at once, so no survivor
  waits out a collective timeout;
- an attempt counts as stopped once every node is quiescent, or once the stop
  deadline passes (the nodes that did not stop are then reported lost).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from trainguard.control.assignment import Endpoint, NodeAssignment, assign_ranks
from trainguard.control.events import Event, Fault, FaultType
from trainguard.control.reports import NodeReport, NodeState


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
    max_restarts: int = 0
    stop_grace_seconds: float = 10.0
    # Extra time, beyond the grace period, that nodes get to report a stop.
    stop_slack_seconds: float = 15.0
    active_deadline_seconds: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StartNodes:
    attempt: int
    assignments: tuple[NodeAssignment, ...]


@dataclass(frozen=True)
class StopNodes:
    attempt: int
    node_ids: tuple[str, ...]
    mode: str  # "process" (kill now) or "graceful" (SIGTERM, then SIGKILL)
    timeout: float


@dataclass(frozen=True)
class Finish:
    phase: JobPhase
    reason: str


Action = StartNodes | StopNodes | Finish


@dataclass
class Attempt:
    number: int
    started_at: float
    endpoint: Endpoint
    assignments: tuple[NodeAssignment, ...]
    phase: AttemptPhase = AttemptPhase.RUNNING
    ended_at: float | None = None
    reason: str | None = None
    faults: list[Fault] = field(default_factory=list)
    stop_deadline: float | None = None


class JobController:
    """Runs one job: assigns ranks, watches reports, stops all on a fault, restarts or gives up."""

    def __init__(self, config: ControlConfig, endpoint_for: Callable[[int], Endpoint]) -> None:
        if not config.node_ids:
            raise ValueError("a job needs at least one node")
        self.config = config
        self._endpoint_for = endpoint_for
        self.phase = JobPhase.PENDING
        self.reason: str | None = None
        self.attempts: list[Attempt] = []
        self.started_at: float | None = None
        self._pending_events: list[Event] = []
        # Set when a stop was asked for from outside (delete, Ctrl-C, deadline).
        self._cancel: tuple[JobPhase, str] | None = None

    # -- queries -----------------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)

    def drain_events(self) -> list[Event]:
        """Events recorded since the last call, oldest first."""
        events, self._pending_events = self._pending_events, []
        return events

    # -- inputs ------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        if self.phase is not JobPhase.PENDING:
            raise RuntimeError(f"job already started (phase {self.phase})")
        self.started_at = now
        self._event(now, "JobStarted", f"job {self.config.job_id} started")
        return [self._start_attempt(now)]

    def cancel(self, now: float, reason: str, phase: JobPhase = JobPhase.STOPPED) -> list[Action]:
        """Stop the job from outside (user delete, Ctrl-C, deadline). Idempotent."""
        if self.phase.terminal or self._cancel is not None:
            return []
        self._cancel = (phase, reason)
        self._event(now, "StopRequested", reason)
        attempt = self.current
        if attempt is None or attempt.phase is not AttemptPhase.RUNNING:
            if attempt is None:
                return self._finish(now, phase, reason)
            return []
        self.phase = JobPhase.STOPPING
        return [self._stop(now, attempt, "graceful", reason)]

    def observe(self, now: float, reports: Mapping[str, NodeReport]) -> list[Action]:
        """Feed one poll's reports (one per node); returns what to do now."""
        attempt = self.current
        if attempt is None or self.phase.terminal:
            return []
        deadline = self.config.active_deadline_seconds
        if (
            deadline is not None
            and self.started_at is not None
            and now - self.started_at > deadline
            and self._cancel is None
        ):
            return self.cancel(
                now,
                f"DeadlineExceeded: job ran longer than activeDeadlineSeconds={deadline:g}",
                phase=JobPhase.FAILED,
            )
        if attempt.phase is AttemptPhase.RUNNING:
            return self._observe_running(now, attempt, reports)
        if attempt.phase is AttemptPhase.STOPPING:
            return self._observe_stopping(now, attempt, reports)
        return []

    # -- transitions -------------------------------------------------------

    def _observe_running(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        faults = self._faults(now, attempt, reports)
        if faults:
            attempt.faults.extend(faults)
            for fault in faults:
                self._event(
                    now,
                    "Fault",
                    fault.message,
                    node=fault.node,
                    rank=fault.rank,
                    data=fault.to_json(),
                )
            return [self._stop(now, attempt, "process", faults[0].message)]
        current = self._reports_for(attempt, reports)
        if len(current) == len(attempt.assignments) and all(
            r.state is NodeState.COMPLETED for r in current
        ):
            self._end_attempt(now, attempt, AttemptPhase.SUCCEEDED, "all ranks exited 0")
            return self._finish(now, JobPhase.SUCCEEDED, "all ranks completed")
        return []

    def _observe_stopping(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        waiting = [a.node_id for a in attempt.assignments if not _stopped(reports.get(a.node_id))]
        if waiting and attempt.stop_deadline is not None and now < attempt.stop_deadline:
            return []
        for node_id in waiting:
            fault = Fault(
                FaultType.NODE_STOP_TIMEOUT,
                now,
                attempt.number,
                node=node_id,
                message=f"{node_id} did not stop within the stop timeout",
            )
            attempt.faults.append(fault)
            self._event(now, "Fault", fault.message, node=node_id, data=fault.to_json())
        outcome = AttemptPhase.FAILED if attempt.faults else AttemptPhase.STOPPED
        self._end_attempt(now, attempt, outcome, attempt.reason or "stopped")
        if self._cancel is not None:
            phase, reason = self._cancel
            return self._finish(now, phase, reason)
        return self._after_failure(now, attempt)

    def _after_failure(self, now: float, attempt: Attempt) -> list[Action]:
        cause = attempt.reason or "attempt failed"
        lost = [
            f
            for f in attempt.faults
            if f.type in (FaultType.NODE_LOST, FaultType.NODE_STOP_TIMEOUT)
        ]
        if lost:
            # Replacing nodes is the next rung of the recovery ladder, not built yet.
            return self._finish(now, JobPhase.FAILED, f"{cause}; lost nodes cannot be replaced yet")
        if self.restarts >= self.config.max_restarts:
            return self._finish(
                now,
                JobPhase.FAILED,
                f"{cause}; retry budget exhausted "
                f"(jobMaxRetryCount={self.config.max_restarts}, restarts={self.restarts})",
            )
        self.phase = JobPhase.RESTARTING
        self._event(
            now,
            "RestartScheduled",
            f"process-level restart {self.restarts + 1} of {self.config.max_restarts}",
            attempt=attempt.number + 1,
            data={"scope": "process"},
        )
        return [self._start_attempt(now)]

    def _start_attempt(self, now: float) -> StartNodes:
        number = len(self.attempts)
        endpoint = self._endpoint_for(number)
        assignments = tuple(
            assign_ranks(
                self.config.job_id,
                self.config.node_ids,
                self.config.nproc_per_node,
                attempt=number,
                endpoint=endpoint,
                restart_count=number,
                max_restarts=self.config.max_restarts,
                extra_env=self.config.extra_env,
            )
        )
        self.attempts.append(Attempt(number, now, endpoint, assignments))
        self.phase = JobPhase.RUNNING
        self._event(
            now,
            "AttemptStarted",
            f"attempt {number}: {len(assignments)} nodes x {self.config.nproc_per_node} "
            f"ranks, rendezvous {endpoint.addr}:{endpoint.port}",
            attempt=number,
            data={"master_addr": endpoint.addr, "master_port": endpoint.port},
        )
        return StartNodes(number, assignments)

    def _stop(self, now: float, attempt: Attempt, mode: str, reason: str) -> StopNodes:
        attempt.phase = AttemptPhase.STOPPING
        attempt.reason = attempt.reason or reason
        grace = self.config.stop_grace_seconds if mode == "graceful" else 0.0
        attempt.stop_deadline = now + grace + self.config.stop_slack_seconds
        self._event(
            now,
            "StoppingAll",
            f"stopping all ranks of attempt {attempt.number} ({mode}): {attempt.reason}",
            attempt=attempt.number,
            data={"mode": mode},
        )
        return StopNodes(attempt.number, tuple(a.node_id for a in attempt.assignments), mode, grace)

    def _end_attempt(self, now: float, attempt: Attempt, phase: AttemptPhase, reason: str) -> None:
        attempt.phase = phase
        attempt.ended_at = now
        attempt.reason = attempt.reason or reason
        self._event(
            now,
            "AttemptEnded",
            f"attempt {attempt.number} {phase.value.lower()}: {attempt.reason}",
            attempt=attempt.number,
            data={"outcome": str(phase)},
        )

    def _finish(self, now: float, phase: JobPhase, reason: str) -> list[Action]:
        self.phase = phase
        self.reason = reason
        self._event(now, f"Job{phase.value}", reason)
        return [Finish(phase, reason)]

    def _faults(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[Fault]:
        faults: list[Fault] = []
        for assignment in attempt.assignments:
            report = reports.get(assignment.node_id)
            if report is None or not report.reachable:
                faults.append(
                    Fault(
                        FaultType.NODE_LOST,
                        now,
                        attempt.number,
                        node=assignment.node_id,
                        message=f"{assignment.node_id} lost: its agent does not answer",
                    )
                )
            elif report.attempt == attempt.number and report.state is NodeState.FAULTED:
                faults.extend(
                    Fault(
                        FaultType.WORKER_CRASH,
                        now,
                        attempt.number,
                        node=assignment.node_id,
                        rank=failure.rank,
                        message=failure.describe(),
                        evidence={
                            "exitcode": failure.exitcode,
                            "signal": failure.signal,
                            "error": failure.error,
                        },
                    )
                    for failure in report.failures
                )
                if not report.failures:
                    faults.append(
                        Fault(
                            FaultType.WORKER_CRASH,
                            now,
                            attempt.number,
                            node=assignment.node_id,
                            message=report.reason or f"{assignment.node_id} faulted",
                        )
                    )
        return faults

    def _reports_for(
        self, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> Sequence[NodeReport]:
        return [
            r
            for a in attempt.assignments
            if (r := reports.get(a.node_id)) is not None
            and r.reachable
            and r.attempt == attempt.number
        ]

    def _event(
        self,
        now: float,
        kind: str,
        message: str,
        attempt: int | None = None,
        node: str | None = None,
        rank: int | None = None,
        data: dict[str, object] | None = None,
    ) -> None:
        if attempt is None and self.attempts:
            attempt = self.attempts[-1].number
        self._pending_events.append(
            Event(now, kind, message, attempt, node, rank, dict(data or {}))
        )


def _stopped(report: NodeReport | None) -> bool:
    """True when nothing more is to be waited for on this node.

    An unreachable node has nothing to wait for: the platform reaps what is
    left of it, and the next attempt finds out whether it is really gone.
    """
    return report is None or not report.reachable or report.state.quiescent
