"""Turning one attempt's node reports into faults.

Crashes and lost nodes come from the agents' process view; slow, faulty and
NaN metrics from the agents' per-rank log matching; hangs from job-wide timers
evaluated here, because which rank logs is the script's choice (a rule is only
hanging when no rank anywhere matched it in time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainguard.control.assignment import NodeAssignment
from trainguard.control.events import Fault, FaultType
from trainguard.control.reports import NodeReport, NodeState
from trainguard.monitor.hang import HangWatch, HeartbeatWatch
from trainguard.monitor.rules import Detection, LogRuleSpec

_DETECTION_TYPES = {
    "LogSlow": FaultType.LOG_SLOW,
    "LogFault": FaultType.LOG_FAULT,
    "NaNMetric": FaultType.NAN_METRIC,
}


@dataclass(frozen=True)
class Progress:
    """The job's progress in one attempt: its first and latest completed step."""

    first_step: int
    first_time: float
    step: int
    time: float


class AttemptWatch:
    """Everything that turns one attempt's reports into faults; one per attempt."""

    def __init__(
        self,
        attempt: int,
        started_at: float,
        rules: Sequence[LogRuleSpec],
        heartbeat_timeout: float | None,
    ) -> None:
        self.attempt = attempt
        self._hang = HangWatch(rules, started_at) if rules else None
        self._beats = HeartbeatWatch(heartbeat_timeout) if heartbeat_timeout else None
        self._seen: set[tuple[str, str, str, int, float]] = set()
        self.progress: Progress | None = None

    def faults(
        self,
        now: float,
        assignments: Sequence[NodeAssignment],
        reports: Mapping[str, NodeReport],
    ) -> list[Fault]:
        current = [
            r
            for a in assignments
            if (r := reports.get(a.node_id)) is not None
            and r.reachable
            and r.attempt == self.attempt
        ]
        self._observe_progress(current)
        faults: list[Fault] = []
        for assignment in assignments:
            report = reports.get(assignment.node_id)
            if report is None or not report.reachable:
                faults.append(
                    self._fault(
                        FaultType.NODE_LOST,
                        now,
                        assignment.node_id,
                        None,
                        f"{assignment.node_id} lost: its agent does not answer",
                    )
                )
        for report in current:
            faults += self._crashes(now, report)
            faults += self._detections(report)
        faults += self._hangs(now, current)
        return faults

    # -- sources -----------------------------------------------------------------

    def _crashes(self, now: float, report: NodeReport) -> list[Fault]:
        if report.state is not NodeState.FAULTED:
            return []
        if not report.failures:
            return [
                self._fault(
                    FaultType.WORKER_CRASH,
                    now,
                    report.node_id,
                    None,
                    report.reason or f"{report.node_id} faulted",
                )
            ]
        return [
            self._fault(
                FaultType.WORKER_CRASH,
                now,
                report.node_id,
                failure.rank,
                failure.describe(),
                exitcode=failure.exitcode,
                signal=failure.signal,
                error=failure.error,
            )
            for failure in report.failures
        ]

    def _detections(self, report: NodeReport) -> list[Fault]:
        faults = []
        for d in report.detections:
            key = (report.node_id, d.kind, d.rule, d.rank, d.time)
            if key in self._seen:
                continue
            self._seen.add(key)
            faults.append(self._from_detection(report.node_id, d))
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

    def _hangs(self, now: float, current: Sequence[NodeReport]) -> list[Fault]:
        faults = []
        if self._hang is not None:
            for report in current:
                for name, activity in report.rules.items():
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
        if self._beats is not None:
            where = {}
            for report in current:
                for rank, beat in report.heartbeats.items():
                    self._beats.observe(rank, beat)
                    where[rank] = report.node_id
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

    def pause(self, now: float) -> None:
        for watch in (self._hang, self._beats):
            if watch is not None:
                watch.pause(now)

    def resume(self, now: float) -> None:
        for watch in (self._hang, self._beats):
            if watch is not None:
                watch.resume(now)

    def _observe_progress(self, current: Sequence[NodeReport]) -> None:
        ranks = [p for report in current for p in report.progress.values()]
        if not ranks:
            return
        first = min(ranks, key=lambda p: (p.first_time, p.first_step))
        latest = max(ranks, key=lambda p: (p.step, p.time))
        self.progress = Progress(first.first_step, first.first_time, latest.step, latest.time)

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
