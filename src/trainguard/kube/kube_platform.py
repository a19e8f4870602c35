"""The Kubernetes platform: every node of a job is a pod, with a node agent as its entrypoint.

It implements :class:`~trainguard.platform.base.Platform` for
:func:`~trainguard.platform.drive.drive`, as the local platform does for agent
processes:

- **launch** creates one pod per node (the node's old pod, if any, is deleted first),
  off the hosts the controller wants avoided; the pod's name is its agent's incarnation;
- **retire** shuts the nodes' agents down (best effort) and deletes their pods;
- **observe** lists the job's pods (at most once per poll interval): a pod that is gone,
  being deleted or ended is a ``gone`` node; a pod with an IP locates its agent (and its
  host). The agents' statuses come through the transport (polls, pushes). A pod that
  never gets an IP is the controller's to time out (``node_start_timeout``). Pods of
  the job that no node owns (an earlier operator's) are deleted. With the same listing,
  a pod on a Node labelled to be moved off (``UnschedulablePendingReplacement``, by hand
  or by the health agent) asks for its node's replacement
  (:meth:`~trainguard.kube.node_health.NodeHealthLabels.replacements`). For an elastic
  job it also reports the capacity (the job's replica count, re-read from the API; at
  most what the Nodes hold, :mod:`trainguard.kube.capacity`) and the nodes whose pod is
  evicted or preempted, or on a Node going away (:mod:`trainguard.kube.elastic`). A job
  queued in Kueue (:mod:`trainguard.kube.kueue`) is held to what Kueue admitted, and
  stopped when Kueue evicts it;
- **record** patches the job's status and records Events and metrics
  (:class:`~trainguard.kube.record.ClusterRecord`).

The operator's threads steer a running loop through :class:`Outside`: a delete cancels
the job (an :class:`~trainguard.platform.base.Observation` with a
:class:`~trainguard.platform.base.Cancel`); an exiting operator lets go of it
(:class:`Detached` ends the loop and the pods keep running).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainguard.agent.client import AgentError
from trainguard.control.actions import LaunchNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.contact import ContactRule, shown_state
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeReport, Refusal
from trainguard.kube.api import KubeApi, KubeError
from trainguard.kube.capacity import PodShape
from trainguard.kube.config import Obj, OperatorConfig
from trainguard.kube.elastic import NodeCapacity, Preemptions, ReplicaCount
from trainguard.kube.kueue import KueueWorkload
from trainguard.kube.node import PodNode
from trainguard.kube.node_health import NodeHealthLabels
from trainguard.kube.pods import job_selector, node_pod, pod_name, service_name
from trainguard.kube.record import ClusterRecord
from trainguard.platform.base import Cancel, Observation, Replace
from trainguard.platform.book import ReportBook
from trainguard.platform.transport import AgentTransport, Delivery
from trainguard.spec import NodeGroupPlan, TrainingJob
from trainguard.wire.status import NodeState

__all__ = ["Detached", "KubePlatform", "Outside"]

logger = logging.getLogger(__name__)

CONCURRENCY = 16
"""API calls (pod creations, deletions) and agent shutdowns in flight at once."""
NODE_CAPACITY_SECONDS = 5.0
"""At most this often (or the poll interval, if longer) an elastic job lists every Node
and every bound pod for its capacity."""


class Detached(Exception):
    """The operator let go of the job (it is exiting): the loop ends, the pods keep running."""


class Outside:
    """What the operator's threads ask of a job's loop; each request wakes it at once."""

    def __init__(self, book: ReportBook) -> None:
        self._book = book
        self._lock = threading.Lock()
        self._cancel: str | None = None
        self._detached = False

    def cancel(self, reason: str) -> None:
        """Stop the job (gracefully, every rank at once); the first reason is kept."""
        with self._lock:
            if self._cancel is None:
                self._cancel = reason
        self._book.wake()

    def detach(self) -> None:
        """End the loop at its next look, leaving the job's pods as they are."""
        with self._lock:
            self._detached = True
        self._book.wake()

    @property
    def requested(self) -> bool:
        with self._lock:
            return self._detached or self._cancel is not None

    def check(self) -> Cancel | None:
        """The cancel asked for, if any; raises :class:`Detached` when let go of."""
        with self._lock:
            if self._detached:
                raise Detached
            return Cancel(self._cancel) if self._cancel is not None else None


class KubePlatform:
    """One TrainingJob's pods; see the module docstring."""

    def __init__(
        self,
        api: KubeApi,
        job: TrainingJob,
        body: Obj,
        settings: OperatorConfig,
        groups: dict[str, tuple[int, NodeGroupPlan]],
        transport: AgentTransport,
        record: ClusterRecord,
        outside: Outside,
        *,
        poll_interval: float,
        contact_rule: ContactRule,
        clock: Callable[[], float] = time.time,
        node_health: NodeHealthLabels | None = None,
        kueue: KueueWorkload | None = None,
    ) -> None:
        self.api = api
        self.job = job
        self.body = body
        self.settings = settings
        self.groups = groups
        self.transport = transport
        self.book: ReportBook = transport.book
        self.recorder = record
        self.outside = outside
        self.poll_interval = poll_interval
        self.contact_rule = contact_rule
        self.clock = clock
        self.node_health = node_health  # None: Node labels are not read
        self.name = job.metadata.name
        self.namespace = job.metadata.namespace or "default"
        self.source = f"{self.namespace}/{self.name}"
        self.nodes: dict[str, PodNode] = {}  # each node id's current pod
        self._seen: dict[str, PodNode] = {}  # the pods as of the latest observation
        self._listing: dict[str, Obj] = {}  # the job's pods by name, as last listed
        self._listed_at: float | None = None
        self._doomed: set[str] = set()  # pods to delete (retried until the API agrees)
        self._shut_down = False
        # Elastic jobs: the replica count (capacity) and the pods taken away (preempted).
        self.replicas: ReplicaCount | None = None
        if job.spec.elastic_policy is not None:
            initial = sum(group.replicas for group in job.spec.replica_specs)
            self.replicas = ReplicaCount(api, self.namespace, self.name, initial, poll_interval)
        self.preemptions = Preemptions(self.source)
        self.kueue = kueue  # None: not queued in Kueue
        # What the Nodes hold (needs the rights on Nodes that the health labels have).
        self.node_capacity: NodeCapacity | None = None
        if self.replicas is not None and node_health is not None and groups:
            node_id = list(groups)[-1]  # a node a scale-up adds: the last group's
            index, group = groups[node_id]
            pod = node_pod(job, body, index, group, node_id, "shape", 0, settings)
            try:
                shape = PodShape.of(pod["spec"])
            except ValueError as exc:  # the API server refuses such a pod anyway
                logger.warning("%s: the Nodes' capacity is not read: %s", self.source, exc)
            else:
                every = max(poll_interval, NODE_CAPACITY_SECONDS)
                self.node_capacity = NodeCapacity(
                    api, self.source, shape, node_health.keys.status, every
                )

    # -- lifecycle ---------------------------------------------------------------------

    def endpoint(self, attempt: int, node_id: str) -> StoreEndpoint:
        """Rank 0's pod by its IP (no waiting for DNS to catch up), else by its Service
        name; a fresh port per attempt (rank 0 hosts a fresh store)."""
        settings = self.settings
        port = settings.rendezvous_port_base + attempt % settings.rendezvous_port_span
        node = self.nodes.get(node_id)
        ip = node.pod_ip if node is not None else None
        return StoreEndpoint(
            ip or f"{node_id}.{service_name(self.name)}.{self.namespace}.svc", port
        )

    def launch(self, request: LaunchNodes) -> None:
        self._let_go([n for n in request.node_ids if n in self.nodes])
        pods: list[tuple[PodNode, Obj]] = []
        for node_id in request.node_ids:
            index, group = self.groups[node_id]
            name = pod_name(self.name, node_id, request.attempt, secrets.token_hex(2))
            pod = node_pod(
                self.job,
                self.body,
                index,
                group,
                node_id,
                name,
                request.attempt,
                self.settings,
                request.avoid_hosts,
            )
            self.book.reset(node_id, name)  # the pod's name is its agent's incarnation
            self.nodes[node_id] = PodNode(node_id, name)
            pods.append((self.nodes[node_id], pod))
        _each(self._create, pods)

    def adopt(self, pods: Sequence[tuple[str, Obj, str]]) -> None:
        """Take over running pods (``(node_id, pod, agent_url)``) an earlier operator
        created: a new operator adopting a job (:mod:`trainguard.kube.adopt`)."""
        for node_id, pod, url in pods:
            node = self.nodes[node_id] = PodNode(node_id, str(pod["metadata"]["name"]))
            node.observe(pod)
            self.book.reset(node_id, node.pod_name)
            self.book.located(node_id, url, host=node.host)

    def retire(self, node_ids: Sequence[str]) -> None:
        self._let_go(node_ids)
        for node_id in node_ids:
            self.book.forget(node_id)

    def finish(self, delete_all: bool = False) -> None:
        """After the loop: shut the agents down (once), then delete pods per the job's
        ``cleanPodPolicy`` (every pod when ``delete_all``: the job was deleted)."""
        reports = self.book.reports()
        if not self._shut_down:
            self._shut_down = True
            self._shutdown([n for n in self.nodes if reports.get(n, _NONE).gone is None])
        policy = self.job.spec.run_policy.clean_pod_policy
        doomed = []
        for node_id, node in self.nodes.items():
            status = reports.get(node_id, _NONE).status
            completed = status is not None and status.state is NodeState.COMPLETED
            if delete_all or policy == "All" or (policy == "OnlyComplete" and completed):
                doomed.append(node.pod_name)
        _each(self._delete, doomed)

    def reap(self) -> None:
        """Delete the pods of the job no node owns (left by an earlier operator)."""
        self._list(self.clock(), force=True)

    def _let_go(self, node_ids: Iterable[str]) -> None:
        """Shut these nodes' agents down (best effort) and delete their pods."""
        nodes = [node for n in node_ids if (node := self.nodes.pop(n, None)) is not None]
        reports = self.book.reports()
        self._shutdown([n.node_id for n in nodes if reports.get(n.node_id, _NONE).gone is None])
        _each(self._delete, [n.pod_name for n in nodes])

    def _shutdown(self, node_ids: Sequence[str]) -> None:
        clients = [c for n in node_ids if (c := self.transport.client(n)) is not None]

        def shutdown(client: Any) -> None:
            with contextlib.suppress(AgentError):
                client.shutdown()

        _each(shutdown, clients)

    def _create(self, entry: tuple[PodNode, Obj]) -> None:
        node, pod = entry
        try:
            self.api.create_pod(self.namespace, pod)
        except KubeError as exc:
            logger.warning("%s: cannot create pod %s: %s", self.source, node.pod_name, exc)
            self.book.gone(node.node_id, f"cannot create pod {node.pod_name}: {exc}")

    def _delete(self, name: str) -> None:
        try:
            self.api.delete_pod(self.namespace, name)
            self._doomed.discard(name)
        except KubeError as exc:
            logger.warning("%s: cannot delete pod %s: %s", self.source, name, exc)
            self._doomed.add(name)

    # -- transport ---------------------------------------------------------------------

    def send(self, deliveries: Sequence[Delivery]) -> list[Refusal]:
        return self.transport.send(deliveries)

    def wait(self, timeout: float) -> None:
        self.book.wait(timeout)

    def pace(self, interval: float) -> None:
        self.transport.pace(interval)

    def observe(self, now: float) -> Observation:
        admitted = None
        if self.kueue is not None:
            admitted = self.kueue.read(now)
            if admitted.evicted is not None:
                self.outside.cancel(f"Kueue evicted Workload {self.kueue.name}: {admitted.evicted}")
        cancel = self.outside.check()
        # The Nodes first: the job's pods are listed just before the agents' reports are
        # taken, so that a pod's eviction is seen no later than its agent's end.
        held = self.node_capacity.read(now, self.nodes) if self.node_capacity else None
        listed = self._list(now)
        port = self.settings.agent_port
        for node_id, node in self.nodes.items():
            node.observe(self._listing.get(node.pod_name))
            ended = node.ended()
            if ended is not None:
                self.book.gone(node_id, ended[0])
            elif (url := node.agent_url(port)) is not None and self.book.url(node_id) != url:
                self.book.located(node_id, url, host=node.host)
        self._seen = dict(self.nodes)
        replace: list[Replace] = []
        if listed and self.node_health is not None:
            replace = self.node_health.replacements(self.nodes)
        if self.replicas is None:
            return Observation(self.book.reports(), cancel, replace=tuple(replace))
        capacity = self.replicas.read(now)
        preempted = list(self.preemptions.observe(self.nodes))
        if held is not None:
            capacity = min(capacity, held.pods)
            preempted += [
                n
                for n, node in self.nodes.items()
                if node.pod_name in held.pods_leaving and n not in preempted
            ]
        if admitted is not None:
            capacity = min(capacity, admitted.pods)
        return Observation(
            self.book.reports(),
            cancel,
            replace=tuple(r for r in replace if r.node_id not in preempted),
            capacity=capacity,
            preempted=tuple(preempted),
        )

    def _list(self, now: float, force: bool = False) -> bool:
        """List the job's pods, at most once per poll interval; delete the unowned ones.
        Whether it listed."""
        if not force and self._listed_at is not None and now - self._listed_at < self.poll_interval:
            return False
        try:
            pods = self.api.list_pods(self.namespace, job_selector(self.name))
        except KubeError as exc:
            # Without a listing, every node keeps its last view; the next look tries again.
            logger.warning("%s: cannot list pods: %s", self.source, exc)
            return False
        self._listed_at = now
        self._listing = {p["metadata"]["name"]: p for p in pods}
        owned = {n.pod_name for n in self.nodes.values()}
        for name, pod in self._listing.items():
            if name not in owned and not (pod.get("metadata") or {}).get("deletionTimestamp"):
                self._doomed.add(name)
        _each(self._delete, sorted(self._doomed))
        return True

    # -- the record ----------------------------------------------------------------------

    def announce(self, controller: JobController) -> None:
        """Nothing ahead of :meth:`record`: the job's events become Kubernetes Events and
        its status there, once a turn."""

    def record(self, controller: JobController, observation: Observation | None) -> None:
        reports = observation.reports if observation is not None else self.book.reports()
        pods = [
            node.info(self._state(reports.get(node_id))) for node_id, node in self.nodes.items()
        ]
        self.recorder.record(controller, pods, {**self.nodes, **self._seen}, self.clock(), reports)

    def _state(self, report: NodeReport | None) -> str:
        return shown_state(report, self.contact_rule).value


_NONE = NodeReport("")


def _each(call: Callable[[Any], None], items: Sequence[Any]) -> None:
    """``call`` on every item, up to :data:`CONCURRENCY` at once; returns when all are done."""
    if len(items) <= 1:
        for item in items:
            call(item)
        return
    with ThreadPoolExecutor(min(CONCURRENCY, len(items)), thread_name_prefix="tg-kube") as pool:
        list(pool.map(call, items))
