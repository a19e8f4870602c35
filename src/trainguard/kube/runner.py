"""One TrainingJob on Kubernetes: the controller in the operator, one pod per node.

:class:`KubeJob` is the local runner's counterpart: it parses the job, sets it up (the
agent token's Secret, the headless Service, the job's key in the operator's report
inbox), runs :func:`~trainguard.platform.drive.drive` over a
:class:`~trainguard.kube.kube_platform.KubePlatform` on a worker thread of the
operator, and cleans up after it (:meth:`KubeJob.finish`).

A process-level restart stops and starts workers inside the same pods; a full restart
(a lost pod) replaces every pod. ``/start`` goes out once every node's agent answers
(the controller waits), with rank 0's pod IP as the rendezvous address.

A job labelled with a Kueue queue (:mod:`trainguard.kube.kueue`) gets its Workload at
set-up, creates its pods only once Kueue admitted it, and deletes the Workload when it
ends.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from trainguard.control import resume
from trainguard.control.actions import Action
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.controller import JobController
from trainguard.kube import adopt
from trainguard.kube.api import KubeApi, KubeError, NotFound
from trainguard.kube.config import Obj, OperatorConfig
from trainguard.kube.kube_platform import Detached, KubePlatform, Outside
from trainguard.kube.kueue import KueueWorkload
from trainguard.kube.node_health import NodeHealthLabels
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import (
    headless_service,
    network_policy,
    network_policy_name,
    secret_name,
    secret_value,
    service_name,
    token_secret,
)
from trainguard.kube.record import ClusterRecord
from trainguard.observe.job import JobObserver
from trainguard.observe.metrics import Metrics
from trainguard.platform.book import ReportBook
from trainguard.platform.control_config import control_config
from trainguard.platform.drive import drive
from trainguard.platform.inbox import Inbox, agent_transport
from trainguard.platform.resume import reattached
from trainguard.platform.transport import AgentTransport
from trainguard.spec import parse_job

__all__ = ["KubeJob"]

logger = logging.getLogger(__name__)

Begin = Callable[[float], Sequence[Action]]


class KubeJob:
    """Drives one TrainingJob; see the module docstring.

    The operator calls :meth:`run` on a worker thread (it returns when the job ended, or
    when :meth:`detach` let go of it), and :meth:`cancel`, :meth:`detach` and
    :meth:`finish` from its own threads. The constructor raises
    :class:`~trainguard.spec.SpecError` for a job that cannot run.
    """

    def __init__(
        self,
        api: KubeApi,
        body: Obj,
        settings: OperatorConfig,
        metrics: Metrics,
        inbox: Inbox | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.body = body
        self.settings = settings
        self.metrics = metrics
        self.inbox = inbox
        self.clock = clock
        meta = body.get("metadata") or {}
        self.name = str(meta.get("name"))
        self.namespace = str(meta.get("namespace") or "default")
        self.source = f"{self.namespace}/{self.name}"
        self.job = parse_job(body, self.source)  # SpecError: the operator fails the job
        self.plan = kube_plan(
            self.job, self.source, allow_privileged=settings.allow_privileged_pods
        )
        # Durable checkpoints need spec.checkpointing.durableUrl on a cluster (the pods'
        # own disks do not outlive them).
        durable = bool(self.job.spec.checkpointing.durable_url)
        config, self.groups = control_config(self.plan, self.name, durable=durable)
        # A fresh pod of a node lands off the Nodes labelled unhealthy: see kube/node_health.py.
        self.config = replace(
            config, unreachable_after=settings.unreachable_after_polls, fresh_node_moves=True
        )
        self.book = ReportBook()
        self.outside = Outside(self.book)
        self.controller = JobController(self.config, self._endpoint)
        observer = JobObserver(self.name, self.source, metrics.job(self.source))
        # Node health labels: written on the job's NodeHealth events, read each poll.
        self.node_health = (
            NodeHealthLabels(api, settings, self.source) if settings.node_labels else None
        )
        self.record = ClusterRecord(api, body, observer, self.node_health)
        self.transport: AgentTransport | None = None
        self.platform: KubePlatform | None = None
        self.ended = threading.Event()  # run() returned
        self._lock = threading.Lock()  # finish() and close()
        self._closed = False

    @property
    def done(self) -> bool:
        return self.controller.phase.terminal

    # -- the operator's calls ----------------------------------------------------------

    def run(self) -> None:
        """Set the job up and drive it until it ends (or :meth:`detach` lets go of it)."""
        try:
            if self.outside.requested:
                return  # deleted (or the operator is exiting) before it began
            platform, begin = self._set_up()
            if platform.kueue is not None and begin is None:
                self._admitted(platform.kueue)
            drive(self.controller, platform, self.clock, begin)
        except Detached:
            logger.info("%s: let go of (operator exiting); its pods keep running", self.source)
        finally:
            self.ended.set()

    def cancel(self, reason: str) -> None:
        """Stop every rank (gracefully), then end the job as Stopped."""
        self.outside.cancel(reason)

    def detach(self) -> None:
        """End the loop at once, leaving the pods running (the operator is exiting)."""
        self.outside.detach()

    def finish(self, delete_all: bool = False) -> None:
        """After the loop: shut the agents down, then delete pods per ``cleanPodPolicy``;
        ``delete_all`` (the job was deleted): every pod, the Service and the Secret."""
        try:
            with self._lock:
                if self.platform is not None:
                    self.platform.finish(delete_all)
                    if self.platform.kueue is not None:
                        self.platform.kueue.delete()  # its quota is released
                if delete_all:
                    self.api.delete_owned(
                        self.namespace,
                        service_name(self.name),
                        secret_name(self.name),
                        network_policy_name(self.name) if self.settings.network_policy else None,
                    )
        finally:
            self.close()

    def close(self) -> None:
        """Stop talking to the agents (the pods are left as they are)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.inbox is not None:
                self.inbox.unregister(self.source)
            if self.transport is not None:
                self.transport.close()

    # -- set-up -------------------------------------------------------------------------

    def _set_up(self) -> tuple[KubePlatform, Begin | None]:
        """The token Secret, the Service, the NetworkPolicy, the inbox key; the running
        pods adopted (a job an earlier operator ran) or the leftover ones deleted. Returns
        the platform and how the job begins (None: a new job's start)."""
        token = self._ensure_token()
        owned = [(self.api.create_service, headless_service(self.job, self.body, self.settings))]
        if self.settings.network_policy:
            policy = network_policy(self.job, self.body, self.settings)
            owned.append((self.api.create_network_policy, policy))
        for create, obj in owned:
            try:
                create(self.namespace, obj)
            except KubeError as exc:
                if exc.status != 409:
                    raise
        transport = self.transport = agent_transport(
            self.inbox,
            self.source,
            token,
            poll_interval=self.config.poll_interval,
            timeout=self.settings.agent_timeout_seconds,
            book=self.book,
        )
        platform = self.platform = KubePlatform(
            self.api,
            self.job,
            self.body,
            self.settings,
            self.groups,
            transport,
            self.record,
            self.outside,
            poll_interval=self.config.poll_interval,
            contact_rule=self.config.contact_rule,
            clock=self.clock,
            node_health=self.node_health,
            kueue=KueueWorkload.create(self.api, self.body, self.config.poll_interval),
        )
        begin = self._take_over(token, platform)
        platform.reap()  # pods of an earlier operator that were not adopted
        transport.start()
        return platform, begin

    def _admitted(self, kueue: KueueWorkload) -> None:
        """Wait until Kueue admits the job's Workload (or evicts it: the platform's first
        look stops the job), or the operator asks the loop to end."""
        logger.info("%s: waiting for Kueue to admit Workload %s", self.source, kueue.name)
        while not self.outside.requested:
            state = kueue.read(self.clock())
            if state.admitted or state.evicted is not None:
                return
            self.book.wait(kueue.interval)

    def _take_over(self, token: str, platform: KubePlatform) -> Begin | None:
        """How a job an earlier operator ran goes on (:mod:`trainguard.kube.adopt`):
        adopted as it runs, or restarted from its newest checkpoint; None for a new job."""
        status = self.body.get("status") or {}
        record = adopt.recorded(status)
        if record is None:
            return None
        controller, newest = self.controller, record.newest
        why = "no attempt was running"
        if newest is not None and newest.endpoint is not None:
            pods, reason = adopt.live_pods(
                self.api,
                self.namespace,
                self.name,
                status,
                token,
                newest.number,
                len(record.nodes or controller.nodes),  # an elastic job's size may differ
                self.settings.agent_port,
            )
            why = reason or why
            if pods:
                platform.adopt([(p.node_id, p.pod, p.url) for p in pods])
                nodes = [p.node_id for p in pods]
                begin, refused = reattached(
                    controller, record, nodes, platform.transport, platform.retire
                )
                if begin is not None:
                    logger.info(
                        "%s: adopted the %d running pods of attempt %d",
                        self.source,
                        len(pods),
                        newest.number,
                    )
                    return begin
                why = refused
        logger.info(
            "%s: cannot adopt (%s): restarting from the newest checkpoint", self.source, why
        )
        return lambda now: controller.take_over(
            now, resume.restart(controller.config, now, record, why)
        )

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

    def _endpoint(self, attempt: int, node_id: str) -> StoreEndpoint:
        assert self.platform is not None, "the controller starts attempts inside run()"
        return self.platform.endpoint(attempt, node_id)
