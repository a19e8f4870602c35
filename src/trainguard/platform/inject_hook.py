"""``--inject`` as a hook of the control loop (:func:`~trainguard.platform.drive.drive`
calls it each turn, after the turn's acts and before the record).

Each turn it fires the injections that are due (signals to this machine's processes,
rehearsal hooks, capacity taken or given) and records what the agents fired of those
handed to them. What needs another process to answer (the injections handed to an
agent, a partition asked of a host daemon) is sent by one worker thread, never on the
loop's: a slow or cut-off agent holds nothing up.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from trainguard.agent.client import AgentError
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeReport
from trainguard.platform.base import Observation
from trainguard.platform.inject import Injection, Injector, Targets
from trainguard.platform.local_platform import LocalPlatform
from trainguard.spec.plan import JobPlan
from trainguard.wire.requests import InjectRequest, StepInjection
from trainguard.wire.status import WorkerState

__all__ = ["InjectionHook", "injector_for"]

logger = logging.getLogger(__name__)


def injector_for(injections: Sequence[Injection], plan: JobPlan, across_hosts: bool) -> Injector:
    """The injector of ``plan``'s job; ValueError naming the SPEC of one it cannot take
    (a target out of range, capacity of a job that is not elastic, a partition of one
    host, a check the job does not run)."""
    injector = Injector(injections, plan.world_size, plan.nnodes, delegate_steps=True)
    checks = plan.job.spec.trainguard.health_checks.checks
    for injection in injections:
        if injection.kind in ("preempt", "capacity") and plan.job.spec.elastic_policy is None:
            raise ValueError(
                f"--inject {injection.text!r}: only an elastic job (spec.elasticPolicy, "
                "or --nnodes MIN:MAX) has capacity to take away or give"
            )
        if injection.kind == "partition" and (not across_hosts or injection.node == 0):
            where = (
                "node 0 is the controller's host" if across_hosts else "the job runs on one host"
            )
            raise ValueError(
                f"--inject {injection.text!r}: a partition cuts another host off ({where})"
            )
        if injection.kind == "health" and injection.check not in checks:
            raise ValueError(
                f"--inject {injection.text!r}: the job runs no {injection.check} check "
                f"(spec.trainguard.healthChecks.onStart: {', '.join(checks) or 'none'})"
            )
    return injector


class InjectionHook:
    """Fires ``injector``'s injections on ``platform``'s nodes; see the module doc."""

    def __init__(self, platform: LocalPlatform, injector: Injector) -> None:
        self.platform = platform
        self.injector = injector
        self._first_step_at: float | None = None
        # What each node's agent holds of the step injections: (its incarnation, them);
        # written by the worker thread once the agent took them.
        self._handed: dict[str, tuple[str, tuple[StepInjection, ...]]] = {}
        self._sending: set[str] = set()  # nodes whose hand-over is under way
        self._lock = threading.Lock()
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="inject")

    def __call__(self, controller: JobController, seen: Observation) -> None:
        self._agents_fired(controller, seen.reports)
        self._hand_over(seen.reports)
        attempt = controller.current
        if not self.injector.pending or attempt is None:
            return
        progress = attempt.watch.progress
        if progress is not None and self._first_step_at is None:
            self._first_step_at = progress.first_time
        node_ranks = {a.node_id: a.node_rank for a in attempt.assignments}
        nodes = self.platform.nodes
        rank_pids: dict[int, int] = {}
        node_pids: dict[int, tuple[int, tuple[int, ...]]] = {}
        agents_see: set[int] = set()
        for node_id, report in seen.reports.items():
            status = report.about(attempt.number)
            node = nodes.get(node_id)
            if status is None or node is None or node_id not in node_ranks:
                continue
            alive = {
                w.rank: w.pid
                for w in status.workers
                if w.pid is not None and w.state is WorkerState.RUNNING
            }
            rank_pids.update(alive)
            if status.monitor.progress is not None:
                agents_see.update(w.rank for w in status.workers)
            if node.pid is not None:
                node_pids[node_ranks[node_id]] = (node.pid, tuple(alive.values()))
        now = time.time()
        hooks_root = self.platform.hooks_root
        hooks = (
            {rank: hooks_root / node_id for node_id, rank in node_ranks.items()}
            if hooks_root is not None
            else {}
        )
        live = frozenset(r for n, r in node_ranks.items() if n in nodes)
        fired = self.injector.poll(
            now,
            progress.step if progress else None,
            self._first_step_at,
            Targets(rank_pids, node_pids, frozenset(agents_see), hooks, live),
        )
        by_rank = {v: k for k, v in node_ranks.items()}
        for f in fired:
            kind = f.injection.kind
            target = None if f.node is None else by_rank.get(f.node)
            if kind == "capacity" and f.injection.code is not None:
                self.platform.store.set_capacity(self.platform.job_id, f.injection.code, delta=True)
            if kind == "preempt" and target is not None:
                self.platform.preempt(target, now)
            if kind in ("capacity", "preempt"):
                self.platform.book.wake()  # the capacity changed: look again now
            if kind == "partition" and target is not None:
                self._partition(target, f.injection.duration)
            if kind == "node-kill" and target is not None:
                # A lost node loses its RAM: its memory tier goes with it.
                shutil.rmtree(self.platform.memory_root / target, ignore_errors=True)
            controller.note_injection(f.time, f.injection.text, f.rank, target, f.step)

    def close(self) -> None:
        """No more hand-overs; stopped workers are resumed (they can be shut down)."""
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.injector.close()

    def _partition(self, node_id: str, seconds: float | None) -> None:
        """Cut ``node_id``'s host off the network: only a job on several hosts can (its
        host daemon does it, asked by the worker thread)."""
        partitioner, say = self.platform.partitioner, self.platform.say
        if partitioner is None:
            say(f"partition of {node_id} not injected: the job runs on one host")
            return

        def cut() -> None:
            why = partitioner(node_id, seconds)
            if why is not None:
                say(f"partition of {node_id} not injected: {why}")

        self._calls.submit(cut)

    def _agents_fired(self, controller: JobController, reports: Mapping[str, NodeReport]) -> None:
        """Record the step injections agents fired."""
        attempt = controller.current
        node_ranks = {a.node_id: a.node_rank for a in attempt.assignments} if attempt else {}
        for node_id, report in reports.items():
            for fault in report.status.injected if report.status is not None else ():
                hit = self.injector.confirm(fault, node_ranks.get(node_id))
                if hit is not None:
                    controller.note_injection(
                        hit.time, hit.injection.text, hit.rank, node_id, hit.step
                    )

    def _hand_over(self, reports: Mapping[str, NodeReport]) -> None:
        """Hand the pending step injections to every agent that answers (again when
        they change, or the agent is a new one), through the worker thread."""
        delegated = self.injector.delegated()
        with self._lock:
            if not self._handed and not delegated:
                return
            for node_id, report in reports.items():
                status = report.status
                client = self.platform.transport.client(node_id)
                if status is None or client is None or node_id in self._sending:
                    continue
                sent = (status.incarnation, delegated)
                if self._handed.get(node_id) == sent:
                    continue
                self._sending.add(node_id)
                self._calls.submit(self._hand, node_id, sent, client.inject)

    def _hand(
        self,
        node_id: str,
        sent: tuple[str, tuple[StepInjection, ...]],
        inject: Callable[[InjectRequest], object],
    ) -> None:
        try:
            inject(InjectRequest(injections=sent[1]))
        except AgentError as exc:
            logger.warning("could not hand injections to %s: %s", node_id, exc)
        else:
            with self._lock:
                self._handed[node_id] = sent
        finally:
            with self._lock:
                self._sending.discard(node_id)
