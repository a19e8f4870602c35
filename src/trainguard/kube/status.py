"""What the operator records on a TrainingJob: its ``status`` and Kubernetes Events.

Pure functions of the controller's state (HyperPod's status shape: ``conditions``,
``restartCount``, ``restartStatus``, ``latestFaultyPodInstanceList``, and for elastic
jobs ``elasticScalingStatus``) plus the pods the operator made; :class:`Conditions`
keeps transition times stable.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.control.actions import AttemptPhase
from trainguard.control.controller import JobController
from trainguard.control.events import Event, EventKind
from trainguard.kube.config import GROUP, KIND, VERSION, Obj

# Timeline entries kept in the status (the oldest are dropped; Events keep the rest).
MAX_STATUS_FAULTS = 20
MAX_EVENT_MESSAGE = 1024
WARNING_EVENTS = frozenset(
    {EventKind.FAULT, EventKind.JOB_FAILED, EventKind.POD_LOST, EventKind.HEALTH_FINDING}
    | {
        EventKind.CHECKPOINT_PERSIST_FAILED,
        EventKind.CHECKPOINT_NOT_DURABLE,
    }  # a step not durable: docs/checkpoints.md
)
CONDITION_TYPES = ("Created", "PodsRunning", "Running", "Restarting", "Succeeded", "Failed")


def rfc3339(t: float, micro: bool = False) -> str:
    """``t`` as Kubernetes writes a Time (seconds), or a MicroTime with ``micro``."""
    form = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime(form)


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Conditions:
    """The ``conditions`` list; a transition time changes only when a status flips."""

    items: dict[str, Obj] = field(default_factory=dict)

    def set(self, kind: str, true: bool, now: float, reason: str = "", message: str = "") -> None:
        status = "True" if true else "False"
        old = self.items.get(kind)
        if old is None and not true:
            return  # a condition appears once it first holds
        changed = old is None or old["status"] != status
        self.items[kind] = {
            "type": kind,
            "status": status,
            "reason": reason or (old or {}).get("reason", kind),
            "message": message,
            "lastTransitionTime": rfc3339(now) if changed else old["lastTransitionTime"],  # type: ignore[index]
        }

    def to_json(self) -> list[Obj]:
        return [self.items[k] for k in CONDITION_TYPES if k in self.items]


@dataclass(frozen=True)
class PodInfo:
    """One node's pod, as the status shows it."""

    node_id: str
    pod: str
    pod_ip: str | None
    host: str | None
    state: str


@dataclass
class FaultyPods:
    """HyperPod's ``latestFaultyPodInstanceList``: the faults of the last attempt that had
    any (every fault of it, not only the first):

    - ``restartType``: what followed, ``PLR`` (processes restarted in the same pods, in
      place or all of them) or ``JLR`` (new pods); null (so absent: the status is a
      merge patch) while nothing has, or when the job ended instead (:attr:`RestartScope.hyperpod
      <trainguard.control.policy.RestartScope.hyperpod>`);
    - ``faultyPodList``: the pods the faults happened in;
    - ``faultyInstanceIdList``: the Kubernetes Nodes (``spec.nodeName``) those pods ran on.
      HyperPod writes its instances' ids there; trainguard knows a pod's Node, not the
      machine behind it;
    - ``faultyRankList``: the faulty ranks, in order.
    """

    attempt: int = -1
    restart_type: str | None = None
    pods: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def note_fault(self, event: Event, pod: str | None, host: str | None = None) -> None:
        """Take in a ``Fault`` event, ``pod`` and ``host`` its job node's pod and Node."""
        if event.attempt != self.attempt:
            self.attempt = event.attempt if event.attempt is not None else -1
            self.pods, self.instances, self.ranks, self.restart_type = [], [], [], None
        if pod is not None and pod not in self.pods:
            self.pods.append(pod)
        if host is not None and host not in self.instances:
            self.instances.append(host)
        if event.rank is not None and event.rank not in self.ranks:
            self.ranks.append(event.rank)

    def to_json(self) -> Obj:
        return {
            "restartType": self.restart_type,
            "faultyPodList": self.pods,
            "faultyInstanceIdList": self.instances,
            "faultyRankList": sorted(self.ranks),
        }


class ScalingStatus:
    """HyperPod's ``status.elasticScalingStatus`` of an elastic job:

    - ``targetReplicas``: the nodes the job runs on, or is scaling to while a scaling
      stops its ranks;
    - ``lastScalingTime``: when the last scaling was decided (an ``ElasticScaling``
      event; null before the first);
    - ``lastRestartTime``: when the job last restarted, for a fault or a scaling (its
      current attempt began; null before the first restart): no scale-up comes within
      ``scaleUpSnoozeTimeInSeconds`` of it;
    - ``podsScaled``: how many pods the last scaling removed or added;
    - ``isFaultyPodScaleDown``: the last scaling was a scale-down away from faulty pods
      (the controller's event says ``faulty``), not a preemption or a capacity change;
    - ``consecutiveScalingFailures``: scale-ups in a row whose new pods did not come up
      (each doubles the wait before the next: anti-thrashing);
    - ``lastUpdated``: when any of the above last changed.
    """

    def __init__(self) -> None:
        self.pods_scaled = 0
        self.faulty = False
        self._fields: Obj | None = None
        self._updated: float | None = None

    def note(self, event: Event) -> None:
        """Take in one of the controller's events (only ``ElasticScaling`` counts)."""
        if event.kind != EventKind.ELASTIC_SCALING:
            return
        data = event.data
        self.pods_scaled = len(data.get("dropped") or ()) + len(data.get("added") or ())
        self.faulty = bool(data.get("faulty", False))

    def to_json(self, controller: JobController, now: float) -> Obj | None:
        """The status object now (None: not an elastic job)."""
        watch = controller.elastic
        if watch is None:
            return None
        attempt = controller.current
        target = len(controller.nodes)
        scale = attempt.scale if attempt is not None else None
        if scale is not None and attempt is not None and attempt.phase is AttemptPhase.STOPPING:
            target = scale.size  # its ranks are stopping for the scaling
        restarted = attempt.started_at if attempt is not None and attempt.number > 0 else None
        fields: Obj = {
            "targetReplicas": target,
            "lastScalingTime": rfc3339(watch.last_scaling) if watch.last_scaling else None,
            "lastRestartTime": rfc3339(restarted) if restarted is not None else None,
            "podsScaled": self.pods_scaled,
            "isFaultyPodScaleDown": self.faulty,
            "consecutiveScalingFailures": watch.failures,
        }
        if fields != self._fields or self._updated is None:
            self._fields, self._updated = fields, now
        return {**fields, "lastUpdated": rfc3339(self._updated)}


def job_status(
    controller: JobController,
    conditions: Conditions,
    pods: Sequence[PodInfo],
    faulty: FaultyPods,
    now: float,
    scaling: ScalingStatus | None = None,
) -> Obj:
    """The TrainingJob ``status`` for the controller's current state (``scaling``: an
    elastic job's ``elasticScalingStatus``)."""
    phase = controller.phase.value
    attempt = controller.current
    ranks = {a.node_id: a for a in attempt.assignments} if attempt else {}
    running = bool(pods) and all(p.state in ("running", "completed") for p in pods)
    conditions.set("Created", True, now, "Created", "pods and service created")
    conditions.set("PodsRunning", running, now, "PodsRunning", f"{len(pods)} pods")
    conditions.set("Running", phase == "Running", now, "Running", controller.reason or "")
    conditions.set("Restarting", phase == "Restarting", now, "Restarting", "")
    conditions.set("Succeeded", phase == "Succeeded", now, "Succeeded", controller.reason or "")
    conditions.set("Failed", phase in ("Failed", "Stopped"), now, phase, controller.reason or "")
    status: Obj = {
        "phase": phase,
        "reason": controller.reason or "",
        "attempt": attempt.number if attempt else None,
        "restartCount": controller.restarts,
        "restartStatus": {
            "restartCount": controller.restarts - controller.full_restarts,
            "fullJobRestartCount": controller.full_restarts,
        },
        "conditions": conditions.to_json(),
        "nodes": [
            {
                "nodeId": p.node_id,
                "pod": p.pod,
                "podIP": p.pod_ip,
                "hostNode": p.host,
                "state": p.state,
                "nodeRank": ranks[p.node_id].node_rank if p.node_id in ranks else None,
                "ranks": ranks[p.node_id].global_ranks if p.node_id in ranks else [],
            }
            for p in pods
        ],
        "faults": controller.timeline.to_json()[-MAX_STATUS_FAULTS:],
    }
    if controller.started_at is not None:
        status["startTime"] = rfc3339(controller.started_at)
    if controller.phase.terminal:
        status["completionTime"] = rfc3339(controller.finished_at or now)
    if faulty.attempt >= 0:
        status["latestFaultyPodInstanceList"] = faulty.to_json()
    elastic = scaling.to_json(controller, now) if scaling is not None else None
    if elastic is not None:
        status["elasticScalingStatus"] = elastic
    return status


def _warning(event: Event) -> bool:
    """A Warning Event: a fault, a failure, a failed health check, an unhealthy node, a
    checkpoint step that did not reach the durable tier."""
    if event.kind == EventKind.NODE_HEALTH:
        return event.data.get("status") not in (None, "Schedulable")
    if event.kind == EventKind.HEALTH_CHECK:
        return event.data.get("outcome") == "failed"
    return event.kind in WARNING_EVENTS


def k8s_event(job: Mapping[str, Any], event: Event, component: str) -> Obj:
    """A core/v1 Event about the TrainingJob ``job`` (its metadata) for one timeline event."""
    meta = job.get("metadata") or {}
    stamp = rfc3339(event.time)
    where = " ".join(
        part
        for part in (
            f"attempt {event.attempt}" if event.attempt is not None else "",
            event.node or "",
            f"rank {event.rank}" if event.rank is not None else "",
        )
        if part
    )
    message = f"[{where}] {event.message}" if where else event.message
    involved: Obj = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
    }
    if meta.get("uid"):
        involved["uid"] = meta["uid"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta.get('name')}.{secrets.token_hex(8)}",
            "namespace": meta.get("namespace"),
        },
        "involvedObject": involved,
        "reason": event.kind,
        "message": message[:MAX_EVENT_MESSAGE],
        "type": "Warning" if _warning(event) else "Normal",
        "source": {"component": component},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
