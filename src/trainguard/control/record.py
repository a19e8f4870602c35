"""What happened to a job: its events and its fault timeline, as the controller records them.

The controller decides; :class:`JobRecord` writes it down: every event (drained by the
platform for its store, its console, Kubernetes Events), each fault (marked when it was
injected on purpose) with its place in the :class:`~trainguard.control.timeline.Timeline`,
the workers' own events (each once), the stacks captured for a hang, and the first step
of an attempt that recovers the faults before it. Pure, like the rest of the package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainguard.control.attempt import Attempt
from trainguard.control.events import Event, EventKind, Fault
from trainguard.control.reports import NodeReport
from trainguard.control.timeline import Timeline, left_at, resume_point, with_evidence

__all__ = ["JobRecord"]

# How a captured stack names a process that is stopped (SIGSTOP, or a debugger).
_STOPPED = re.compile(r"^pid \d+ \(.*\): state [Tt]\b", re.MULTILINE)


class JobRecord:
    """Events (oldest first) and the fault timeline of one job."""

    def __init__(self) -> None:
        self.timeline = Timeline()
        self._events: list[Event] = []
        self._injections: list[str] = []
        self._seen_worker_events: set[tuple[int, int, float]] = set()

    def drain(self) -> list[Event]:
        """Events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def event(
        self,
        now: float,
        kind: EventKind,
        message: str,
        attempt: int | None,
        node: str | None = None,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        self._events.append(Event(now, str(kind), message, attempt, node, rank, dict(data or {})))

    def injection(self, now: float, spec: str, rank: int | None, node: str | None,
                  attempt: int | None, step: int | None = None) -> None:  # fmt: skip
        """A fault was injected on purpose (at ``step``, the step its target had completed,
        when known); the next fault recorded is marked as injected."""
        data: dict[str, object] = {"spec": spec, "injected": True}
        message = f"injected {spec}"
        if step is not None:
            data["step"] = step
            message += f" (at step {step})"
        noted = Event(now, str(EventKind.FAULT_INJECTED), message, attempt, node, rank, data)
        if not self._mark_seen(noted, spec):
            self._injections.append(spec)
            self._events.append(noted)

    def _mark_seen(self, noted: Event, spec: str) -> bool:
        """Mark the fault the injection caused when it was seen first (the agent's report of
        the worker's death and of its injection came together): the newest unmarked fault
        since the injection, of its rank (or node); its event, not yet drained, follows
        the injection's."""
        for record in reversed(self.timeline.records):
            fault = record.fault
            if fault.time < noted.time:
                return False
            if "injected" in fault.evidence:
                continue
            if (noted.rank is None or fault.rank == noted.rank) and (
                noted.node is None or fault.node in (None, noted.node)
            ):
                marked = with_evidence(fault, injected=spec)
                self.timeline.update_fault(fault, marked)
                for i, event in enumerate(self._events):
                    if event.kind == EventKind.FAULT and event.data == fault.to_json():
                        self._events[i] = replace(event, data=marked.to_json())
                        self._events.insert(i, noted)
                        return True
                self._events.append(noted)
                return True
        return False

    def fault(self, now: float, attempt: Attempt, fault: Fault) -> Fault:
        """Record ``fault`` of ``attempt``; returns it as recorded (maybe marked injected)."""
        if self._injections:
            fault = with_evidence(fault, injected=self._injections.pop(0))
        attempt.faults.append(fault)
        progress = attempt.watch.progress
        self.timeline.add(fault, progress.step if progress else None)
        self.event(
            now,
            EventKind.FAULT,
            fault.message,
            attempt.number,
            fault.node,
            fault.rank,
            fault.to_json(),
        )
        return fault

    def attach_stacks(self, attempt: Attempt, reports: Mapping[str, NodeReport]) -> None:
        """Attach the stacks the agents captured while stopping to the attempt's hangs."""
        stacks = {
            str(rank): text
            for node_id in attempt.nodes
            if (r := reports.get(node_id)) is not None
            and (status := r.about(attempt.number)) is not None
            for rank, text in status.stacks.items()
        }
        if not stacks:
            return
        stopped = sorted(int(rank) for rank, text in stacks.items() if _STOPPED.search(text))
        for i, fault in enumerate(attempt.faults):
            if fault.type.is_hang and "stacks" not in fault.evidence:
                updated = with_evidence(fault, stacks=stacks, stopped_ranks=stopped)
                attempt.faults[i] = updated
                self.timeline.update_fault(fault, updated)

    def worker_events(self, attempt: Attempt, reports: Mapping[str, NodeReport]) -> None:
        """Events the workers reported (a checkpoint restored, ...), each added once, on
        the node that runs its rank in the attempt. Not the node that reported it: agents
        that share a host share the attempt's event directory, and each reports every
        rank's events there (node-0 reported node-1's ranks first)."""
        node_of: dict[int, str] | None = None  # rank -> its node, made once news comes
        for node_id in attempt.nodes:
            report = reports.get(node_id)
            status = report.about(attempt.number) if report is not None else None
            if status is None:
                continue
            for e in status.events:
                # Not keyed by attempt: after an in-process restart, the same workers (and
                # their event files) go on into the next attempt.
                key = (e.rank, e.seq, e.time)
                if key not in self._seen_worker_events:
                    self._seen_worker_events.add(key)
                    if node_of is None:
                        node_of = _rank_nodes(attempt)
                    node = node_of.get(e.rank, node_id)
                    event = Event(e.time, e.kind, e.message, attempt.number, node, e.rank,
                                  dict(e.data))  # fmt: skip
                    self._events.append(event)
                    self._steps_of(event)

    def _steps_of(self, event: Event) -> None:
        """A worker event that says where an attempt resumed from, or where a rank was
        when it left one: the fault timeline's steps."""
        if (resumed := resume_point(event)) is not None:
            self.timeline.resumed(*resumed)
        elif (left := left_at(event)) is not None:
            self.timeline.reached(*left)

    def reached(self, attempt: Attempt) -> None:
        """The attempt's newest step is the step its faults reached: the lines its ranks
        printed before a fault, read after it (a killed rank's last ones, while the
        attempt stops), count."""
        if (progress := attempt.watch.progress) is not None:
            self.timeline.reached(attempt.number, progress.step)

    def progress(self, now: float, attempt: Attempt) -> None:
        """The attempt's first completed step recovers every earlier open fault; its
        newest is the step its own faults reached (lines read after a fault count)."""
        self.reached(attempt)
        progress = attempt.watch.progress
        if progress is None or attempt.recovered:
            return
        attempt.recovered = True
        for record in self.timeline.progress(
            attempt.number, progress.first_step, progress.first_time
        ):
            self.event(
                now,
                EventKind.RECOVERED,
                f"{record.fault.type} of attempt {record.fault.attempt}{record.at_step()} "
                f"recovered in {record.recovery_seconds:.1f}s ({record.scope} restart); "
                f"resumed from step {record.resumed_step}, {record.lost_steps} steps lost",
                attempt.number,
                data=record.to_json(),
            )


def _rank_nodes(attempt: Attempt) -> dict[int, str]:
    """Each global rank of the attempt -> the node that runs it."""
    return {rank: a.node_id for a in attempt.assignments for rank in a.global_ranks}
