"""One TrainingJob on Kubernetes: the controller in the operator, one pod per node.

It mirrors the local platform's runner: observe (pods through the API server, agents
through their HTTP API), let :class:`JobController` decide, act. A process-level
restart stops and starts workers inside the same pods; a full restart replaces the
pods. ``/start`` goes out once every node of the attempt has an agent answering, with
rank 0's pod IP as the rendezvous address (the headless Service's name for that pod
is in the attempt's events; the IP avoids waiting for DNS to catch up).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from trainguard.agent.client import AgentError
from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    Action,
    ControlConfig,
    Finish,
    JobController,
    PersistCheckpoint,
    RejoinNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.events import Event, FaultType
from trainguard.control.policy import RestartScope
from trainguard.kube.api import KubeApi, KubeError, NotFound
from trainguard.kube.config import OperatorConfig
from trainguard.kube.metrics import OperatorMetrics
from trainguard.kube.node import PodNode
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import (
    headless_service,
    job_selector,
    node_pod,
    pod_name,
    secret_name,
    secret_value,
    service_name,
    token_secret,
)
from trainguard.kube.status import Conditions, FaultyPods, job_status, k8s_event
from trainguard.platform.config import control_config
from trainguard.spec import NodeGroupPlan, parse_job

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
COMPONENT = "trainguard-operator"


class KubeJobRunner:
    """Drives one TrainingJob; the operator calls ``start()``, then ``step()`` every poll."""

    def __init__(
        self,
        api: KubeApi,
        body: Obj,
        settings: OperatorConfig,
        metrics: OperatorMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.body = body
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        meta = body.get("metadata") or {}
        self.name = str(meta.get("name"))
        self.namespace = str(meta.get("namespace") or "default")
        self.source = f"{self.namespace}/{self.name}"
        self.job = parse_job(body, self.source)  # SpecError: the operator fails the job
        self.plan = kube_plan(self.job, self.source)
        self._groups: dict[str, tuple[int, NodeGroupPlan]] = {}
        self.controller = JobController(self._control_config(), self._endpoint)
        self.nodes: dict[str, PodNode] = {}
        self.conditions = Conditions()
        self.faulty = FaultyPods()
        self._token = ""
        self._pending: StartNodes | None = None
        self._avoid_hosts: list[str] = []
        self._doomed: set[str] = set()  # pods to delete (retried until gone)
        self._last_status: Obj | None = None

    @property
    def done(self) -> bool:
        return self.controller.phase.terminal

    # -- the operator's calls ----------------------------------------------------------

    def start(self) -> None:
        """Create the token Secret and the Service, clear leftovers, start attempt 0."""
        self._token = self._ensure_token()
        try:
            self.api.create_service(
                self.namespace, headless_service(self.job, self.body, self.settings)
            )
        except KubeError as exc:
            if exc.status != 409:
                raise
        for pod in self.api.list_pods(self.namespace, job_selector(self.name)):
            self._doomed.add(pod["metadata"]["name"])  # an earlier operator's pods
        self.metrics.created.inc()
        now = self.clock()
        self._act(self.controller.start(now), now)
        self._publish(now)

    def step(self) -> None:
        """One poll: observe pods and agents, let the controller decide, act, record."""
        now = self.clock()
        pods = {p["metadata"]["name"]: p for p in self._list_pods()}
        for node in self.nodes.values():
            node.observe(pods.get(node.pod_name))
        reports = {
            node_id: node.report(now, self.plan.node_start_timeout_seconds)
            for node_id, node in self.nodes.items()
        }
        self._act(self.controller.observe(now, reports), now)
        self._send_pending_start()
        self._reap(pods)
        self._publish(now)

    def cancel(self, reason: str) -> None:
        now = self.clock()
        self._act(self.controller.cancel(now, reason), now)
        self._publish(now)

    def finish(self, delete_all: bool = False) -> None:
        """Shut the agents down, then delete pods per ``cleanPodPolicy`` (all when deleted)."""
        policy = self.job.spec.run_policy.clean_pod_policy
        for node in self.nodes.values():
            if node.client is not None and node.answered and node.ended() is None:
                with contextlib.suppress(AgentError):
                    node.client.shutdown()
            completed = node.last_state == "completed"
            if delete_all or policy == "All" or (policy == "OnlyComplete" and completed):
                self._doomed.add(node.pod_name)
        self._reap({})
        if delete_all:
            self.api.delete_owned(self.namespace, service_name(self.name), secret_name(self.name))

    # -- acting ---------------------------------------------------------------------

    def _act(self, actions: Sequence[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, StartNodes):
                self._start(action, now)
            elif isinstance(action, StopNodes):
                self._stop(action)
            elif isinstance(action, RejoinNodes):
                self._rejoin(action)
            elif isinstance(action, PersistCheckpoint):
                self._persist_checkpoint(action)
            elif isinstance(action, Finish):
                pass  # the operator ends the loop on the controller's terminal phase

    def _start(self, action: StartNodes, now: float) -> None:
        wanted = [a.node_id for a in action.assignments]
        for node_id in [n for n in self.nodes if n not in wanted]:
            self._retire(self.nodes.pop(node_id))  # replaced: a spare took its place
        fresh = (
            wanted
            if action.scope == RestartScope.JOB.value
            else [n for n in wanted if n not in self.nodes]
        )
        for node_id in fresh:
            old = self.nodes.pop(node_id, None)
            if old is not None:
                self._retire(old)
            self.nodes[node_id] = self._create_pod(node_id, action.attempt, now)
        for assignment in action.assignments:
            self.nodes[assignment.node_id].pending = assignment
        self._pending = action
        self._send_pending_start()

    def _stop(self, action: StopNodes) -> None:
        if self._pending is not None and self._pending.attempt == action.attempt:
            self._pending = None
        for node_id in action.node_ids:
            node = self.nodes.get(node_id)
            if node is None:
                continue
            node.pending = None
            if node.client is None or not node.answered:
                continue  # nothing was started there
            try:
                node.client.stop(
                    attempt=action.attempt,
                    mode=action.mode,
                    timeout=action.timeout,
                    capture_stacks=action.capture_stacks,
                )
            except AgentError as err:
                logger.warning(
                    "%s: %s: agent refused or unreachable: %s", self.source, node_id, err
                )
                node.broken = True

    def _rejoin(self, action: RejoinNodes) -> None:
        """An in-process restart: the same pods, a new attempt (see agent/inprocess.py)."""
        rank0 = next(a for a in action.assignments if a.node_rank == 0)
        master = self.nodes[rank0.node_id].pod_ip or rank0.master_addr
        peers = {n.node_id: n.url for n in self.nodes.values()}
        for assignment in action.assignments:
            node = self.nodes.get(assignment.node_id)
            if node is None or node.client is None:
                continue
            try:
                node.client.rejoin(replace(assignment, master_addr=master, peers=peers))
            except AgentError as err:
                logger.warning("%s: %s: /rejoin refused: %s", self.source, node.node_id, err)
                node.broken = True

    def _persist_checkpoint(self, action: PersistCheckpoint) -> None:
        """Every node persists the step; a failure is the controller's to notice."""
        for node_id in action.node_ids:
            node = self.nodes.get(node_id)
            if node is None or node.client is None:
                continue
            try:
                node.client.persist(
                    action.step, action.world_size, commit=node_id == action.commit_node
                )
            except AgentError as err:
                logger.warning("%s: %s: /persist refused: %s", self.source, node_id, err)

    def _send_pending_start(self) -> None:
        """Send the pending ``/start`` once every node of the attempt has an agent answering."""
        action = self._pending
        if action is None:
            return
        nodes = [self.nodes[a.node_id] for a in action.assignments]
        if not all(n.answered and n.client is not None and n.ended() is None for n in nodes):
            return
        self._pending = None
        rank0 = next(a for a in action.assignments if a.node_rank == 0)
        master = self.nodes[rank0.node_id].pod_ip or rank0.master_addr
        peers = {n.node_id: n.url for n in nodes}
        for assignment in action.assignments:
            node = self.nodes[assignment.node_id]
            node.pending = None
            try:
                assert node.client is not None
                node.client.start(replace(assignment, master_addr=master, peers=peers))
            except AgentError as err:
                logger.warning("%s: %s: /start refused: %s", self.source, node.node_id, err)
                node.broken = True

    def _create_pod(self, node_id: str, attempt: int, now: float) -> PodNode:
        index, group = self._groups[node_id]
        name = pod_name(self.name, node_id, attempt, secrets.token_hex(2))
        node = PodNode(
            node_id,
            name,
            self._token,
            now,
            self.settings.agent_port,
            self.settings.agent_timeout_seconds,
            self.settings.unreachable_after_polls,
        )
        pod = node_pod(
            self.job,
            self.body,
            index,
            group,
            node_id,
            name,
            attempt,
            self.settings,
            self._avoid_hosts,
        )
        try:
            self.api.create_pod(self.namespace, pod)
        except KubeError as exc:
            logger.warning("%s: cannot create pod %s: %s", self.source, name, exc)
            node.broken = True
        return node

    def _retire(self, node: PodNode) -> None:
        """Stop a node's agent (best effort) and delete its pod."""
        if node.client is not None and node.answered and node.ended() is None:
            with contextlib.suppress(AgentError):
                node.client.shutdown()
        self._doomed.add(node.pod_name)
        self._reap({})

    def _reap(self, listed: dict[str, Obj]) -> None:
        """Delete doomed pods, and any pod of the job that no node owns."""
        current = {n.pod_name for n in self.nodes.values()}
        self._doomed |= {name for name in listed if name not in current}
        for name in sorted(self._doomed):
            try:
                self.api.delete_pod(self.namespace, name)
                self._doomed.discard(name)
            except KubeError as exc:
                logger.warning("%s: cannot delete pod %s: %s", self.source, name, exc)

    def _list_pods(self) -> list[Obj]:
        try:
            return self.api.list_pods(self.namespace, job_selector(self.name))
        except KubeError as exc:
            # Without a listing, every node keeps its last view; the next poll tries again.
            logger.warning("%s: cannot list pods: %s", self.source, exc)
            return [n.pod for n in self.nodes.values() if n.pod is not None]

    # -- recording ------------------------------------------------------------------

    def _publish(self, now: float) -> None:
        for event in self.controller.drain_events():
            self._record(event)
        status = job_status(
            self.controller,
            self.conditions,
            [n.info() for n in self.nodes.values()],
            self.faulty,
            now,
        )
        if status == self._last_status:
            return
        try:
            self.api.patch_job_status(self.namespace, self.name, status)
            self._last_status = status
        except NotFound:
            pass  # deleted; the operator stops this runner
        except KubeError as exc:
            logger.warning("%s: cannot update status: %s", self.source, exc)

    def _record(self, event: Event) -> None:
        logger.info("%s: %s: %s", self.source, event.kind, event.message)
        if event.kind == "Fault":
            self._note_fault(event)
        elif event.kind == "RestartScheduled":
            scope = str(event.data.get("scope", ""))
            self.metrics.restarted.inc(scope)
            self.faulty.restart_type = RestartScope(scope).hyperpod if scope else None
        elif event.kind == "Recovered":
            seconds = event.data.get("recovery_seconds")
            if isinstance(seconds, int | float):
                self.metrics.restart_latency.observe(float(seconds))
        elif event.kind == "JobSucceeded":
            self.metrics.succeeded.inc()
        elif event.kind == "JobFailed":
            self.metrics.failed.inc()
        try:
            self.api.create_event(self.namespace, k8s_event(self.body, event, COMPONENT))
        except KubeError as exc:
            logger.warning("%s: cannot record event %s: %s", self.source, event.kind, exc)

    def _note_fault(self, event: Event) -> None:
        node = self.nodes.get(event.node) if event.node else None
        self.faulty.note_fault(event, node.pod_name if node else None)
        kind = str(event.data.get("type", "Fault"))
        self.metrics.faults.inc(kind)
        if node is None or kind != FaultType.NODE_LOST.value:
            return
        ended = node.ended()
        if ended is not None and ended[1] is not None:
            self.metrics.fault_detection_latency.observe(event.time - ended[1])
        limit = self.controller.config.policy.max_num_repeat_offenders_to_avoid
        if node.host and limit > 0:
            self._avoid_hosts = [h for h in self._avoid_hosts if h != node.host] + [node.host]
            self._avoid_hosts = self._avoid_hosts[-limit:]

    # -- set-up -------------------------------------------------------------------------

    def _ensure_token(self) -> str:
        """The job's agent token: from its Secret, which is created on first start."""
        try:
            value = secret_value(self.api.read_secret(self.namespace, secret_name(self.name)))
            if value:
                return value
        except NotFound:
            pass
        token = secrets.token_urlsafe(32)
        self.api.create_secret(self.namespace, token_secret(self.job, self.body, token))
        return token

    def _control_config(self) -> ControlConfig:
        # Durable checkpoints need spec.checkpointing.durableUrl on a cluster (the pods'
        # own disks do not outlive them).
        durable = bool(self.plan.job.spec.checkpointing.durable_url)
        config, self._groups = control_config(self.plan, self.name, durable=durable)
        return config

    def _endpoint(self, attempt: int) -> Endpoint:
        """Rank 0's pod by its Service name; a fresh port per attempt (a fresh store)."""
        first = self.controller.nodes[0]
        port = self.settings.rendezvous_port_base + attempt % self.settings.rendezvous_port_span
        return Endpoint(f"{first}.{service_name(self.name)}.{self.namespace}.svc", port)
