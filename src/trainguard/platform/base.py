"""What a platform is to the control loop: node lifecycle, transport, and a record.

:func:`trainguard.platform.drive.drive` runs any :class:`Platform`: the local one
(agent processes on this machine, :mod:`trainguard.platform.local_platform`) and
Kubernetes (one pod per node, :mod:`trainguard.kube.kube_platform`). A platform decides
nothing: it brings nodes up and down, delivers requests, reports what it sees, and
records the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from trainguard.control.actions import JobPhase, LaunchNodes
from trainguard.control.reports import NodeReport, Refusal
from trainguard.platform.transport import Delivery

if TYPE_CHECKING:
    from trainguard.control.controller import JobController

__all__ = ["Cancel", "Observation", "Platform", "Replace"]


@dataclass(frozen=True)
class Cancel:
    """Someone outside asked the job to stop (Ctrl-C, a delete)."""

    reason: str
    phase: JobPhase = JobPhase.STOPPED


@dataclass(frozen=True)
class Replace:
    """Someone outside asked for a node to be replaced (``trainguard node replace``, a
    node labelled ``UnschedulablePendingReplacement`` by hand)."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class Observation:
    """What the platform sees at one instant."""

    reports: Mapping[str, NodeReport]
    cancel: Cancel | None = None
    refusals: Sequence[Refusal] = field(default_factory=tuple)
    replace: Sequence[Replace] = field(default_factory=tuple)
    # Elastic training: the nodes the job may use now (None: unknown), and the nodes
    # being taken away (preempted) that it should give up.
    capacity: int | None = None
    preempted: Sequence[str] = field(default_factory=tuple)
    # How those nodes are being taken away, in the job's events ("preempted"; across
    # hosts, "cut off": their host went silent).
    taken_as: str = "preempted"


class Platform(Protocol):
    """Node lifecycle and transport for one job; every call returns promptly."""

    def launch(self, request: LaunchNodes) -> None:
        """Bring up a fresh agent per node (replacing any live one), for the request's
        attempt, off its hosts to avoid where the platform places nodes; they report in
        later."""

    def retire(self, node_ids: Sequence[str]) -> None:
        """These nodes leave the job: shut their agents down."""

    def send(self, deliveries: Sequence[Delivery]) -> list[Refusal]:
        """Deliver requests to agents, concurrently; returns the ones refused."""

    def wait(self, timeout: float) -> None:
        """Sleep until news arrives (a push, a finished poll) or ``timeout`` seconds pass."""

    def pace(self, interval: float) -> None:
        """Poll every agent every ``interval`` seconds from now on (the controller's pace;
        a shorter one than before takes effect at once)."""

    def observe(self, now: float) -> Observation:
        """Every node's report now, and any request to stop the job."""

    def announce(self, controller: JobController) -> None:
        """Tell the turn's decisions (the controller's new events) before they are carried
        out, so that a slow request (a /stop to a cut-off host) never holds them up."""

    def record(self, controller: JobController, observation: Observation | None) -> None:
        """Keep the job's state, events and progress where people look (after each step)."""
