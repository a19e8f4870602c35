"""An attempt's own turns: its launch ends in its start, its faults in a stop (or a
restart in place), its stop in its end and what follows.

Planners (control/decision.py) over the :class:`JobView` of an attempt LAUNCHING,
RUNNING with faults, or STOPPING; the controller applies the :class:`Decision` each
returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainguard.control import recovery, rescale
from trainguard.control import replace as in_place
from trainguard.control.actions import AttemptPhase, StopMode
from trainguard.control.attempt import Launching, ReplacingInPlace, Training
from trainguard.control.contact import launch_verdict, settled
from trainguard.control.decision import Decision, JobView, Stop, chain
from trainguard.control.detect import finished, stop_faults
from trainguard.control.events import Fault, FaultType
from trainguard.control.health import HealthBook

__all__ = ["faulted", "launching", "stopping"]


def launching(view: JobView, health_faults: Sequence[Fault] = ()) -> Decision:
    """Start the attempt once every node's agent answers, idle, its on-start health
    checks passed; fault the nodes lost on the way, failing a check, or still not ready
    at the launch deadline (a scale-up's new nodes lost: go on without them; lost nodes
    restarting fresh, late: scale down without them)."""
    attempt, cfg, now, reports = view.attempt, view.config, view.now, view.reports
    deadline = attempt.launch_deadline
    late = deadline is not None and now >= deadline
    lost, waiting = launch_verdict(attempt.nodes, reports, cfg.contact_rule, late,
                                   cfg.node_start_timeout, now, cfg.host_wait)  # fmt: skip
    launch = view.activity if isinstance(view.activity, Launching) else Launching()
    if view.elastic and launch.deadline is not None and now >= launch.deadline:
        pending = {n for n, _ in lost} | set(waiting)
        relaunching = [n for n in launch.relaunching if n in pending]
        # Only they hold the attempt up past the deadline: go on without them.
        if relaunching and len(relaunching) == len(pending):
            scaled = recovery.faulty_scale_down(view, relaunching)
            if scaled is not None:
                return scaled
    if lost and launch.growing and {n for n, _ in lost} <= set(launch.growing):
        return recovery.scale_up_failed(view, [n for n, _ in lost])
    if lost or health_faults:
        faults = (*health_faults, *(Fault(FaultType.NODE_LOST, now, attempt.number, n, message=m)
                                    for n, m in lost))  # fmt: skip
        why = (*attempt.faults, *faults)[0].message
        return _after_end(view, Decision(faults=faults, end=(AttemptPhase.FAILED, why)))
    if waiting or any(HealthBook.checking(reports.get(n)) for n in attempt.nodes):
        return Decision()
    elastic = view.elastic.outcome(True) if launch.growing and view.elastic else None
    return Decision(activity=Training(), elastic=elastic, start=True)


def faulted(view: JobView, faults: Sequence[Fault]) -> Decision | None:
    """The faults found in a running attempt: a scale-down where they are preempted nodes
    lost, spares brought up to replace lost nodes in place; else, recorded, an in-process
    restart where it can be, or every rank stopped. While spares come up to replace lost
    nodes: their watch, or given up on another fault (None: no fault, nothing under way)."""
    if isinstance(view.activity, ReplacingInPlace):
        # The nodes being replaced are lost: their silence is no news.
        faults = [f for f in faults if f.node not in view.activity.swap]
        if not faults:
            return in_place.watch(view)
        given_up = in_place.give_up(view)
        then = faulted(view.after(given_up), faults)
        assert then is not None  # there are faults
        return chain(given_up, then)
    planned = rescale.preempted_lost(view, faults) or in_place.begin(view, faults)
    if planned is not None or not faults:
        return planned
    first = chain(Decision(faults=tuple(faults)), rescale.abandon_growth(view, faults[0].message))
    restart = recovery.restart_in_place(view.after(first))
    if restart is not None:
        return chain(first, restart)
    capture = any(f.type.is_hang for f in faults)
    mode = StopMode.GRACEFUL if view.config.graceful_fault_stops else StopMode.PROCESS
    return chain(first, Decision(stop=Stop(mode, faults[0].message, capture)))


def stopping(view: JobView, health_faults: Sequence[Fault] = ()) -> Decision:
    """Wait for every node to stop (until the stop deadline, counted from the first look
    after the stop went out), then end the attempt: the job completes where the ranks'
    work was done; else the attempt fails (its faults, the nodes that did not stop or
    were lost meanwhile) or is stopped; then the job's end on a cancel, the restart at a
    new size of a scaling, or what follows a failure (control/recovery.py)."""
    attempt, now = view.attempt, view.now
    deadline = attempt.stop_deadline
    if deadline is None:  # every node has been asked by now: its time to stop counts from here
        deadline = now + attempt.stop_allowance
    first = Decision(faults=tuple(health_faults), stop_deadline=deadline)
    scale = attempt.scale
    # The nodes a scaling drops are taken away: their loss is not a fault.
    nodes = [n for n in attempt.nodes if scale is None or n not in scale.drop]
    rule = view.config.contact_rule
    waiting = [n for n in nodes if not settled(view.reports.get(n), rule)]
    if waiting and now < deadline:
        return first
    if scale is not None and not waiting and finished(attempt.number, nodes, view.reports):
        return replace(first, complete="all ranks completed")  # before it stopped
    attempt = view.after(first).attempt
    # Every fault an ExitHang of ranks whose work was done (control/exit_hang.py).
    done = all(f.type is FaultType.EXIT_HANG and f.evidence.get("finished") for f in attempt.faults)
    if not waiting and view.cancel is None and attempt.faults and done:
        ranks = sorted(r for f in attempt.faults for r in f.evidence.get("ranks", []))
        why = f"all ranks completed (ranks {ranks} ended as ExitHang after their work)"
        return replace(first, complete=why)
    faults = stop_faults(now, attempt.number, nodes, attempt.faults, waiting, view.reports, rule)
    outcome = AttemptPhase.FAILED if attempt.faults or faults else AttemptPhase.STOPPED
    ended = replace(
        first, faults=(*first.faults, *faults), end=(outcome, attempt.reason or "stopped")
    )
    if scale is not None and outcome is AttemptPhase.STOPPED and view.cancel is None:
        return chain(ended, recovery.rescale(view.after(ended), scale))
    return _after_end(view, ended)


def _after_end(view: JobView, ended: Decision) -> Decision:
    """What follows ``ended`` (the attempt's end): the job's end on a cancel, else
    growth given up and the restart decided (``recovery.after_failure``)."""
    if view.cancel is not None:
        return chain(ended, Decision(finish=view.cancel))
    after = view.after(ended)
    why = after.attempt.faults[0].message if after.attempt.faults else "the attempt stopped"
    ended = chain(ended, rescale.abandon_growth(after, why))
    return chain(ended, recovery.after_failure(view.after(ended)))
