"""The control loop: observe, decide, act, for any platform.

    drive(controller, platform)

1. **observe**: the platform's reports (the newest status each agent polled or pushed,
   contact facts) and any outside request to stop;
2. **decide**: :meth:`JobController.observe` (pure) returns actions;
3. **act**: the decisions' events are told first (:meth:`Platform.announce`), then nodes
   are launched and retired through the platform, and every request is sent to every
   node it names at once (:class:`~trainguard.platform.transport.Delivery`); refusals go
   back to the controller on the next turn.

The loop sleeps in :meth:`Platform.wait` between turns: until an agent pushes news, so a
worker's death is decided on within milliseconds of its report, or a poll's answers
come, or the controller's pace runs out (:meth:`JobController.pace`: ``poll_interval``,
or longer while the job trains steadily; the platform polls at that pace). It ends when
the controller's phase is terminal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from trainguard.control.actions import (
    Action,
    Finish,
    LaunchNodes,
    RejoinNodes,
    ReplaceRanks,
    RetireNodes,
    StartNodes,
    StopMode,
    StopNodes,
)
from trainguard.control.controller import JobController
from trainguard.control.persist import PersistCheckpoint
from trainguard.control.reports import Refusal, RequestKind
from trainguard.platform.base import Observation, Platform
from trainguard.platform.transport import Delivery
from trainguard.wire.requests import PersistRequest, ReplaceRequest, StopRequest

__all__ = ["TurnHook", "deliveries", "drive", "execute"]

TurnHook = Callable[[JobController, Observation], None]
"""Called at the end of each turn with what was observed (fault injection): what it
adds to the controller (its notes) is told and recorded with the turn."""


def drive(
    controller: JobController,
    platform: Platform,
    clock: Callable[[], float] = time.time,
    begin: Callable[[float], Sequence[Action]] | None = None,
    hooks: Sequence[TurnHook] = (),
) -> None:
    """Run the job until the controller says it ended (see the module docstring);
    ``begin``: the first actions, instead of ``controller.start`` (a resumed job);
    ``hooks``: called at the end of each turn, before the record (``--inject``)."""
    first = (begin or controller.start)(clock())
    platform.announce(controller)
    refusals = execute(platform, first)
    platform.record(controller, None)
    pace = controller.config.poll_interval
    while not controller.phase.terminal:
        if not refusals:
            platform.wait(pace)
        seen = platform.observe(clock())
        now = clock()  # after observing: a decision is never stamped before its evidence
        actions: list[Action] = []
        if seen.cancel is not None:
            actions += controller.cancel(now, seen.cancel.reason, seen.cancel.phase)
        if seen.replace:
            controller.replace_nodes(now, [(r.node_id, r.reason) for r in seen.replace])
        controller.set_capacity(seen.capacity, seen.preempted, seen.taken_as)
        actions += controller.observe(now, seen.reports, [*seen.refusals, *refusals])
        platform.announce(controller)  # what was decided is said before it is done
        refusals = execute(platform, actions)
        for hook in hooks:
            hook(controller, seen)
        platform.record(controller, seen)
        pace = controller.pace(clock(), seen.reports)
        platform.pace(pace)


def execute(platform: Platform, actions: Sequence[Action]) -> list[Refusal]:
    """Carry the actions out in order; returns the requests agents refused."""
    refusals: list[Refusal] = []
    for action in actions:
        if isinstance(action, LaunchNodes):
            platform.launch(action)
        elif isinstance(action, RetireNodes):
            platform.retire(action.node_ids)
        elif not isinstance(action, Finish):
            refusals += platform.send(deliveries(action))
    return refusals


def deliveries(
    action: StartNodes | RejoinNodes | ReplaceRanks | StopNodes | PersistCheckpoint,
) -> list[Delivery]:
    """The requests an action means, one per node."""
    if isinstance(action, StartNodes | RejoinNodes):
        kind: RequestKind = "start" if isinstance(action, StartNodes) else "rejoin"
        return [Delivery(a.node_id, kind, action.attempt, a) for a in action.assignments]
    if isinstance(action, ReplaceRanks):
        replace = ReplaceRequest(attempt=action.attempt, ranks=action.ranks)
        return [Delivery(action.node_id, "replace", action.attempt, replace)]
    if isinstance(action, StopNodes):
        stop = StopRequest(
            attempt=action.attempt,
            mode="process" if action.mode == StopMode.PROCESS else "graceful",
            timeout=action.timeout,
            capture_stacks=action.capture_stacks,
            notice=action.notice,
        )
        return [Delivery(n, "stop", action.attempt, stop) for n in action.node_ids]
    return [
        Delivery(
            n,
            "persist",
            None,
            PersistRequest(
                step=action.step, world_size=action.world_size, commit=n == action.commit_node
            ),
        )
        for n in action.node_ids
    ]
