"""The job controller: a state machine over attempts, driven by node reports.

Pure logic. :func:`trainguard.platform.drive.drive` calls :meth:`JobController.start`,
then :meth:`JobController.observe` with the time and a report per node whenever it
looks (every poll, and at once when an agent pushes news), and carries out the returned
actions. Nothing here sleeps, reads a clock or opens a socket, so every branch is unit
tested with plain values.

An attempt goes LAUNCHING (its nodes' agents come up: a fresh job, a full job restart)
-> RUNNING (``/start`` sent; or ``/rejoin`` for an in-process restart) -> STOPPING (any
fault stops every rank at once) -> ended; then the policy picks the next attempt's
scope, or the job fails. Planners decide each turn (control/lifecycle.py and the modules
it calls); :meth:`JobController._apply` carries their decisions out.

Assumptions the decisions rely on:
- a node's status is only evidence about the attempt it names; an agent that has not
  processed the latest request yet is ignored for success and fault decisions;
- any fault on any rank stops every rank of the attempt at once, so no survivor
  waits out a collective timeout (an in-process restart instead makes every rank
  leave the failed attempt and join the next one);
- an attempt counts as stopped once every node is quiescent, or once the stop
  deadline passes (the nodes that did not stop are then faulted as such).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trainguard.control import lifecycle, recovery, rescale
from trainguard.control.actions import (
    Action,
    AttemptPhase,
    Finish,
    JobPhase,
    LaunchNodes,
    RejoinNodes,
    RetireNodes,
    StartNodes,
    StopMode,
    StopNodes,
)
from trainguard.control.assignment import StoreEndpoint, assign_attempt, replica_sources
from trainguard.control.attempt import (
    Attempt,
    Rejoining,
    Rescaling,
    Training,
    new_watch,
)
from trainguard.control.config import ControlConfig
from trainguard.control.decision import Decision, InPlace, JobView, NextAttempt, Stop
from trainguard.control.detect import refusal_faults
from trainguard.control.elastic import ElasticWatch
from trainguard.control.events import Event, EventKind, Fault, Note
from trainguard.control.health import HealthBook
from trainguard.control.inprocess import Rejoin
from trainguard.control.pace import poll_pace
from trainguard.control.persist import CheckpointPlanner
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.record import JobRecord
from trainguard.control.reports import NodeReport, Refusal
from trainguard.control.resume import Takeover
from trainguard.control.stragglers import StragglerWatch
from trainguard.control.timeline import Timeline
from trainguard.wire.status import NodeState, NodeStatus

__all__ = ["EndpointFor", "JobController", "JobPhase"]  # the phase callers read off the controller

EndpointFor = Callable[[int, str], StoreEndpoint]
"""``endpoint_for(attempt, node_id)``: where the attempt's rendezvous store is (the job's
store service's, ``hosted``, or rank 0's on ``node_id``); asked once the node is up."""


class JobController:
    """Runs one job: assigns ranks, watches reports, stops all on a fault, restarts or gives up."""

    def __init__(self, config: ControlConfig, endpoint_for: EndpointFor) -> None:
        self.config = config
        self._endpoint_for = endpoint_for
        self.phase = JobPhase.PENDING
        self.reason: str | None = None
        self.attempts: list[Attempt] = []
        self.started_at: float | None = None
        self.finished_at: float | None = None  # when the phase turned terminal
        self.nodes: tuple[str, ...] = config.node_ids
        self.spares: tuple[str, ...] = config.spare_node_ids
        self.history: list[RestartRecord] = []
        self.record = JobRecord()
        self.avoid_hosts: tuple[str, ...] = ()
        self._hosts: dict[str, str] = {}
        self._node_fault_times: dict[str, list[float]] = {}
        # Set when a stop was asked for from outside (delete, Ctrl-C, deadline).
        self._cancel: tuple[JobPhase, str] | None = None
        self.checkpoints = CheckpointPlanner(config.durable, config.world_size, 0.0)
        # Each rank's pace in the current attempt (`stragglers.paces()`), and stragglers.
        self.stragglers = StragglerWatch(config.straggler_threshold, config.straggler_window)
        # Set once every rank exited 0: until then the last checkpoint may still persist.
        self._final_persist_until: float | None = None
        # Each node's health (deep checks, monitors' findings): control/health.py.
        self.health = HealthBook()
        # Elastic training (control/elastic.py): the sizing watch, the node ids left to
        # grow onto, and the platform's capacity (nodes the job may use; None: unknown)
        # and the nodes being taken away, as of the latest look.
        self.elastic = ElasticWatch(config.elastic) if config.elastic is not None else None
        self.growth: tuple[str, ...] = config.elastic_node_ids
        self.capacity: int | None = None
        self.preempted: tuple[str, ...] = ()

    # -- queries -------------------------------------------------------------------------------

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def restarts(self) -> int:
        return len(self.history)

    @property
    def full_restarts(self) -> int:
        return sum(1 for r in self.history if r.scope is RestartScope.JOB)

    @property
    def timeline(self) -> Timeline:
        return self.record.timeline

    def drain_events(self) -> list[Event]:
        """Events recorded since the last call, oldest first."""
        return self.record.drain()

    # -- inputs --------------------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """Launch every node of the job; the first attempt starts once they all answer."""
        if self.phase is not JobPhase.PENDING:
            raise RuntimeError(f"job already started (phase {self.phase})")
        self.started_at = now
        self.checkpoints = CheckpointPlanner(self.config.durable, self.config.world_size, now)
        self._event(now, EventKind.JOB_STARTED, f"job {self.config.job_id} started")
        return self._new_attempt(now, NextAttempt(RestartScope.PROCESS, self.nodes), {})

    def cancel(self, now: float, reason: str, phase: JobPhase = JobPhase.STOPPED) -> list[Action]:
        """Stop the job from outside (user delete, Ctrl-C, deadline). Idempotent."""
        if self.phase.terminal or self._cancel is not None:
            return []
        self._cancel = (phase, reason)
        self._event(now, EventKind.STOP_REQUESTED, reason)
        attempt = self.current
        if attempt is None:
            return self._finish(now, phase, reason)
        if attempt.phase is AttemptPhase.LAUNCHING:  # nothing started yet
            ended = Decision(end=(AttemptPhase.STOPPED, reason), finish=(phase, reason))
            return self._apply(now, attempt, ended, {})
        if attempt.phase is not AttemptPhase.RUNNING:
            return []
        stop = Decision(phase=JobPhase.STOPPING, stop=Stop(StopMode.GRACEFUL, reason))
        return self._apply(now, attempt, stop, {})

    def take_over(self, now: float, t: Takeover) -> list[Action]:
        """Begin as the successor of a controller that died (control/resume.py)."""
        if self.attempts or self.phase is not JobPhase.PENDING:
            raise RuntimeError(f"job already started (phase {self.phase})")
        self.started_at, self.phase = t.started_at, t.phase
        self.nodes, self.spares, self.growth = t.nodes, t.spares, t.growth
        self.history, self.attempts = list(t.history), list(t.attempts)
        if self.elastic is not None and t.elastic is not None:  # the sizing watch's memory
            e, watch = t.elastic, self.elastic
            watch.failures, watch.last_scaling, watch.target = e.failures, e.last_scaling, e.target
        self.record.timeline.records = list(t.faults)
        world = len(t.nodes) * self.config.nproc_per_node  # an elastic job's, not the spec's
        self.checkpoints = CheckpointPlanner(self.config.durable, world, now)
        self._notes(now, [t.event])
        return [] if t.next is None else self._new_attempt(now, t.next, {})

    def set_capacity(
        self, capacity: int | None, preempted: Sequence[str] = (), taken_as: str = "preempted"
    ) -> None:
        """What the platform can give the job now: ``capacity`` nodes (None: unknown),
        ``preempted`` being taken away (elastic jobs scale to it), as ``taken_as`` says."""
        self.capacity, self.preempted = capacity, tuple(preempted)
        if self.elastic is not None:
            self.elastic.taken_as = taken_as

    def replace_nodes(self, now: float, requests: Sequence[tuple[str, str]]) -> None:
        """Someone outside asked for these nodes (``(node id, why)``) to be replaced (by
        hand, a node label): each becomes UnschedulablePendingReplacement, and its fault
        stops the attempt at the next look, like a monitor's finding."""
        attempt = self.current
        if attempt is None or self.phase.terminal:
            return
        for node_id, reason in requests:
            if node_id in self.nodes:
                self._notes(now, self.health.replace(now, attempt.number, node_id, reason))

    def note_injection(
        self, now: float, spec: str, rank: int | None, node: str | None, step: int | None = None
    ) -> None:
        """A fault was injected on purpose (at ``step``, when known); the next fault
        detected is marked as injected."""
        attempt = self.current.number if self.current is not None else None
        self.record.injection(now, spec, rank, node, attempt, step)

    def observe(
        self,
        now: float,
        reports: Mapping[str, NodeReport],
        refusals: Sequence[Refusal] = (),
    ) -> list[Action]:
        """Feed what the platform sees now (a report per node, the requests agents refused
        since the last call); returns what to do now."""
        attempt = self.current
        if attempt is None or self.phase.terminal:
            return []
        for node_id, report in reports.items():
            if report.host:
                self._hosts[node_id] = report.host
        deadline = self.config.active_deadline_seconds
        if (
            deadline is not None
            and self.started_at is not None
            and now - self.started_at > deadline
            and self._cancel is None
        ):
            return self.cancel(
                now,
                f"DeadlineExceeded: job ran longer than activeDeadlineSeconds={deadline:g}",
                phase=JobPhase.FAILED,
            )
        self.record.worker_events(attempt, reports)
        health_faults, notes = self.health.observe(now, attempt.number, reports)
        self._notes(now, notes)
        for r in refusals:
            if r.request == "persist":
                self._notes(now, [self.checkpoints.refused(now, r.node_id, r.message)])
        if attempt.phase is AttemptPhase.RUNNING:
            return self._observe_running(now, attempt, reports, refusals, health_faults)
        if attempt.phase is AttemptPhase.STOPPING:
            # Steps its ranks completed before the fault, read since: the step it reached.
            attempt.watch.observe_progress(attempt.watch.current(attempt.assignments, reports))
            self.record.reached(attempt)
            planned = lifecycle.stopping(self._view(now, attempt, reports), health_faults)
        elif attempt.phase is AttemptPhase.LAUNCHING:
            planned = lifecycle.launching(self._view(now, attempt, reports), health_faults)
        else:
            return []
        return self._apply(now, attempt, planned, reports)

    def pace(self, now: float, reports: Mapping[str, NodeReport]) -> float:
        """Seconds until the controller wants fresh reports (control/pace.py)."""
        limit = self.config.active_deadline_seconds
        started = self.started_at
        busy = self.phase is not JobPhase.RUNNING or self._cancel is not None
        return poll_pace(
            self.config,
            self.current,
            now,
            reports,
            busy=busy or self.checkpoints.busy,
            deadline=started + limit if limit is not None and started is not None else None,
        )

    # -- running -------------------------------------------------------------------------------

    def _observe_running(
        self,
        now: float,
        attempt: Attempt,
        reports: Mapping[str, NodeReport],
        refusals: Sequence[Refusal],
        health_faults: Sequence[Fault] = (),
    ) -> list[Action]:
        current = attempt.watch.current(attempt.assignments, reports)
        faults = attempt.watch.faults(now, attempt.assignments, reports, current)
        faults += refusal_faults(now, attempt.number, refusals)
        faults += health_faults
        faults += self._stragglers(now, attempt, current)
        faults += self._exit_hangs(now, attempt, current)
        actions: list[Action] = []
        if isinstance(attempt.activity, Rejoining) and not faults:
            rejoin, faults = recovery.watch_rejoin(self._view(now, attempt, reports))
            actions += self._apply(now, attempt, rejoin, reports)
        self.record.progress(now, attempt)
        planned = lifecycle.faulted(self._view(now, attempt, reports), faults)
        if planned is not None:
            return [*actions, *self._apply(now, attempt, planned, reports)]
        requests, notes = self.checkpoints.observe(now, attempt.nodes, reports)
        self._notes(now, notes)
        actions += requests
        if len(current) == len(attempt.assignments) and all(
            status.state is NodeState.COMPLETED for _, status in current
        ):
            return actions + self._apply(
                now, attempt, Decision(complete="all ranks completed"), reports
            )
        if self.elastic and not isinstance(attempt.activity, Rejoining) and self._cancel is None:
            looked = rescale.look(self._view(now, attempt, reports))  # in place, or a stop
            actions += self._apply(now, attempt, looked, reports)
        return actions

    def _stragglers(
        self, now: float, attempt: Attempt, current: Sequence[tuple[str, NodeStatus]]
    ) -> list[Fault]:
        """Record each new straggler; with ``stragglerAction: restart``, each is a fault."""
        found = self.stragglers.observe_statuses(attempt.number, current)
        for s in found:
            self._event(
                now, EventKind.STRAGGLER, s.message, attempt.number, s.node, s.rank, s.to_json()
            )
        if self.config.straggler_action != "restart":
            return []
        progress = attempt.watch.progress
        return [s.fault(now, attempt.number, progress.step if progress else None) for s in found]

    def _exit_hangs(
        self, now: float, attempt: Attempt, current: Sequence[tuple[str, NodeStatus]]
    ) -> list[Fault]:
        """A rank that outlives the others, idle (control/exit_hang.py): an ExitHang fault;
        one that lingers but computes: a Lingering event, once per bound."""
        if isinstance(attempt.activity, Rejoining | Rescaling):
            return []
        watch = attempt.watch
        found = watch.exits.observe(now, len(attempt.assignments), current, watch.progress)
        if found is None:
            return []
        if not found.hung:
            node, rank = found.one()
            data = {"ranks": [r for _, r in found.busy], "bound": found.bound}
            self._event(
                now, EventKind.LINGERING, found.message(now), attempt.number, node, rank, data
            )
            return []
        return [found.fault(now, attempt.number, watch.progress.step if watch.progress else None)]

    # -- decisions carried out -----------------------------------------------------------------

    def _view(self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport]) -> JobView:
        """The job as the planners see it now (control/decision.py)."""
        known = (*self.nodes, *self.spares)
        unusable = {n: why for n in known if (why := self.health.unusable(n)) is not None}
        fault_times = {n: tuple(times) for n, times in self._node_fault_times.items()}
        return JobView(
            now, self.config, attempt, attempt.activity, reports, self.nodes, self.spares,
            self.growth, self.avoid_hosts, tuple(self.history), tuple(self.attempts),
            dict(self._hosts), fault_times, unusable, self.capacity, self.preempted,
            self.elastic, self._cancel,
        )  # fmt: skip

    def _apply(
        self, now: float, attempt: Attempt, d: Decision, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        """Carry a planner's decision out: the one place the job's pool, phase and
        restart history change after a look (see :class:`Decision` for the order)."""
        self.elastic = d.elastic or self.elastic
        attempt.activity = d.activity or attempt.activity
        self.spares = self.spares if d.spares is None else d.spares
        self.growth = self.growth if d.growth is None else d.growth
        self.avoid_hosts = self.avoid_hosts if d.avoid_hosts is None else d.avoid_hosts
        if d.nodes is not None:
            self.nodes = d.nodes
            self.checkpoints.world_size = len(d.nodes) * self.config.nproc_per_node
        self.phase = d.phase or self.phase
        for fault in d.faults:
            self._record_fault(now, attempt, fault)
        self._notes(now, [self.health.relaunch(n) for n in d.relaunch])
        if d.end is not None:
            self._end_attempt(now, attempt, *d.end, reports)
        if d.scope is not None:
            if d.counted:
                self.history.append(RestartRecord(now, d.scope))
            self.timeline.set_scope(attempt.number, d.scope.value)
        self._notes(now, d.events)
        actions = list(d.actions)
        if d.stop is not None:
            actions.append(self._stop(now, attempt, d.stop.mode, d.stop.reason, d.stop.capture))
        if d.stop_deadline is not None:
            attempt.stop_deadline = d.stop_deadline
        if d.finish is not None:
            actions += self._finish(now, *d.finish)
        elif d.complete is not None:
            actions += self._complete(now, attempt, reports, d.complete)
        elif d.start:
            actions.append(self._start_attempt(now, attempt))
        elif isinstance(d.next, NextAttempt):
            actions += self._new_attempt(now, d.next, reports)
        elif isinstance(d.next, InPlace):
            actions += self._in_place(now, attempt, d.next)
        if d.then is not None:
            actions += self._apply(now, attempt, d.then, reports)
        return actions

    def _new_attempt(
        self, now: float, plan: NextAttempt, reports: Mapping[str, NodeReport]
    ) -> list[Action]:
        """The next attempt on ``self.nodes``: launch ``plan.launch`` first, or start at
        once if all are up."""
        number = len(self.attempts)
        attempt = Attempt(number, now, self.nodes, new_watch(self.config, number, now), plan.scope)
        attempt.activity = plan.activity or Training()
        self.attempts.append(attempt)
        actions: list[Action] = [RetireNodes(plan.retire)] if plan.retire else []
        if launch := plan.launch:
            attempt.launch_deadline = now + self.config.node_start_timeout
            actions.append(LaunchNodes(launch, number, self.avoid_hosts, keep=plan.keep))
            kept = f" (the live agents of {', '.join(plan.keep)} may be kept)" if plan.keep else ""
            message = f"attempt {number}: bringing up {len(launch)} node agents{kept}"
            data = {"nodes": list(launch), "avoid_hosts": list(self.avoid_hosts)}
            self._event(now, EventKind.NODES_LAUNCHING, message, number, data=data)
            return actions
        planned = lifecycle.launching(self._view(now, attempt, reports))
        return actions + self._apply(now, attempt, planned, reports)

    def _start_attempt(
        self, now: float, attempt: Attempt, host: StoreEndpoint | None = None
    ) -> StartNodes:
        """Start ``attempt`` on its nodes; ``host``: the rendezvous to keep (an attempt in
        place whose rank 0 keeps its process keeps serving its store: a new port would
        have to be bound, and may be taken by then), else the platform's for node 0."""
        cfg = self.config
        endpoint = self._endpoint_for(attempt.number, attempt.nodes[0])
        if host is not None and not endpoint.hosted:
            endpoint = host  # a hosted store is never kept: the service opens a fresh one
        attempt.endpoint = endpoint
        sources = self._replica_sources(attempt)
        attempt.assignments = assign_attempt(cfg, attempt.nodes, attempt.number, endpoint, sources)
        attempt.watch = new_watch(cfg, attempt.number, now)  # hang timers start with the workers
        self._event(
            now,
            EventKind.ATTEMPT_STARTED,
            f"attempt {attempt.number}: {len(attempt.nodes)} nodes x {cfg.nproc_per_node} ranks "
            f"({attempt.scope} scope), rendezvous {endpoint.addr}:{endpoint.port}",
            attempt=attempt.number,
            data={
                "master_addr": endpoint.addr,
                "master_port": endpoint.port,
                "scope": attempt.scope.value,
                "nodes": list(attempt.nodes),
            },
        )
        attempt.phase, self.phase = AttemptPhase.RUNNING, JobPhase.RUNNING
        return StartNodes(attempt.number, attempt.assignments, attempt.scope)

    def _replica_sources(self, attempt: Attempt) -> dict[str, str]:
        """The nodes of ``attempt`` that took another's place since ranks last ran (a spare
        for a lost node, swapped at a restart or at launch), and whose: their ranks restore
        from that node's memory-tier replicas. Empty in place: there the ranks a spare takes
        get their state from a peer (control/replace.py), and no checkpoint is read."""
        if attempt.scope is RestartScope.IN_PROCESS:
            return {}
        ran = next(
            (a for a in reversed(self.attempts) if a.number < attempt.number and a.assignments),
            None,
        )
        return {} if ran is None else replica_sources(ran.nodes, attempt.nodes)

    def _in_place(self, now: float, ended: Attempt, plan: InPlace) -> list[Action]:
        """The attempt after ``ended``, in place on ``self.nodes`` (:class:`InPlace`)."""
        number = len(self.attempts)
        new = Attempt(
            number, now, self.nodes, new_watch(self.config, number, now), RestartScope.IN_PROCESS
        )
        new.activity = Rejoining(Rejoin(now, plan.survivors))
        self.attempts.append(new)
        started = self._start_attempt(now, new, plan.host)
        kept = tuple(a for a in started.assignments if a.node_id not in plan.added)
        actions: list[Action] = [RejoinNodes(started.attempt, kept)]
        if plan.added:
            fresh = tuple(a for a in started.assignments if a.node_id in plan.added)
            actions.append(StartNodes(started.attempt, fresh, started.scope))
        if plan.dropped:
            actions.append(RetireNodes(plan.dropped))
        return actions

    def _stop(
        self, now: float, attempt: Attempt, mode: StopMode, reason: str, capture: bool = False
    ) -> StopNodes:
        attempt.phase = AttemptPhase.STOPPING
        attempt.reason = attempt.reason or reason
        attempt.watch.pause(now)
        grace = self.config.stop_grace_seconds if mode is StopMode.GRACEFUL else 0.0
        notice = 0.0  # an elastic scaling: ranks that read requests save and exit first
        if attempt.scale is not None and self.config.elastic is not None:
            notice = self.config.elastic.graceful_shutdown_timeout
        attempt.stop_allowance = notice + grace + self.config.stop_slack_seconds
        message = f"stopping all ranks of attempt {attempt.number} ({mode}): {attempt.reason}"
        data = {"mode": mode.value, "capture_stacks": capture}
        self._event(now, EventKind.STOPPING_ALL, message, attempt.number, data=data)
        return StopNodes(attempt.number, attempt.nodes, mode, grace, capture, notice)

    def _complete(
        self, now: float, attempt: Attempt, reports: Mapping[str, NodeReport], reason: str
    ) -> list[Action]:
        """The job succeeds once its newest checkpoint is durable (or the wait is over)."""
        actions: list[Action] = []
        if self._final_persist_until is None:
            self._final_persist_until = now + self.config.final_persist_timeout
        checkpoints = self.checkpoints
        notes: list[Note | None] = [*checkpoints.settle(now, attempt.nodes, reports)]
        if now < self._final_persist_until:
            final = checkpoints.flush(now, attempt.nodes, reports)
            if final is not None:
                request, note = final
                notes.append(note)
                actions.append(request)
            if checkpoints.busy:  # the newest checkpoint is on its way to durable storage
                self._notes(now, notes)
                return actions
        else:
            timeout = self.config.final_persist_timeout
            why = f"not committed within the {timeout:g} s the job's end waits for it"
            notes.append(checkpoints.give_up(now, why))
        notes.append(checkpoints.shortfall())
        self._notes(now, notes)
        self._end_attempt(now, attempt, AttemptPhase.SUCCEEDED, "all ranks exited 0", reports)
        return [*actions, *self._finish(now, JobPhase.SUCCEEDED, reason)]

    # -- records -------------------------------------------------------------------------------

    def _notes(self, now: float, notes: Iterable[Note | None]) -> None:
        """Record the events of the planners, the health book and the checkpoint planner."""
        for n in notes:
            if n is not None:
                self._event(
                    now, n.kind, n.message, n.attempt, n.node, data=dict(n.data or {}) or None
                )

    def _record_fault(self, now: float, attempt: Attempt, fault: Fault) -> None:
        fault = self.record.fault(now, attempt, fault)
        if fault.node is not None:
            self._node_fault_times.setdefault(fault.node, []).append(fault.time)

    def _end_attempt(
        self, now: float, attempt: Attempt, phase: AttemptPhase, reason: str,
        reports: Mapping[str, NodeReport],
    ) -> None:  # fmt: skip
        """End ``attempt``, the stacks its agents captured attached to its hangs."""
        self.record.attach_stacks(attempt, reports)
        attempt.phase = phase
        attempt.ended_at = now
        attempt.reason = attempt.reason or reason
        message = f"attempt {attempt.number} {phase.value.lower()}: {attempt.reason}"
        data = {"outcome": str(phase)}
        self._event(now, EventKind.ATTEMPT_ENDED, message, attempt.number, data=data)

    def _finish(self, now: float, phase: JobPhase, reason: str) -> list[Action]:
        self.phase = phase
        self.reason = reason
        self.finished_at = now
        self._event(now, EventKind(f"Job{phase.value}"), reason)
        return [Finish(phase, reason)]

    def _event(
        self,
        now: float,
        kind: EventKind,
        message: str,
        attempt: int | None = None,
        node: str | None = None,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        if attempt is None and self.attempts:
            attempt = self.attempts[-1].number
        self.record.event(now, kind, message, attempt, node, rank, data)
