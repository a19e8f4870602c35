"""Where people look at a TrainingJob: its ``status``, its Events and the operator's metrics.

:class:`ClusterRecord` is the Kubernetes platform's ``record``: after every turn of the loop
it turns the controller's new events into Kubernetes Events and metrics, and patches the
job's status when it changed. A ``NodeHealth`` event that says a node is unhealthy also
labels and taints the Kubernetes Node its pod ran on
(:class:`~trainguard.kube.node_health.NodeHealthLabels`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from trainguard.control.controller import JobController
from trainguard.control.events import Event, EventKind, FaultType
from trainguard.control.policy import RestartScope
from trainguard.control.reports import NodeReport
from trainguard.kube.adopt import takeover_record
from trainguard.kube.api import KubeApi, KubeError, NotFound
from trainguard.kube.config import Obj
from trainguard.kube.node import PodNode
from trainguard.kube.node_health import NodeHealthLabels
from trainguard.kube.status import (
    Conditions,
    FaultyPods,
    PodInfo,
    ScalingStatus,
    job_status,
    k8s_event,
)
from trainguard.observe.job import JobObserver

__all__ = ["COMPONENT", "ClusterRecord"]

logger = logging.getLogger(__name__)

COMPONENT = "trainguard-operator"
NODE_HEALTH_EVENTS = frozenset(
    {EventKind.NODE_HEALTH, EventKind.HEALTH_CHECK, EventKind.HEALTH_FINDING}
)


class ClusterRecord:
    """One TrainingJob's status, Events and metrics (see the module docstring)."""

    def __init__(
        self,
        api: KubeApi,
        body: Obj,
        observer: JobObserver,
        node_health: NodeHealthLabels | None = None,
    ) -> None:
        meta = body.get("metadata") or {}
        self.api = api
        self.body = body
        self.observer = observer  # the job's metrics (label job="<namespace>/<name>")
        self.node_health = node_health  # None: Nodes are not labelled
        self.name = str(meta.get("name"))
        self.namespace = str(meta.get("namespace") or "default")
        self.source = f"{self.namespace}/{self.name}"
        self.conditions = Conditions()
        self.faulty = FaultyPods()
        self.scaling = ScalingStatus()  # elastic jobs' elasticScalingStatus
        self._last_status: Obj | None = None

    def record(
        self,
        controller: JobController,
        pods: Sequence[PodInfo],
        seen: Mapping[str, PodNode],
        now: float,
        reports: Mapping[str, NodeReport] | None = None,
    ) -> None:
        """Record the controller's new events, then its state; ``seen``: each node's pod
        when the events were decided (a fault names the pod it happened in, even when
        the node has a new pod by now)."""
        events = controller.drain_events()
        for event in events:
            self._event(event, seen)
        self.observer.turn(now, controller, events, reports)
        status = job_status(controller, self.conditions, pods, self.faulty, now, self.scaling)
        status["takeover"] = takeover_record(controller)  # for an operator taking over
        if status == self._last_status:
            return
        try:
            self.api.patch_job_status(self.namespace, self.name, status)
            self._last_status = status
        except NotFound:
            pass  # deleted: the operator stops this job
        except KubeError as exc:
            logger.warning("%s: cannot update status: %s", self.source, exc)

    def _event(self, event: Event, seen: Mapping[str, PodNode]) -> None:
        logger.info("%s: %s: %s", self.source, event.kind, event.message)
        if event.kind == EventKind.FAULT:
            self._note_fault(event, seen.get(event.node) if event.node else None)
        elif event.kind == EventKind.ELASTIC_SCALING:
            self.scaling.note(event)
        elif event.kind == EventKind.RESTART_SCHEDULED:
            scope = str(event.data.get("scope", ""))
            self.faulty.restart_type = RestartScope(scope).hyperpod if scope else None
        if event.kind in NODE_HEALTH_EVENTS and self.node_health is not None:
            self.node_health.record(event, seen.get(event.node) if event.node else None)
        try:
            self.api.create_event(self.namespace, k8s_event(self.body, event, COMPONENT))
        except KubeError as exc:
            logger.warning("%s: cannot record event %s: %s", self.source, event.kind, exc)

    def _note_fault(self, event: Event, node: PodNode | None) -> None:
        self.faulty.note_fault(event, node.pod_name if node else None, node.host if node else None)
        kind = str(event.data.get("type", "Fault"))
        if node is None or kind != FaultType.NODE_LOST.value:
            return
        ended = node.ended()
        if ended is not None and ended[1] is not None:
            self.observer.detected(event.time - ended[1])
