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
  deadline passes (the nodes that did not stop are then faulted as such);
- which restart follows is :func:`trainguard.control.policy.decide_restart`'s call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.control.actions import (
    Action,
    AttemptPhase,
    ControlConfig,
    Finish,
    JobPhase,
    RejoinNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.assignment import Endpoint, NodeAssignment, assign_ranks
from trainguard.control.detect import AttemptWatch
from trainguard.control.events import Event, Fault, FaultType
from trainguard.control.persist import CheckpointPlanner, PersistCheckpoint
from trainguard.control.policy import (
    BARRIER_MISSED,
    GiveUp,
    RestartRecord,
    RestartScope,
    decide_restart,
)
from trainguard.control.reports import NodeReport, NodeState
from trainguard.control.timeline import Timeline, with_evidence

__all__ = [
    "Action",
    "AttemptPhase",
    "ControlConfig",
    "Finish",
    "JobController",
    "JobPhase",
    "PersistCheckpoint",
    "RejoinNodes",
    "StartNodes",
    "StopNodes",
]


@dataclass
class Attempt:
    number: int
    started_at: float
    endpoint: Endpoint
    assignments: tuple[NodeAssignment, ...]
    watch: AttemptWatch
    scope: str = RestartScope.PROCESS.value
    phase: AttemptPhase = AttemptPhase.RUNNING
    ended_at: float | None = None
    reason: str | None = None
    faults: list[Fault] = field(default_factory=list)
    stop_deadline: float | None = None
    recovered: bool = False


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
        self.nodes: tuple[str, ...] = config.node_ids
        self.spares: tuple[str, ...] = config.spare_node_ids
        self.history: list[RestartRecord] = []
        self.timeline = Timeline()
        self._node_fault_times: dict[str, list[float]] = {}
        self._pending_events: list[Event] = []
        self._injections: list[str] = []
        self._seen_worker_events: set[tuple[int, int, float]] = set()
        # Set when a stop was asked for from outside (delete, Ctrl-C, deadline).
        self._cancel: tuple[JobPhase, str] | None = None
        self.checkpoints = CheckpointPlanner(config.durable, config.world_size, 0.0)
        # Set once every rank exited 0: until then the last checkpoint may still persist.
        self._final_persist_until: float | None = None

    # -- queries -----------------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def restarts(self) -> int:
        return len(self.history)

    @property
    def full_restarts(self) -> int:
        return sum(1 for r in self.history if r.scope is RestartScope.JOB)

    def drain_events(self) -> list[Event]:
        """Events recorded since the last call, oldest first."""
        events, self._pending_events = self._pending_events, []
        return events

    # -- inputs ------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        if self.phase is not JobPhase.PENDING:
            raise RuntimeError(f"job already started (phase {self.phase})")
        self.started_at = now
        self.checkpoints = CheckpointPlanner(self.config.durable, self.config.world_size, now)
        self._event(now, "JobStarted", f"job {self.config.job_id} started")
        return [self._start_attempt(now, RestartScope.PROCESS.value)]

    def cancel(self, now: float, reason: str, phase: JobPhase = JobPhase.STOPPED) -> list[Action]:
        """Stop the job from outside (user delete, Ctrl-C, deadline). Idempotent."""
        if self.phase.terminal or self._cancel is not None:
            return []
        self._cancel = (phase, reason)
        self._event(now, "StopRequested", reason)
        attempt = self.current
        if attempt is None:
            return self._finish(now, phase, reason)
        if attempt.phase is not AttemptPhase.RUNNING:
            return []
        self.phase = JobPhase.STOPPING
        return [self._stop(now, attempt, "graceful", reason)]

    def note_injection(self, now: float, spec: str, rank: int | None, node: str | None) -> None:
        """A fault was injected on purpose; the next fault detected is marked as injected."""
        self._injections.append(spec)
        self._event(
            now,
            "FaultInjected",
            f"injected {spec}",
            node=node,
            rank=rank,
            data={"spec": spec, "injected": True},
        )

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
        self._worker_events(attempt, reports)
        if attempt.phase is AttemptPhase.RUNNING:
            return self._observe_running(now, attempt, reports)
        if attempt.phase is AttemptPhase.STOPPING:
            return self._observe_stopping(now, attempt, reports)
        return []

    # -- transitions -------------------------------------------------------

    def _observe_running(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        faults = attempt.watch.faults(now, attempt.assignments, reports)
        self._note_progress(now, attempt)
        if faults:
            for fault in faults:
                self._record_fault(now, attempt, fault)
            if self._can_restart_in_place(attempt, faults, reports):
                return [self._restart_in_place(now, attempt)]
            capture = any(f.type.is_hang for f in faults)
            return [self._stop(now, attempt, "process", faults[0].message, capture)]
        actions: list[Action] = list(self._plan_checkpoints(now, attempt, reports))
        current = [
            r
            for a in attempt.assignments
            if (r := reports.get(a.node_id)) is not None
            and r.reachable
            and r.attempt == attempt.number
        ]
        if len(current) == len(attempt.assignments) and all(
            r.state is NodeState.COMPLETED for r in current
        ):
            if self._final_persist_until is None:
                self._final_persist_until = now + self.config.final_persist_timeout
                node_ids = [a.node_id for a in attempt.assignments]
                final = self.checkpoints.flush(now, node_ids, reports)
                if final is not None:
                    self._event(
                        now,
                        "CheckpointPersisting",
                        f"persisting the final step {final.step} to durable storage",
                        data={"step": final.step},
                    )
                    return [*actions, final]
            if self.checkpoints.busy and now < self._final_persist_until:
                return actions  # the newest checkpoint is still on its way to durable storage
            self._end_attempt(now, attempt, AttemptPhase.SUCCEEDED, "all ranks exited 0")
            return [*actions, *self._finish(now, JobPhase.SUCCEEDED, "all ranks completed")]
        return actions

    def _plan_checkpoints(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[PersistCheckpoint]:
        node_ids = [a.node_id for a in attempt.assignments]
        requests, notes = self.checkpoints.observe(now, node_ids, reports)
        for note in notes:
            self._event(now, note.kind, note.message, data=note.data)
        for request in requests:
            self._event(
                now,
                "CheckpointPersisting",
                f"persisting step {request.step} from node memory to durable storage",
                data={"step": request.step},
            )
        return requests

    def _observe_stopping(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        waiting = [a.node_id for a in attempt.assignments if not _stopped(reports.get(a.node_id))]
        if waiting and attempt.stop_deadline is not None and now < attempt.stop_deadline:
            return []
        self._attach_stacks(attempt, reports)
        for node_id in waiting:
            self._record_fault(
                now,
                attempt,
                Fault(
                    FaultType.NODE_STOP_TIMEOUT,
                    now,
                    attempt.number,
                    node=node_id,
                    message=f"{node_id} did not stop within the stop timeout",
                ),
            )
        outcome = AttemptPhase.FAILED if attempt.faults else AttemptPhase.STOPPED
        self._end_attempt(now, attempt, outcome, attempt.reason or "stopped")
        if self._cancel is not None:
            phase, reason = self._cancel
            return self._finish(now, phase, reason)
        return self._after_failure(now, attempt)

    def _after_failure(self, now: float, attempt: Attempt) -> list[Action]:
        decision = decide_restart(
            now,
            attempt.faults,
            self.history,
            self._node_fault_times,
            self.nodes,
            self.spares,
            self.config.policy,
        )
        if isinstance(decision, GiveUp):
            return self._finish(now, JobPhase.FAILED, decision.reason)
        self.history.append(RestartRecord(now, decision.scope))
        self.timeline.set_scope(attempt.number, decision.scope.value)
        used = set(decision.nodes)
        self.spares = tuple(s for s in self.spares if s not in used)
        self.nodes = decision.nodes
        self.phase = JobPhase.RESTARTING
        self._event(
            now,
            "RestartScheduled",
            f"{decision.scope.value}-level restart "
            f"{self.restarts} of {self.config.max_restarts}: {decision.reason}",
            attempt=attempt.number + 1,
            data={"scope": decision.scope.value, "replaced": dict(decision.replaced)},
        )
        return [self._start_attempt(now, decision.scope.value)]

    def _can_restart_in_place(
        self, attempt: Attempt, faults: list[Fault], reports: Mapping[str, NodeReport]
    ) -> bool:
        """Worker crashes only, every node up with its survivors waiting, budget left, and
        not a rank that missed the previous in-process restart's barrier."""
        if not self.config.in_process or self.restarts >= self.config.max_restarts:
            return False
        for fault in faults:
            error = str(fault.evidence.get("error") or "")
            if fault.type is not FaultType.WORKER_CRASH or fault.rank is None:
                return False
            if BARRIER_MISSED in error:
                return False
        for a in attempt.assignments:
            report = reports.get(a.node_id)
            if report is None or not report.reachable or report.attempt != attempt.number:
                return False
            if report.state not in (NodeState.RUNNING, NodeState.FAULTED):
                return False
        return True

    def _restart_in_place(self, now: float, attempt: Attempt) -> RejoinNodes:
        scope = RestartScope.IN_PROCESS
        reason = attempt.faults[0].message
        self._end_attempt(now, attempt, AttemptPhase.FAILED, reason)
        self.history.append(RestartRecord(now, scope))
        self.timeline.set_scope(attempt.number, scope.value)
        self.phase = JobPhase.RESTARTING
        self._event(
            now,
            "RestartScheduled",
            f"in-process restart {self.restarts} of {self.config.max_restarts}: {reason}; "
            "survivors keep their processes, dead ranks are replaced",
            attempt=attempt.number + 1,
            data={"scope": scope.value, "replaced": {}},
        )
        started = self._start_attempt(now, scope.value)
        return RejoinNodes(started.attempt, started.assignments)

    def _start_attempt(self, now: float, scope: str) -> StartNodes:
        number = len(self.attempts)
        endpoint = self._endpoint_for(number)
        cfg = self.config
        assignments = tuple(
            replace(
                a,
                in_process=cfg.in_process,
                # Round robin from node 0: node i gets its share of the job's hot spares.
                hot_spares=cfg.hot_spares // len(self.nodes)
                + (1 if a.node_rank < cfg.hot_spares % len(self.nodes) else 0),
                barrier_timeout=cfg.barrier_timeout,
            )
            for a in assign_ranks(
                cfg.job_id,
                self.nodes,
                cfg.nproc_per_node,
                attempt=number,
                endpoint=endpoint,
                restart_count=number,
                max_restarts=cfg.max_restarts,
                extra_env=cfg.extra_env,
                monitor=cfg.monitor_json(),
            )
        )
        watch = AttemptWatch(number, now, self.config.log_rules, self.config.heartbeat_timeout)
        self.attempts.append(Attempt(number, now, endpoint, assignments, watch, scope))
        self.phase = JobPhase.RUNNING
        self._event(
            now,
            "AttemptStarted",
            f"attempt {number}: {len(assignments)} nodes x {self.config.nproc_per_node} ranks "
            f"({scope} scope), rendezvous {endpoint.addr}:{endpoint.port}",
            attempt=number,
            data={
                "master_addr": endpoint.addr,
                "master_port": endpoint.port,
                "scope": scope,
                "nodes": list(self.nodes),
            },
        )
        return StartNodes(number, assignments, scope)

    def _stop(
        self, now: float, attempt: Attempt, mode: str, reason: str, capture: bool = False
    ) -> StopNodes:
        attempt.phase = AttemptPhase.STOPPING
        attempt.reason = attempt.reason or reason
        attempt.watch.pause(now)
        grace = self.config.stop_grace_seconds if mode == "graceful" else 0.0
        attempt.stop_deadline = now + grace + self.config.stop_slack_seconds
        self._event(
            now,
            "StoppingAll",
            f"stopping all ranks of attempt {attempt.number} ({mode}): {attempt.reason}",
            attempt=attempt.number,
            data={"mode": mode, "capture_stacks": capture},
        )
        return StopNodes(
            attempt.number, tuple(a.node_id for a in attempt.assignments), mode, grace, capture
        )

    def _record_fault(self, now: float, attempt: Attempt, fault: Fault) -> None:
        if self._injections:
            fault = with_evidence(fault, injected=self._injections.pop(0))
        attempt.faults.append(fault)
        if fault.node is not None:
            self._node_fault_times.setdefault(fault.node, []).append(fault.time)
        progress = attempt.watch.progress
        self.timeline.add(fault, progress.step if progress else None)
        self._event(
            now, "Fault", fault.message, node=fault.node, rank=fault.rank, data=fault.to_json()
        )

    def _attach_stacks(self, attempt: Attempt, reports: Mapping[str, NodeReport]) -> None:
        stacks = {
            str(rank): text
            for a in attempt.assignments
            if (r := reports.get(a.node_id)) is not None and r.attempt == attempt.number
            for rank, text in r.stacks.items()
        }
        if not stacks:
            return
        stopped = sorted(int(rank) for rank, text in stacks.items() if _STOPPED.search(text))
        for i, fault in enumerate(attempt.faults):
            if fault.type.is_hang and "stacks" not in fault.evidence:
                updated = with_evidence(fault, stacks=stacks, stopped_ranks=stopped)
                attempt.faults[i] = updated
                self.timeline.update_fault(fault, updated)

    def _worker_events(self, attempt: Attempt, reports: Mapping[str, NodeReport]) -> None:
        """Events the workers reported (a checkpoint restored, ...), each added once."""
        for assignment in attempt.assignments:
            report = reports.get(assignment.node_id)
            if report is None or report.attempt != attempt.number:
                continue
            for e in report.worker_events:
                # Not keyed by attempt: after an in-process restart, the same workers (and
                # their event files) go on into the next attempt.
                key = (e.rank, e.seq, e.time)
                if key not in self._seen_worker_events:
                    self._seen_worker_events.add(key)
                    self._event(
                        e.time,
                        e.kind,
                        e.message,
                        attempt=attempt.number,
                        node=assignment.node_id,
                        rank=e.rank,
                        data=e.data,
                    )

    def _note_progress(self, now: float, attempt: Attempt) -> None:
        progress = attempt.watch.progress
        if progress is None or attempt.recovered:
            return
        attempt.recovered = True
        for record in self.timeline.progress(
            attempt.number, progress.first_step, progress.first_time
        ):
            self._event(
                now,
                "Recovered",
                f"{record.fault.type} of attempt {record.fault.attempt} recovered in "
                f"{record.recovery_seconds:.1f}s ({record.scope} restart); resumed from step "
                f"{record.resumed_step}, {record.lost_steps} steps lost",
                attempt=attempt.number,
                data=record.to_json(),
            )

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

    def _event(
        self,
        now: float,
        kind: str,
        message: str,
        attempt: int | None = None,
        node: str | None = None,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        if attempt is None and self.attempts:
            attempt = self.attempts[-1].number
        self._pending_events.append(
            Event(now, kind, message, attempt, node, rank, dict(data or {}))
        )


# How a captured stack names a process that is stopped (SIGSTOP, or a debugger).
_STOPPED = re.compile(r"^pid \d+ \(.*\): state [Tt]\b", re.MULTILINE)


def _stopped(report: NodeReport | None) -> bool:
    """True when nothing more is to be waited for on this node.

    An unreachable node has nothing to wait for: the platform reaps what is
    left of it, and the next attempt finds out whether it is really gone.
    """
    return report is None or not report.reachable or report.state.quiescent
