"""How soon the controller wants fresh reports: the pace of the platform's polls.

An agent pushes its status the moment anything changes (a worker exits, the node faults
or completes, a log line is a fault: :mod:`trainguard.agent.reporter`). What a push
does not tell is progress (steps, log matches, heartbeats) and the time that passes
without it, which the hang timers judge. So while every rank of a running attempt
trains and no timer is near, the controller asks for a poll only every
``quiet_poll_interval`` seconds; anything else asks for one every ``poll_interval``:

- an attempt launching, stopping, rejoining, rescaling or growing; a job stopping;
- a node not up and running this attempt: silent at its latest contact, gone, pending,
  behind, or with a worker that is not running;
- a checkpoint persist in flight;
- a timer near: a log rule's, a heartbeat's or progress's (:mod:`trainguard.control.detect`),
  or ``activeDeadlineSeconds``, that could fire within a quiet interval and a poll.

A timer is counted from the reports as last seen, which are up to one quiet interval
old: it looks nearer than it is, so the pace turns fast sooner, never later. From then
on the timers are judged on reports at most ``poll_interval`` old, as with no quiet
polls at all. A straggler is found from the ranks' own step times however seldom they
are read (:mod:`trainguard.control.stragglers`), later by up to a quiet interval.

Pure: the caller passes the time and the reports.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainguard.control.actions import AttemptPhase
from trainguard.control.attempt import Attempt, Training
from trainguard.control.config import ControlConfig
from trainguard.control.reports import NodeReport
from trainguard.wire.status import NodeState, NodeStatus, WorkerState

__all__ = ["poll_pace"]


def poll_pace(
    config: ControlConfig,
    attempt: Attempt | None,
    now: float,
    reports: Mapping[str, NodeReport],
    *,
    busy: bool,
    deadline: float | None = None,
) -> float:
    """Seconds until the next poll is wanted (see the module docstring); ``busy``: the
    job is doing something besides training (stopping, a persist in flight);
    ``deadline``: when the job runs out of time, if it does."""
    fast = config.poll_interval
    quiet = config.quiet_poll_interval
    if quiet is None or busy or attempt is None:
        return fast
    if attempt.phase is not AttemptPhase.RUNNING or not isinstance(attempt.activity, Training):
        return fast
    current: list[tuple[str, NodeStatus]] = []
    for a in attempt.assignments:
        report = reports.get(a.node_id)
        if report is None or report.gone is not None or report.failed_contacts:
            return fast
        status = report.about(attempt.number)
        if status is None or status.state is not NodeState.RUNNING:
            return fast
        if any(w.state is not WorkerState.RUNNING for w in status.workers):
            return fast
        current.append((a.node_id, status))
    near = now + quiet + fast
    for due in (attempt.watch.due(current), deadline):
        if due is not None and due <= near:
            return fast
    return quiet
