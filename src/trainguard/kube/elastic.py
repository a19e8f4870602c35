"""Elastic training on Kubernetes: what the cluster tells an elastic job's controller, and
what its status shows.

The decisions are the controller's (:mod:`trainguard.control.elastic`); the platform
(:meth:`~trainguard.kube.kube_platform.KubePlatform.observe`) hands it two facts:

- **capacity** (:class:`ReplicaCount`): the TrainingJob's total ``replicas`` as the API
  server has them now (re-read at most once per poll interval), so that
  ``kubectl patch`` of a group's replica count grows or shrinks the running job. The
  count is reported as it is; the controller keeps to ``elasticPolicy``'s sizes;
- **preempted** (:class:`Preemptions`): the node ids whose current pod is being taken
  away (:func:`preemption`): a ``DisruptionTarget`` condition (the scheduler preempting
  it, the Eviction API, the kubelet under node pressure, a taint) or a pod the kubelet
  evicted (phase ``Failed``, reason ``Evicted``). A node's new pod is not preempted.

With the operator's rights on Nodes (``TRAINGUARD_NODE_LABELS``, the default), the
capacity is also at most what the Nodes hold (:class:`NodeCapacity`, the model in
:mod:`trainguard.kube.capacity`), and the nodes whose pod is on a Node going away
(cordoned, not Ready, labelled unhealthy) are preempted too; with a Kueue queue label,
at most what Kueue admitted (:mod:`trainguard.kube.kueue`).

:class:`ScalingStatus` (in :mod:`trainguard.kube.status`) keeps HyperPod's
``status.elasticScalingStatus`` for elastic jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainguard.kube.api import KubeApi, KubeError, NotFound
from trainguard.kube.capacity import Capacity, PodShape, capacity
from trainguard.kube.node import PodNode

__all__ = [
    "NodeCapacity",
    "Preemptions",
    "ReplicaCount",
    "preemption",
    "replica_count",
]

logger = logging.getLogger(__name__)

DISRUPTION_TARGET = "DisruptionTarget"


def replica_count(body: Mapping[str, Any]) -> int | None:
    """The job's nodes (the sum of ``spec.replicaSpecs[].replicas``, 1 where unset), or
    None when the spec does not say (a malformed patch)."""
    groups = (body.get("spec") or {}).get("replicaSpecs")
    if not isinstance(groups, list) or not groups:
        return None
    total = 0
    for group in groups:
        replicas = group.get("replicas", 1) if isinstance(group, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            return None
        total += replicas
    return total


def preemption(pod: Mapping[str, Any] | None) -> str | None:
    """Why the pod is being taken away (or was), or None: it was evicted (phase Failed,
    reason Evicted), or it has the condition ``DisruptionTarget`` True (reasons
    ``PreemptionByScheduler``, ``EvictionByEvictionAPI``, ``TerminationByKubelet``,
    ``DeletionByTaintManager``, ...)."""
    status = (pod or {}).get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason") == "Evicted":
        return f"Evicted: {status.get('message') or 'by the kubelet'}"
    for condition in status.get("conditions") or []:
        if condition.get("type") == DISRUPTION_TARGET and condition.get("status") == "True":
            why = condition.get("reason") or DISRUPTION_TARGET
            return f"{why}: {condition['message']}" if condition.get("message") else str(why)
    return None


class Preemptions:
    """The nodes whose current pod is being taken away; a pod once seen preempted stays
    so until the node has another pod (the preempted pod may vanish before the job
    gives the node up)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._pods: dict[str, str] = {}  # pod name -> why it is being taken away

    def observe(self, nodes: Mapping[str, PodNode]) -> tuple[str, ...]:
        """The node ids (in ``nodes``' order) whose current pod is preempted."""
        current = {node.pod_name for node in nodes.values()}
        self._pods = {pod: why for pod, why in self._pods.items() if pod in current}
        preempted: list[str] = []
        for node_id, node in nodes.items():
            if node.pod_name not in self._pods:
                why = preemption(node.pod)
                if why is None:
                    continue
                self._pods[node.pod_name] = why
                logger.info(
                    "%s: %s's pod %s is preempted (%s)", self.source, node_id, node.pod_name, why
                )
            preempted.append(node_id)
        return tuple(preempted)


class ReplicaCount:
    """The job's replica count as the API server has it, re-read at most once per
    ``interval`` seconds (the last count read stands while the API cannot be read)."""

    def __init__(
        self, api: KubeApi, namespace: str, name: str, initial: int, interval: float
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.interval = interval
        self.value = initial
        self._read_at: float | None = None

    def read(self, now: float) -> int:
        if self._read_at is not None and now - self._read_at < self.interval:
            return self.value
        self._read_at = now
        try:
            count = replica_count(self.api.get_job(self.namespace, self.name))
        except NotFound:
            return self.value  # deleted: the operator's delete handler ends the job
        except KubeError as exc:
            logger.warning(
                "%s/%s: cannot read the job's replicas: %s", self.namespace, self.name, exc
            )
            return self.value
        if count is not None and count != self.value:
            logger.info("%s/%s: replicas %d -> %d", self.namespace, self.name, self.value, count)
            self.value = count
        return self.value


class NodeCapacity:
    """The job's pods the Nodes hold (:func:`~trainguard.kube.capacity.capacity`), from
    every Node and every pod bound to one, listed at most once per ``interval`` seconds
    (None while they were never read: no rights, say; the last figure stands while the
    API cannot be read)."""

    def __init__(
        self, api: KubeApi, source: str, shape: PodShape, health_key: str, interval: float
    ) -> None:
        self.api = api
        self.source = source
        self.shape = shape
        self.health_key = health_key
        self.interval = interval
        self.value: Capacity | None = None
        self._read_at: float | None = None
        self._warned = False

    def read(self, now: float, nodes: Mapping[str, PodNode]) -> Capacity | None:
        if self._read_at is not None and now - self._read_at < self.interval:
            return self.value
        self._read_at = now
        try:
            listed, bound = self.api.all_nodes(), self.api.bound_pods()
        except KubeError as exc:
            if not self._warned:  # once: without rights this fails every poll
                logger.warning("%s: cannot read the Nodes' capacity: %s", self.source, exc)
                self._warned = True
            return self.value
        ours = {node_id: node.pod_name for node_id, node in nodes.items()}
        try:
            found = capacity(listed, bound, self.shape, ours, self.health_key)
        except ValueError as exc:  # a quantity the API server would not have taken
            logger.warning("%s: cannot read the Nodes' capacity: %s", self.source, exc)
            return self.value
        before = self.value
        if before is None or (found.pods, found.why) != (before.pods, before.why):
            leaving = "; ".join(f"{n}: {why}" for n, why in found.why.items())
            logger.info(
                "%s: the Nodes hold %d of the job's pods%s",
                self.source,
                found.pods,
                f" (leaving: {leaving})" if leaving else "",
            )
        self.value = found
        return found
