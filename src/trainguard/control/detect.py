"""Turning one attempt's node reports into faults.

Crashes come from the agents' worker statuses (the wire values, read as they came); lost
nodes from :func:`~trainguard.control.contact.contact`; slow, faulty and NaN metrics
from the agents' per-rank log matching; hangs from job-wide timers evaluated here,
because which rank logs is the script's choice (a rule is only hanging when no rank
anywhere matched it in time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainguard.control.contact import Contact, ContactRule, contact, lost, lost_reason
from trainguard.control.events import Fault, FaultType
from trainguard.control.exit_hang import DEFAULT_TIMEOUT as DEFAULT_EXIT_HANG_TIMEOUT
from trainguard.control.exit_hang import ExitWatch
from trainguard.control.no_progress import DEFAULT_TIMEOUT as DEFAULT_NO_PROGRESS_TIMEOUT
from trainguard.control.no_progress import StallWatch
from trainguard.control.reports import NodeReport, Refusal
from trainguard.monitor.hang import HangWatch, HeartbeatWatch
from trainguard.monitor.rules import LogRuleSpec
from trainguard.wire.control_files import EXIT_BARRIER_TIMEOUT
from trainguard.wire.requests import NodeAssignment
from trainguard.wire.status import (
    Detection,
    NodeState,
    NodeStatus,
    Progress,
    WorkerState,
    WorkerStatus,
)

_DETECTION_TYPES = {
    "LogSlow": FaultType.LOG_SLOW,
    "LogFault": FaultType.LOG_FAULT,
    "NaNMetric": FaultType.NAN_METRIC,
}


_REFUSED = {
    "start": FaultType.START_REFUSED,
    "rejoin": FaultType.REJOIN_REFUSED,
    "replace": FaultType.REJOIN_REFUSED,
}


def refusal_faults(now: float, attempt: int, refusals: Sequence[Refusal]) -> list[Fault]:
    """The faults of ``attempt``'s refused requests (a refused persist is no fault: the
    checkpoint planner notes it)."""
    return [
        Fault(
            _REFUSED[r.request],
            now,
            attempt,
            node=r.node_id,
            message=f"{r.node_id} refused /{r.request} of attempt {r.attempt}: {r.message}",
            evidence={"request": r.request, "refusal": r.message},
        )
        for r in refusals
        if r.request in _REFUSED and r.attempt == attempt
    ]


def barrier_fault(now: float, attempt: int, node: str, rank: int, timeout: float) -> Fault:
    """``rank`` had not joined ``attempt`` (an in-process restart) ``timeout`` after it."""
    return Fault(
        FaultType.BARRIER_MISSED,
        now,
        attempt,
        node=node,
        rank=rank,
        message=f"rank {rank} missed the restart barrier of attempt {attempt} within {timeout:g} s",
    )


def finished(attempt: int, nodes: Sequence[str], reports: Mapping[str, NodeReport]) -> bool:
    """After a stop: every rank of ``nodes`` exited 0 on its own (none was stopped, none
    agreed to a scaling first, ``trainguard.elastic``): their work was done."""
    for node_id in nodes:
        report = reports.get(node_id)
        status = report.about(attempt) if report is not None else None
        if status is None or not status.workers:
            return False
        if any(w.state is not WorkerState.SUCCEEDED for w in status.workers):
            return False
    return True


def stop_faults(
    now: float,
    attempt: int,
    nodes: Sequence[str],
    recorded: Sequence[Fault],
    waiting: Sequence[str],
    reports: Mapping[str, NodeReport],
    rule: ContactRule,
) -> list[Fault]:
    """When the stop of ``attempt`` (on ``nodes``) ends: the nodes that did not stop in
    time (``waiting``), and the nodes lost while stopping (a machine that died just after
    one of its workers did); both must be replaced (``recorded`` faults may say so
    already)."""
    faults = [
        Fault(
            FaultType.NODE_STOP_TIMEOUT,
            now,
            attempt,
            node=node_id,
            message=f"{node_id} did not stop within the stop timeout",
        )
        for node_id in waiting
    ]
    replaced = {f.node for f in [*recorded, *faults] if f.type.loses_node}
    for node_id in nodes:
        report = reports.get(node_id)
        if node_id not in replaced and report is not None and lost(report, rule):
            message = lost_reason(report, rule)
            faults.append(Fault(FaultType.NODE_LOST, now, attempt, node=node_id, message=message))
    return faults


def exit_fault_type(worker: WorkerStatus, in_process: bool) -> FaultType:
    """What a failed worker's exit means: a crash, or (a resilient worker's exit 75) that
    it gave up joining an in-process restart."""
    if in_process and worker.exitcode == EXIT_BARRIER_TIMEOUT:
        return FaultType.BARRIER_GIVEN_UP
    return FaultType.WORKER_CRASH


class AttemptWatch:
    """Everything that turns one attempt's reports into faults; one per attempt."""

    def __init__(
        self,
        attempt: int,
        started_at: float,
        rules: Sequence[LogRuleSpec],
        heartbeat_timeout: float | None,
        *,
        contact_rule: ContactRule,
        in_process: bool = False,
        start_timeout: float | None = None,
        exit_hang_timeout: float | None = DEFAULT_EXIT_HANG_TIMEOUT,
        no_progress_timeout: float | None = DEFAULT_NO_PROGRESS_TIMEOUT,
    ) -> None:
        """``start_timeout``: how long an up node may go on reporting an older attempt;
        ``exit_hang_timeout``: the floor of :class:`ExitWatch`'s bound (None: never)."""
        self.attempt = attempt
        self.started_at = started_at
        self.start_timeout = start_timeout
        self.contact_rule = contact_rule
        self.in_process = in_process
        self._hang = HangWatch(rules, started_at) if rules else None
        self._beats = HeartbeatWatch(heartbeat_timeout) if heartbeat_timeout else None
        self.exits = ExitWatch(exit_hang_timeout)  # ranks that outlive the others
        self._stalls = StallWatch(no_progress_timeout)  # progress that stops
        self._seen: set[tuple[str, str, str, int, float]] = set()
        self._exits: set[tuple[str, int, int | None]] = set()
        self.progress: Progress | None = None  # the job's, in this attempt

    def current(
        self, assignments: Sequence[NodeAssignment], reports: Mapping[str, NodeReport]
    ) -> list[tuple[str, NodeStatus]]:
        """(node id, status) of every node that is up and reports this attempt."""
        out = []
        for a in assignments:
            report = reports.get(a.node_id)
            verdict = contact(report, self.contact_rule)
            if report is None or verdict is not Contact.UP:
                continue
            status = report.about(self.attempt)
            if status is not None:
                out.append((a.node_id, status))
        return out

    def faults(
        self,
        now: float,
        assignments: Sequence[NodeAssignment],
        reports: Mapping[str, NodeReport],
        current: Sequence[tuple[str, NodeStatus]],
    ) -> list[Fault]:
        """The faults ``reports`` show; ``current`` is :meth:`current` of the same."""
        self.observe_progress(current)
        faults: list[Fault] = []
        late = self.start_timeout is not None and now - self.started_at >= self.start_timeout
        taken = {node_id for node_id, _ in current}
        for a in assignments:
            report = reports.get(a.node_id) or NodeReport(a.node_id, gone="no report")
            verdict = contact(report, self.contact_rule)
            if verdict is Contact.LOST:
                message = lost_reason(report, self.contact_rule)
            elif late and a.node_id not in taken:
                # Up, but never took the attempt: its /start got lost on the way, say.
                message = (
                    f"{a.node_id} did not take attempt {self.attempt} "
                    f"within {self.start_timeout:g}s"
                )
            else:
                continue
            faults.append(
                self._fault(
                    FaultType.NODE_LOST,
                    now,
                    a.node_id,
                    None,
                    message,
                    failed_contacts=report.failed_contacts,
                    gone=report.gone,
                )
            )
        for node_id, status in current:
            faults += self._exits_of(now, node_id, status)
            faults += self._detections(node_id, status)
        faults += self._hangs(now, current)
        return faults

    # -- sources -----------------------------------------------------------------

    def _exits_of(self, now: float, node_id: str, status: NodeStatus) -> list[Fault]:
        if status.state is not NodeState.FAULTED:
            return []
        failed = status.failed_workers()
        if not failed:
            key: tuple[str, int, int | None] = (node_id, -1, None)
            if key in self._exits:
                return []
            self._exits.add(key)
            reason = status.reason or f"{node_id} faulted"
            return [self._fault(FaultType.WORKER_CRASH, now, node_id, None, reason)]
        faults = []
        for worker in failed:
            key = (node_id, worker.rank, worker.pid)
            if key in self._exits:
                continue
            self._exits.add(key)
            faults.append(
                self._fault(
                    exit_fault_type(worker, self.in_process),
                    now,
                    node_id,
                    worker.rank,
                    worker.describe_exit(),
                    exitcode=worker.exitcode,
                    signal=worker.signal,
                    error=worker.error,
                    traceback=worker.traceback,
                )
            )
        return faults

    def _detections(self, node_id: str, status: NodeStatus) -> list[Fault]:
        faults = []
        for d in status.monitor.detections:
            key = (node_id, d.kind, d.rule, d.rank, d.time)
            if key in self._seen:
                continue
            self._seen.add(key)
            faults.append(self._from_detection(node_id, d))
        return faults

    def _from_detection(self, node_id: str, d: Detection) -> Fault:
        value = "" if d.value is None else f" (value {d.value:g})"
        return self._fault(
            _DETECTION_TYPES.get(d.kind, FaultType.LOG_FAULT),
            d.time,
            node_id,
            d.rank,
            f"{d.reason}: rank {d.rank}{value}: {d.line.strip()}",
            reason=d.reason,
            rule=d.rule,
            line=d.line,
            value=d.value,
        )

    def _hangs(self, now: float, current: Sequence[tuple[str, NodeStatus]]) -> list[Fault]:
        faults = []
        if self._hang is not None:
            for _, status in current:
                for name, activity in status.monitor.rules.items():
                    self._hang.observe(name, activity.last_match_at, activity.stopped)
            for h in self._hang.check(now):
                faults.append(
                    self._fault(
                        FaultType.LOG_HANG,
                        now,
                        None,
                        None,
                        f"{h.reason}: no line matched rule {h.rule} for {now - h.since:.1f}s "
                        f"(limit {h.limit:g}s, {h.kind})",
                        reason=h.reason,
                        rule=h.rule,
                        since=h.since,
                        limit=h.limit,
                        timer=h.kind,
                    )
                )
        stall = self._stalls.check(now, self.progress, current)
        if stall is not None:
            faults.append(
                self._fault(
                    FaultType.NO_PROGRESS,
                    now,
                    stall.node,
                    stall.rank,
                    stall.message(now, self._stalls.elapsed(stall, now)),
                    **stall.evidence(),
                )
            )
        if self._beats is not None:
            where = {}
            for node_id, status in current:
                for rank, beat in status.heartbeats.items():
                    self._beats.observe(rank, beat.time)
                    where[rank] = node_id
            for rank, last in self._beats.check(now):
                faults.append(
                    self._fault(
                        FaultType.HEARTBEAT_TIMEOUT,
                        now,
                        where.get(rank),
                        rank,
                        f"rank {rank} sent no heartbeat for {now - last:.1f}s",
                        last_heartbeat_at=last,
                    )
                )
        return faults

    def due(self, current: Sequence[tuple[str, NodeStatus]]) -> float | None:
        """The soonest a hang timer (log rules, heartbeats, progress) can fire, from what
        was observed and ``current``; None: none can. While the attempt is paused a timer
        fires no sooner than this."""
        times = [self._stalls.due(self.progress, current)]
        times += [w.due() for w in (self._hang, self._beats) if w is not None]
        return min((t for t in times if t is not None), default=None)

    def pause(self, now: float) -> None:
        for watch in (self._hang, self._beats):
            if watch is not None:
                watch.pause(now)
        self._stalls.clock.pause(now)

    def resume(self, now: float) -> None:
        for watch in (self._hang, self._beats):
            if watch is not None:
                watch.resume(now)
        self._stalls.clock.resume(now)

    def observe_progress(self, current: Sequence[tuple[str, NodeStatus]]) -> None:
        """The job's progress in this attempt, with what ``current`` (:meth:`current`) shows."""
        progress = self.progress
        for _, status in current:
            node = status.monitor.progress
            if node is not None:
                progress = node.merge(progress)
        self.progress = progress

    def _fault(
        self,
        kind: FaultType,
        now: float,
        node: str | None,
        rank: int | None,
        message: str,
        **evidence: object,
    ) -> Fault:
        step = self.progress.step if self.progress else None
        return Fault(
            kind,
            now,
            self.attempt,
            node=node,
            rank=rank,
            step=step,
            message=message,
            evidence=dict(evidence),
        )
