"""One attempt of a job, as the controller tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.control.actions import AttemptPhase
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.detect import AttemptWatch
from trainguard.control.elastic import Scale
from trainguard.control.events import Fault
from trainguard.control.inprocess import Rejoin
from trainguard.control.policy import RestartScope
from trainguard.wire.requests import NodeAssignment

__all__ = ["Attempt"]


@dataclass
class Attempt:
    number: int
    started_at: float
    nodes: tuple[str, ...]
    watch: AttemptWatch
    scope: RestartScope = RestartScope.PROCESS
    phase: AttemptPhase = AttemptPhase.LAUNCHING
    # Set once every node is up and the attempt starts.
    endpoint: StoreEndpoint | None = None
    assignments: tuple[NodeAssignment, ...] = ()
    launch_deadline: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    faults: list[Fault] = field(default_factory=list)
    # How long the nodes get to stop, and until when (counted from the first look after
    # the stop went out).
    stop_allowance: float = 0.0
    stop_deadline: float | None = None
    recovered: bool = False
    rejoin: Rejoin | None = None
    # Elastic training: the scaling this attempt is stopping for, and the nodes a
    # scale-up attempt brings up (control/elastic.py).
    scale: Scale | None = None
    growing: tuple[str, ...] = ()
    # A scale-up (control/rescale.py): the nodes brought up while this attempt trains on
    # (ahead of the decision, or after it), when they are late, and the scale-up once
    # decided (they join when they are up, warm, and it is).
    standby: tuple[str, ...] = ()
    standby_deadline: float | None = None
    scale_due: Scale | None = None
    # Lost nodes restarting fresh, and when the job scales down without them if they are
    # not up by then (faultyScaleDownTimeoutInSeconds).
    replacing: tuple[str, ...] = ()
    faulty_deadline: float | None = None
    # Lost nodes being replaced in place (control/replace.py): lost id -> the spare
    # coming up to take its ranks (in ``standby`` until it is up).
    replacing_in_place: dict[str, str] = field(default_factory=dict)

    def take_standby(self) -> tuple[str, ...]:
        """The nodes brought up for this attempt's scale-up, off its hands now (they join
        the next attempt, or are retired): no standby, no deadline, no scale-up due."""
        nodes = self.standby
        self.standby, self.standby_deadline, self.scale_due = (), None, None
        return nodes
