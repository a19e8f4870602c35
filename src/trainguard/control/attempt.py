"""One attempt of a job, as the controller tracks it, and what it is doing besides training."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from trainguard.control.actions import AttemptPhase
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.detect import AttemptWatch
from trainguard.control.elastic import Scale
from trainguard.control.events import Fault
from trainguard.control.inprocess import Rejoin
from trainguard.control.policy import RestartScope
from trainguard.wire.requests import NodeAssignment

__all__ = [
    "Activity",
    "Attempt",
    "GrowingAhead",
    "Launching",
    "Rejoining",
    "ReplacingInPlace",
    "Rescaling",
    "Training",
    "new_watch",
    "standby",
]


@dataclass(frozen=True)
class Training:
    """Nothing under way besides the attempt itself (launching, training or stopping)."""


@dataclass(frozen=True)
class Launching:
    """A launch that may go on without some nodes: ``growing``, a scale-up's new nodes
    (control/elastic.py), or ``relaunching``, lost nodes restarting fresh, dropped if
    not up by ``deadline`` (faultyScaleDownTimeoutInSeconds)."""

    growing: tuple[str, ...] = ()
    relaunching: tuple[str, ...] = ()
    deadline: float | None = None


@dataclass(frozen=True)
class Rejoining:
    rejoin: Rejoin  # an in-process restart under way (control/inprocess.py)


@dataclass(frozen=True)
class GrowingAhead:
    """A scale-up while the attempt trains (control/rescale.py): the nodes brought up
    (ahead of the decision, or after it), late past ``deadline``, and the scale-up once
    ``due`` (they join when they are up, warm, and it is)."""

    standby: tuple[str, ...] = ()
    deadline: float | None = None
    due: Scale | None = None


@dataclass(frozen=True)
class ReplacingInPlace:
    """Lost nodes replaced in place (control/replace.py): lost id -> the spare coming up
    to take its ranks, late past ``deadline``."""

    swap: Mapping[str, str]
    deadline: float

    @property
    def standby(self) -> tuple[str, ...]:
        return tuple(self.swap.values())


@dataclass(frozen=True)
class Rescaling:
    scale: Scale  # the attempt stops to restart at ``scale.size``
    standby: tuple[str, ...] = ()  # with these, up ahead


Activity = Training | Launching | Rejoining | GrowingAhead | ReplacingInPlace | Rescaling


def standby(activity: Activity) -> tuple[str, ...]:
    """The nodes brought up while the attempt trains, to join the next one."""
    if isinstance(activity, GrowingAhead | ReplacingInPlace | Rescaling):
        return activity.standby
    return ()


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
    activity: Activity = field(default_factory=Training)

    @property
    def scale(self) -> Scale | None:
        """The scaling this attempt stops for (control/elastic.py)."""
        return self.activity.scale if isinstance(self.activity, Rescaling) else None


def new_watch(cfg: ControlConfig, number: int, now: float) -> AttemptWatch:
    """A fresh fault watch for attempt ``number`` (its timers start ``now``)."""
    return AttemptWatch(
        number,
        now,
        cfg.log_rules,
        cfg.heartbeat_timeout,
        contact_rule=cfg.contact_rule,
        in_process=cfg.in_process,
        start_timeout=cfg.node_start_timeout,
        exit_hang_timeout=cfg.exit_hang_timeout,
        no_progress_timeout=cfg.no_progress_timeout,
    )
