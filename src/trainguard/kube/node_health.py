"""The operator's side of node health on Kubernetes, for one job (rules in
:mod:`trainguard.kube.node_labels`):

- **writes**: a ``NodeHealth`` event of the job's controller whose status is not
  ``Schedulable`` labels the Kubernetes Node the job node's pod ran on with that status
  (and the deep-check status, when given), with the fault behind it (``fault-type``
  and ``fault-reason``: the failed check or the finding, or a replacement asked for)
  and taints it (:meth:`NodeHealthLabels.record`).
  Unless what caused it (the ``HealthCheck`` or ``HealthFinding`` event recorded with
  it) is the pod's own rather than the Node's: a full job dir or ``/dev/shm`` (the
  pod's), memory pressure (Kubernetes taints a Node under pressure itself), a slow
  all-reduce (which end?), or a rehearsal's injected failure. Labelling the Node for
  those would move every job off Node after Node as each new pod hit the same limit; the
  job node is replaced all the same;
- **reads**: a pod of the job on a Node labelled ``UnschedulablePendingReplacement`` or
  ``UnschedulablePendingReboot`` by anyone else (by hand, the health agent's DaemonSet,
  HyperPod) becomes a :class:`~trainguard.platform.base.Replace` of its node, once per
  node and pod (:meth:`NodeHealthLabels.replacements`; the platform asks at most once per
  poll interval: one list call, for the Nodes so labelled only). The controller restarts
  the job without that node; the new pod's required node affinity keeps it off the Node.

Nodes are cluster-scoped: this needs the operator's small ClusterRole on nodes (get,
list, patch; ``kube/manifests.py``). Without it (``TRAINGUARD_NODE_LABELS=false``) the
platform makes no :class:`NodeHealthLabels` and nothing here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from trainguard.control.events import Event, EventKind, FaultType
from trainguard.kube.api import Conflict, KubeApi, KubeError
from trainguard.kube.config import HEALTH_REASON_ANNOTATION, OperatorConfig
from trainguard.kube.node import PodNode
from trainguard.kube.node_labels import (
    MOVE_OFF,
    PENDING_REPLACEMENT,
    SCHEDULABLE,
    HealthChange,
    HealthKeys,
    NodeFault,
    health_patch,
)
from trainguard.platform.base import Replace

__all__ = ["NodeHealthLabels", "write_health"]

logger = logging.getLogger(__name__)

WRITE_ATTEMPTS: Final = 3
"""Reads and writes of a Node that changed between the two, before giving up."""
NODE_CHECKS: Final = frozenset({"cpu", "memory", "gpu"})
"""On-start checks whose failure is the Node's (the others: the pod's, or either end's)."""
NODE_FINDINGS: Final = frozenset({"XID", "NVRM", "GpuCount", "Ecc"})
"""Findings that are the Node's hardware (the others: the pod's, or the workloads')."""
REQUESTED: Final = NodeFault(FaultType.NODE_UNHEALTHY.value, "ReplacementRequested")
"""The fault labels of a Node whose job node's replacement was asked for (no check or
finding caused it)."""

Cause = tuple[str, bool, NodeFault]
"""What a failed check or a finding says (its name), whether it is the Node's, its fault."""


def write_health(api: KubeApi, node_name: str, keys: HealthKeys, change: HealthChange) -> bool:
    """Make Node ``node_name`` say ``change`` (read, patch, again when it changed in
    between); whether anything was written. Raises :class:`KubeError` (``NotFound``, no
    rights, a Node that kept changing)."""
    for _ in range(WRITE_ATTEMPTS):
        patch = health_patch(api.get_node(node_name), keys, change)
        if patch is None:
            return False
        try:
            api.patch_node(node_name, patch)
            return True
        except Conflict:
            continue
    raise KubeError(f"node {node_name} changed {WRITE_ATTEMPTS} times while being labelled")


class NodeHealthLabels:
    """One job's reads and writes of Node health labels; see the module docstring."""

    def __init__(self, api: KubeApi, settings: OperatorConfig, source: str) -> None:
        self.api = api
        self.keys = HealthKeys.of(settings)
        self.source = source  # <namespace>/<job>
        self._ours: set[tuple[str, str]] = set()  # (Node, node id): labelled for that node
        self._asked: set[tuple[str, str]] = set()  # (node id, pod): replacements asked for
        self._causes: dict[str, tuple[float, list[Cause]]] = {}  # see _cause
        self._warned = False

    def record(self, event: Event, node: PodNode | None) -> None:
        """Label and taint the Node of ``node``'s pod for a ``NodeHealth`` event that
        says it is not ``Schedulable`` (and whose cause is the Node's); note the causes
        (``HealthCheck``, ``HealthFinding``); other events are not this class's."""
        if event.node is None:
            return
        if event.kind in (EventKind.HEALTH_CHECK, EventKind.HEALTH_FINDING):
            self._cause(event, event.node)
            return
        status = event.data.get("status")
        if (
            event.kind != EventKind.NODE_HEALTH
            or not isinstance(status, str)
            or status == SCHEDULABLE
        ):
            return
        time, causes = self._causes.get(event.node, (None, []))
        causes = causes if time == event.time else []
        if causes and not any(ours for _, ours, _ in causes):
            why = ", ".join(what for what, _, _ in causes)
            logger.info(
                "%s: %s is %s for the pod's own reasons (%s): its Node is not labelled",
                self.source,
                event.node,
                status,
                why,
            )
            return
        host = node.host if node is not None else None
        if host is None:
            logger.info(
                "%s: %s is %s, on no Node yet: nothing to label", self.source, event.node, status
            )
            return
        deep = event.data.get("deep")
        reason = f"{self.source} {event.node}: {event.data.get('reason') or event.message}"
        fault = next((f for _, ours, f in causes if ours), None)
        if fault is None and status == PENDING_REPLACEMENT:
            fault = REQUESTED  # asked for: no check or finding of this moment caused it
        change = HealthChange(status, deep if isinstance(deep, str) else None, reason, fault=fault)
        if status in MOVE_OFF:
            self._ours.add((host, event.node))  # no replacement asked for it: it is ours
        try:
            if write_health(self.api, host, self.keys, change):
                logger.info("%s: labelled node %s %s: %s", self.source, host, status, reason)
        except KubeError as exc:
            logger.warning("%s: cannot label node %s %s: %s", self.source, host, status, exc)

    def _cause(self, event: Event, node_id: str) -> None:
        """Note what a failed check or a finding says of its Node; the controller records
        it with the ``NodeHealth`` event it causes, at the same time."""
        evidence = event.data.get("evidence")
        injected = isinstance(evidence, dict) and evidence.get("injected") is True  # rehearsal
        if event.kind == EventKind.HEALTH_CHECK:
            if event.data.get("outcome") != "failed":
                return
            name = str(event.data.get("name"))
            fault = NodeFault(FaultType.HEALTH_CHECK_FAILED.value, name)
            cause = (f"{name} check", name in NODE_CHECKS and not injected, fault)
        else:
            kind = str(event.data.get("kind"))
            fault = NodeFault(FaultType.NODE_UNHEALTHY.value, kind)
            cause = (kind, kind in NODE_FINDINGS and not injected, fault)
        time, causes = self._causes.get(node_id, (event.time, []))
        if time != event.time:
            causes = []
        self._causes[node_id] = (event.time, [*causes, cause])

    def replacements(self, nodes: Mapping[str, PodNode]) -> list[Replace]:
        """The job's nodes whose pod is on a Node labelled to be moved off (by someone
        else), each once per pod."""
        hosts = {n.host for n in nodes.values() if n.host is not None and n.ended() is None}
        if not hosts:
            return []
        try:
            flagged = {
                str(node["metadata"]["name"]): node
                for node in self.api.list_nodes(self.keys.status, MOVE_OFF)
            }
        except KubeError as exc:
            if not self._warned:  # once: without rights this fails every poll
                logger.warning("%s: cannot read node health labels: %s", self.source, exc)
                self._warned = True
            return []
        out: list[Replace] = []
        for node_id, pod in nodes.items():
            host = pod.host
            if host is None or host not in flagged or pod.ended() is not None:
                continue
            if (host, node_id) in self._ours or (node_id, pod.pod_name) in self._asked:
                continue
            self._asked.add((node_id, pod.pod_name))
            meta = flagged[host].get("metadata") or {}
            status = (meta.get("labels") or {}).get(self.keys.status)
            why = (meta.get("annotations") or {}).get(HEALTH_REASON_ANNOTATION)
            label = f"{self.keys.status}={status}"
            reason = f"its pod {pod.pod_name} is on Node {host}, labelled {label}"
            reason += f" ({why})" if why else ""
            logger.info("%s: replacing %s: %s", self.source, node_id, reason)
            out.append(Replace(node_id, reason))
        return out
