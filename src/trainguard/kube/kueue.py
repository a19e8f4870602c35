"""Kueue's admission and preemption as an elastic job's capacity on Kubernetes.

A TrainingJob labelled ``kueue.x-k8s.io/queue-name: <LocalQueue>`` on a cluster that
serves Kueue's ``kueue.x-k8s.io/v1beta1`` Workloads is queued as Kueue's own job
integrations queue theirs: the operator creates one Workload for it (owned by the job;
a PodSet per replica group, its count the group's replicas, its template the group's
pod template, the job's ``priorityClassName`` if its first template names one), and:

- **admission**: the job's pods are created only once Kueue admitted the Workload
  (condition ``Admitted`` True, ``status.admission`` set); the pods admitted (the
  PodSet assignments' ``count``, the PodSet's where an assignment has none) cap the
  elastic job's capacity, with the Nodes' and its replica count;
- **preemption**: a Workload Kueue evicts (condition ``Evicted`` True: ``Preempted``,
  ``InactiveWorkload``, ``PodsReadyTimeout``, ...), or whose admission is taken away,
  stops the job gracefully (every rank at once, as a delete does: it ends ``Stopped``,
  with Kueue's reason), and the Workload is deleted when the job ends, which releases
  its quota.

Without Kueue's CRD (the Workload cannot be created: 404) the label is ignored, with a
warning. Pure reading of a Workload (:func:`admission`, :func:`workload`) and the one
job's API side (:class:`KueueWorkload`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from trainguard.kube.api import KubeApi, KubeError, NotFound
from trainguard.kube.config import GROUP, VERSION, Obj

__all__ = [
    "KUEUE_GROUP",
    "KUEUE_VERSION",
    "QUEUE_LABEL",
    "WORKLOADS",
    "Admission",
    "KueueWorkload",
    "admission",
    "queue_name",
    "workload",
    "workload_name",
]

logger = logging.getLogger(__name__)

KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta1"
WORKLOADS: Final = "workloads"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
MAX_NAME: Final = 253


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The LocalQueue the TrainingJob asks for (its ``kueue.x-k8s.io/queue-name`` label)."""
    value = ((body.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL)
    return str(value) if value else None


def workload_name(job_name: str) -> str:
    return f"trainingjob-{job_name}"[:MAX_NAME]


def workload(body: Mapping[str, Any], queue: str) -> Obj:
    """The Workload that queues the TrainingJob ``body`` in LocalQueue ``queue``."""
    meta = body.get("metadata") or {}
    groups = (body.get("spec") or {}).get("replicaSpecs") or []
    pod_sets = []
    for group in groups:
        template = group.get("template") or {}
        kept = {k: v for k, v in (template.get("metadata") or {}).items()
                if k in ("labels", "annotations")}  # fmt: skip
        pod_sets.append(
            {
                "name": str(group.get("name") or "main")[:63],
                "count": int(group.get("replicas", 1)),
                "template": {"metadata": kept, "spec": template.get("spec") or {}},
            }
        )
    spec: Obj = {"queueName": queue, "podSets": pod_sets}
    first = ((groups[0].get("template") or {}).get("spec") or {}) if groups else {}
    if first.get("priorityClassName"):
        spec["priorityClassName"] = first["priorityClassName"]
        spec["priorityClassSource"] = "scheduling.k8s.io/priorityclass"
        if first.get("priority") is not None:
            spec["priority"] = first["priority"]
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(str(meta.get("name"))),
            "namespace": meta.get("namespace") or "default",
            "labels": {QUEUE_LABEL: queue},
            "ownerReferences": [owner] if meta.get("uid") else [],
        },
        "spec": spec,
    }


@dataclass(frozen=True)
class Admission:
    """What Kueue says of the Workload now: the pods it admitted (0: none), or why it
    evicted it."""

    pods: int
    evicted: str | None = None

    @property
    def admitted(self) -> bool:
        return self.pods > 0 and self.evicted is None


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return dict(condition)
    return None


def admission(obj: Mapping[str, Any]) -> Admission:
    """Read a Workload (see the module docstring)."""
    status = obj.get("status") or {}
    for kind in ("Evicted", "Preempted"):
        condition = _condition(status, kind)
        if condition is not None:
            why = condition.get("reason") or kind
            return Admission(0, f"{why}: {condition['message']}" if condition.get("message")
                             else str(why))  # fmt: skip
    admitted = status.get("admission")
    if _condition(status, "Admitted") is None or not isinstance(admitted, dict):
        return Admission(0)
    counts = {str(p.get("name") or "main"): int(p.get("count", 1))
              for p in (obj.get("spec") or {}).get("podSets") or []}  # fmt: skip
    pods = 0
    for assigned in admitted.get("podSetAssignments") or []:
        count = assigned.get("count")
        pods += int(count) if count is not None else counts.get(str(assigned.get("name")), 0)
    return Admission(pods)


class KueueWorkload:
    """One TrainingJob's Workload: created, read at most once per ``interval``, deleted."""

    def __init__(self, api: KubeApi, body: Mapping[str, Any], queue: str, interval: float) -> None:
        self.api = api
        self.body = workload(body, queue)
        self.namespace = str(self.body["metadata"]["namespace"])
        self.name = str(self.body["metadata"]["name"])
        self.source = f"{self.namespace}/{(body.get('metadata') or {}).get('name')}"
        self.interval = interval
        self.state = Admission(0)
        self.was_admitted = False
        self._read_at: float | None = None

    @classmethod
    def create(cls, api: KubeApi, body: Mapping[str, Any], interval: float) -> KueueWorkload | None:
        """The job's Workload, created unless it exists; None: the job names no queue, or
        Kueue is not installed (a warning)."""
        queue = queue_name(body)
        if queue is None:
            return None
        made = cls(api, body, queue, interval)
        try:
            api.create_object(KUEUE_GROUP, KUEUE_VERSION, made.namespace, WORKLOADS, made.body)
            logger.info("%s: queued in Kueue's LocalQueue %s as Workload %s",
                        made.source, queue, made.name)  # fmt: skip
        except NotFound:
            logger.warning("%s: labelled %s=%s but Kueue's Workloads are not served here: "
                           "the label is ignored", made.source, QUEUE_LABEL, queue)  # fmt: skip
            return None
        except KubeError as exc:
            if exc.status != 409:
                raise
        return made

    def read(self, now: float) -> Admission:
        """Kueue's word now (the last one read stands while the API cannot be read)."""
        if self._read_at is not None and now - self._read_at < self.interval:
            return self.state
        self._read_at = now
        try:
            obj = self.api.get_object(
                KUEUE_GROUP, KUEUE_VERSION, self.namespace, WORKLOADS, self.name
            )
        except NotFound:
            if not self.was_admitted:  # deleted while queued: queue it again
                self._recreate()
            state = Admission(0, "the Workload was deleted") if self.was_admitted else Admission(0)
        except KubeError as exc:
            logger.warning("%s: cannot read Workload %s: %s", self.source, self.name, exc)
            return self.state
        else:
            state = admission(obj)
        if state.evicted is None and self.was_admitted and not state.admitted:
            state = Admission(0, "Kueue took its admission back")
        if state != self.state:
            logger.info("%s: Workload %s: %s", self.source, self.name, _say(state))
        self.state = state
        self.was_admitted = self.was_admitted or state.admitted
        return state

    def _recreate(self) -> None:
        try:
            self.api.create_object(KUEUE_GROUP, KUEUE_VERSION, self.namespace, WORKLOADS, self.body)
            logger.info("%s: Workload %s was deleted while queued: queued again",
                        self.source, self.name)  # fmt: skip
        except KubeError as exc:
            logger.warning("%s: cannot create Workload %s: %s", self.source, self.name, exc)

    def delete(self) -> None:
        """Release the quota: the job ended."""
        try:
            self.api.delete_object(KUEUE_GROUP, KUEUE_VERSION, self.namespace, WORKLOADS, self.name)
        except NotFound:
            pass
        except KubeError as exc:
            logger.warning("%s: cannot delete Workload %s: %s", self.source, self.name, exc)


def _say(state: Admission) -> str:
    if state.evicted is not None:
        return f"evicted ({state.evicted})"
    return f"admitted {state.pods} pods" if state.admitted else "waiting for admission"
