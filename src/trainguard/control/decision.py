"""What the planners see and what they decide: a frozen view in, a decision value out.

The planners (control/lifecycle.py, recovery.py, replace.py, rescale.py) are functions
of a :class:`JobView`, the job as the controller holds it at one look, that return a
:class:`Decision`: the faults, how the attempt ends, the node pool after it, the next
attempt (and how it starts), the actions and the events. :meth:`JobController._apply
<trainguard.control.controller.JobController._apply>` is the one place that carries a
decision out. The planners never change the view (the elastic watch's looks return its
next value, which the decision carries), so each is tested with literal values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.control.actions import Action, AttemptPhase, JobPhase, StopMode
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.attempt import Activity, Attempt
from trainguard.control.config import ControlConfig
from trainguard.control.elastic import ElasticWatch
from trainguard.control.events import Fault, Note
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.reports import NodeReport

__all__ = ["Decision", "InPlace", "JobView", "NextAttempt", "Note", "Stop", "chain"]


@dataclass(frozen=True)
class Stop:
    """Stop the current attempt's ranks."""

    mode: StopMode
    reason: str
    capture: bool = False


@dataclass(frozen=True)
class NextAttempt:
    """A new attempt on the decided nodes: ``launch`` these first (else start at once),
    ``retire`` these; its activity while it launches; ``keep``: launched nodes whose live
    agent may take the new incarnation (:class:`~trainguard.control.actions.LaunchNodes`)."""

    scope: RestartScope
    launch: tuple[str, ...] = ()
    retire: tuple[str, ...] = ()
    activity: Activity | None = None
    keep: tuple[str, ...] = ()


@dataclass(frozen=True)
class InPlace:
    """The next attempt in place, on the decided nodes: the ranks of the nodes kept
    rejoin (``survivors``: those that keep their processes, the rest replaced; empty:
    every rank must join), ``added`` start, ``dropped`` are retired; ``host``: the
    rendezvous kept (rank 0 keeps its process)."""

    added: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    survivors: tuple[int, ...] = ()
    host: StoreEndpoint | None = None


@dataclass(frozen=True)
class Decision:
    """What to do now. None fields are unchanged; applied in this order: the pool and the
    activity, the faults, the attempt's end, the events, the actions, the stop, then the
    job's end (``finish``, or ``complete``: once the last checkpoint is durable), the
    attempt's start or the next attempt, then ``then``."""

    actions: tuple[Action, ...] = ()
    events: tuple[Note, ...] = ()
    faults: tuple[Fault, ...] = ()
    relaunch: tuple[str, ...] = ()  # nodes restarting fresh elsewhere: Schedulable again
    nodes: tuple[str, ...] | None = None
    spares: tuple[str, ...] | None = None
    growth: tuple[str, ...] | None = None
    avoid_hosts: tuple[str, ...] | None = None
    elastic: ElasticWatch | None = None
    activity: Activity | None = None
    phase: JobPhase | None = None
    scope: RestartScope | None = None  # the ended attempt's recovery, in the timeline
    counted: bool = False  # a restart against jobMaxRetryCount (of ``scope``)
    end: tuple[AttemptPhase, str] | None = None
    stop: Stop | None = None
    stop_deadline: float | None = None  # when the stopping attempt's nodes are late
    finish: tuple[JobPhase, str] | None = None
    complete: str | None = None  # every rank's work is done: the job succeeds, saying why
    start: bool = False  # the launched attempt starts: ranks assigned, /start sent
    next: NextAttempt | InPlace | None = None

    then: Decision | None = None  # applied after this one (made on ``view.after(this)``)


def chain(first: Decision, *rest: Decision) -> Decision:
    """``first``, then each of ``rest`` in turn (an empty decision left out)."""
    rest = tuple(d for d in rest if d != Decision())
    if not rest or first == Decision():
        return chain(*rest) if rest else first
    later = chain(*rest) if first.then is None else chain(first.then, *rest)
    return dataclasses.replace(first, then=later)


@dataclass(frozen=True)
class JobView:
    """The job at one look, as the planners see it (never changed by them)."""

    now: float
    config: ControlConfig
    attempt: Attempt  # the current attempt (read only)
    activity: Activity  # the current attempt's, as decided so far
    reports: Mapping[str, NodeReport]
    nodes: tuple[str, ...]
    spares: tuple[str, ...] = ()
    growth: tuple[str, ...] = ()
    avoid_hosts: tuple[str, ...] = ()
    history: tuple[RestartRecord, ...] = ()
    attempts: tuple[Attempt, ...] = ()  # every attempt so far, the current one last
    hosts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    node_fault_times: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
    unusable: Mapping[str, str] = dataclasses.field(default_factory=dict)  # node -> why
    capacity: int | None = None
    preempted: tuple[str, ...] = ()
    elastic: ElasticWatch | None = None
    cancel: tuple[JobPhase, str] | None = None  # asked to stop from outside: how it ends

    @property
    def restarts(self) -> int:
        return len(self.history)

    def after(self, decision: Decision) -> JobView:
        """The view once ``decision``'s pool, activity and faults are applied, and the
        attempt's end (on a copy of the attempt: the view's own is unchanged)."""
        view: JobView = self
        step: Decision | None = decision
        while step is not None:
            names = ("nodes", "spares", "growth", "avoid_hosts", "elastic", "activity")
            changes: dict[str, Any] = {n: v for n in names if (v := getattr(step, n)) is not None}
            if step.faults or step.end is not None:
                a = view.attempt
                new = dataclasses.replace(a, faults=[*a.faults, *step.faults])
                if step.end is not None:
                    new.phase, new.ended_at = step.end[0], view.now
                    new.reason = a.reason or step.end[1]
                times = dict(view.node_fault_times)
                for f in step.faults:
                    if f.node is not None:
                        times[f.node] = (*times.get(f.node, ()), f.time)
                attempts = tuple(new if x is a else x for x in view.attempts)
                changes.update(attempt=new, attempts=attempts, node_fault_times=times)
            view, step = dataclasses.replace(view, **changes), step.then
        return view
