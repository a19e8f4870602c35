"""The agent's supervisor: one long-lived thread that owns the node's workers.

HTTP handlers never touch processes. They check and update the status under a lock (so
a second ``/start`` is refused at once) and queue a command; the supervisor thread
executes commands in order and watches the running attempt. Workers are forked by this
thread only, because their parent-death signal fires when the forking *thread* exits.

Report first, clean up after: the moment a worker exits (a pidfd wakes this thread),
its exit and error message are recorded, the node turns ``faulted`` (or ``completed``)
and the :class:`~trainguard.agent.reporter.Reporter` pushes that to the controller. The
failed worker's peers keep running: whether they stop, or rejoin an in-process restart,
is the controller's decision, which comes back as ``/stop`` or ``/rejoin``.
"""

from __future__ import annotations

import logging
import queue
import signal
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.agent.api import Refused
from trainguard.agent.board import NodeBoard, StartRefused
from trainguard.agent.controller_watch import ControllerWatch
from trainguard.agent.exits import ExitWatcher
from trainguard.agent.inject import FAST_TAIL_INTERVAL, StepInjector
from trainguard.agent.inprocess import Replaced, ResilientGroup
from trainguard.agent.logs import Console, LinesHook, LogLayout, LogTailer
from trainguard.agent.monitoring import build_monitor
from trainguard.agent.persist import MEMORY_DIR_ENV, DurablePersister, make_persister
from trainguard.agent.replica_push import ReplicaPusher
from trainguard.agent.replicas import restore_from_peers
from trainguard.agent.reporter import Reporter
from trainguard.agent.train_scripts import run_train_script
from trainguard.agent.warm import FRESH_STARTS, Spawner, StartOptions
from trainguard.agent.workers import WorkerGroup
from trainguard.elastic.request import AGREED_SUFFIX, ARMED_SUFFIX, ELASTIC_FILE_ENV
from trainguard.monitor.heartbeat import HEARTBEAT_DIR_ENV
from trainguard.monitor.stacks import capture_stacks
from trainguard.monitor.worker_events import EVENT_DIR_ENV
from trainguard.wire.control_files import ProtocolError, read_ack

if TYPE_CHECKING:
    from trainguard.agent.health import HealthKeeper
from trainguard.wire.requests import (
    AssignRequest,
    AttachRequest,
    AttemptRequest,
    InjectRequest,
    NodeAssignment,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)
from trainguard.wire.status import NodeState, NodeStatus, WorkerState, WorkerStatus

logger = logging.getLogger(__name__)

__all__ = ["AgentSupervisor", "AgentTimings", "Refused", "StartRefused"]


@dataclass(frozen=True)
class AgentTimings:
    """Every interval and timeout of the agent, in seconds, with its default."""

    poll_interval: float = 0.1  # how often the supervisor looks at its workers unwoken
    # ... while every worker's exit wakes it (pidfds) and nothing else is awaited
    watched_interval: float = 2.0
    tail_interval: float = 0.25  # how often the tailer reads files its workers write to
    reap_timeout: float = 5.0  # wait for a process to vanish after SIGKILL
    drain_timeout: float = 30.0  # wait for the tailer to drain the logs of an attempt
    shutdown_timeout: float = 20.0  # after a signal, exit even if the supervisor is stuck
    stack_timeout: float = 10.0  # py-spy's time to dump the workers' stacks before a stop


@dataclass(frozen=True)
class _Start:
    request: AttemptRequest


@dataclass(frozen=True)
class _Rejoin:
    request: AttemptRequest


@dataclass(frozen=True)
class _Replace:
    request: ReplaceRequest


@dataclass(frozen=True)
class _Stop:
    request: StopRequest
    # The attempt it stops, fixed when it was accepted: "whatever runs" means what ran
    # then, never an attempt started after it (-1: none had started).
    attempt: int


@dataclass(frozen=True)
class _Shutdown:
    reason: str


@dataclass(frozen=True)
class _Wake:
    """A worker exited: look now."""


_Command = _Start | _Rejoin | _Replace | _Stop | _Shutdown | _Wake


class AgentSupervisor:
    """Runs attempts on this node as commanded, and keeps the status."""

    def __init__(
        self,
        node_id: str,
        worker_argv: Sequence[str],
        layout: LogLayout,
        *,
        agent_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        console: Console | None = None,
        on_lines: LinesHook | None = None,
        timings: AgentTimings = AgentTimings(),
        token: str = "",
        incarnation: str = "",
        start_options: StartOptions = FRESH_STARTS,
        fence: Callable[[], str | None] = lambda: None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``start_options``: warm worker starts (see :mod:`trainguard.agent.warm`); off
        unless asked for, the agent's command line turns them on."""
        self.node_id = node_id
        self._fence = fence  # why the durable tier is off limits now (agent/lease.py)
        self._worker_argv = list(worker_argv)
        self._layout = layout
        self._agent_env = dict(agent_env or {})
        self._cwd = cwd
        self._console = console
        self._on_lines = on_lines
        self._timings = timings
        self._token = token  # the job's: pushes to the controller, replicas to peers
        self._commands: queue.Queue[_Command] = queue.Queue()
        self.board = NodeBoard(node_id, incarnation)
        self._reporter = Reporter(self.snapshot, token, tls=tls)
        self.board.on_news = self._reporter.nudge
        self._exits = ExitWatcher(lambda: self._commands.put(_Wake()))
        self._injector = StepInjector(on_fired=self._reporter.nudge)
        # The controller this agent lives for (None: it dies with its parent instead).
        self.controller: ControllerWatch | None = None
        # The node's health checks and monitors (agent/health.py); None: not asked for.
        self.health: HealthKeeper | None = None
        # A standby agent (``--standby``, a spare host's): no health checks and no attempt
        # until its host's daemon gives it to its node (``POST /assign``); its worker
        # template warms meanwhile.
        self.standby = False
        self._shutdown_requested = False
        self._group: WorkerGroup | None = None
        self._tailer: LogTailer | None = None
        self._pusher: ReplicaPusher | None = None
        self._persister: DurablePersister | None = None  # set by the first attempt
        self._start_options = start_options
        self._spawner: Spawner | None = None  # made on the supervisor thread
        self.restored_from: str | None = None
        self.done = threading.Event()
        self.on_done: Callable[[], None] = lambda: None  # called once ``done`` is set
        self._thread = threading.Thread(target=self._run, name="trainguard-supervisor", daemon=True)

    # -- called from any thread ------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self.health is not None and not self.standby:
            self.health.start()

    def request_assign(self, request: AssignRequest) -> None:
        """A standby agent is given to its node: it reports ``request.incarnation`` from
        now on, and runs its on-start checks (with ``request.peers``). :class:`Refused`
        if it is not a standby agent, or was given already."""
        if request.again:
            self._assign_again(request)
            return
        with self.board.lock:
            if not self.standby:
                raise Refused(f"this agent is not a standby agent ({self.board.incarnation})")
            if self._shutdown_requested:
                raise Refused("this agent is shutting down")
            self.standby = False
            self.board.incarnation = request.incarnation
            self.board.changed()
        if self.health is not None:
            if request.peers is not None:
                from trainguard.health.suite import Peers  # with the checks: only if asked for

                self.health.peers = Peers(*request.peers)
            self.health.start()
        logger.info("standby agent assigned as %s", request.incarnation)
        self._reporter.nudge()

    def _assign_again(self, request: AssignRequest) -> None:
        """This live agent takes its node's next incarnation (``request.again``): only
        idle (ready, or its attempt stopped), not shutting down, not a standby."""
        with self.board.lock:
            state = self.board.state
            if self.standby or self._shutdown_requested:
                raise Refused("a standby agent, or one shutting down, is not assigned again")
            if state not in (NodeState.READY, NodeState.STOPPED):
                raise Refused(f"this agent is {state.value}, not idle: it is not assigned again")
            old, self.board.incarnation = self.board.incarnation, request.incarnation
            self.board.changed()
        logger.info("assigned again: %s -> %s (its worker template kept)", old, request.incarnation)
        self._reporter.nudge()

    def health_news(self) -> None:
        """The node's health changed (a check finished, a monitor found something):
        a new status, pushed at once."""
        with self.board.lock:
            self.board.changed()
        self._reporter.nudge()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> NodeStatus:
        status = self.board.snapshot(self._persister)
        update: dict[str, object] = {}
        if injected := self._injector.fired:
            update["injected"] = injected
        if self.health is not None:
            update["health"] = self.health.report()
        spawner = self._spawner
        if spawner is None or spawner.warming:  # None: the template is not started yet
            update["warming"] = True
        return status.model_copy(update=update) if update else status

    def request_start(self, request: AttemptRequest) -> None:
        """Accept an attempt, or raise :class:`StartRefused` if workers may be alive.

        The same attempt again (a retried request) is accepted and changes nothing.
        """
        with self.board.lock:
            if self.standby:
                raise StartRefused("a standby agent takes no attempt before POST /assign")
            self._reporter.target(request.report_url)  # before any news of this attempt
            if self.board.admit_start(request.assignment, self._shutdown_requested):
                self._commands.put(_Start(request))

    def request_rejoin(self, request: AttemptRequest) -> None:
        """Start the request's attempt in place (an in-process restart): the live workers
        rejoin, dead ranks are replaced. :class:`Refused` unless this node runs resilient
        workers of an older attempt (the same attempt again is accepted, as a retry)."""
        with self.board.lock:
            self._reporter.target(request.report_url)
            if self.board.admit_rejoin(request.assignment, self._shutdown_requested):
                self._commands.put(_Rejoin(request))

    def request_replace(self, request: ReplaceRequest) -> None:
        """Give stuck ranks new processes in the current attempt; :class:`Refused` unless
        that attempt runs here and the ranks are this node's."""
        with self.board.lock:
            self.board.admit_replace(request)
            self._commands.put(_Replace(request))

    def request_stop(self, request: StopRequest) -> None:
        """Stop the request's attempt (None: whatever runs). Idempotent; another attempt is
        left alone."""
        with self.board.lock:
            if self.board.matches(request.attempt) and self.board.busy():
                self.board.set(NodeState.STOPPING, reason=f"stop requested ({request.mode})")
            target = request.attempt
            if target is None:
                target = self.board.attempt if self.board.attempt is not None else -1
            self._commands.put(_Stop(request, target))

    def request_persist(self, request: PersistRequest) -> None:
        """Persist this node's memory shards of a step in the background (see
        :mod:`trainguard.agent.persist`); :class:`Refused` without a durable tier."""
        with self.board.lock:
            persister, ranks = self._persister, list(self.board.ranks)
        if persister is None or not ranks:
            raise Refused("this node has no durable checkpoint tier (or no attempt started yet)")
        persister.request(request.step, request.world_size, request.commit, ranks)

    def request_inject(self, request: InjectRequest) -> None:
        """Hold these step injections (a rehearsal; see :mod:`trainguard.agent.inject`)."""
        self._injector.arm(request.injections)
        self._tail_fast_if_armed()

    def request_attach(self, request: AttachRequest) -> None:
        """A controller took the job over (``trainguard resume``): push to it, live for it."""
        self._reporter.target(request.report_url)
        if self.controller is not None:
            self.controller.attach(request.pid, request.start)
        logger.info("controller pid %d attached; reports go to %s", request.pid, request.report_url)
        self._reporter.nudge()

    def request_shutdown(self, reason: str) -> None:
        """Kill the workers and end the supervisor (then the agent exits)."""
        with self.board.lock:
            self._shutdown_requested = True
            self._commands.put(_Shutdown(reason))

    # -- the supervisor thread -------------------------------------------------

    def _run(self) -> None:
        try:
            # The template imports while the agent waits for its first start.
            self._spawner = Spawner(
                self._worker_argv,
                self._agent_env,
                self._cwd,
                self._layout.root / f"template-{self.node_id}.log",
                self._start_options,
                on_exit=lambda: self._commands.put(_Wake()),
            )
            while True:
                try:
                    command: _Command | None = self._commands.get(timeout=self._wait())
                except queue.Empty:
                    command = None
                if isinstance(command, _Shutdown):
                    self._shutdown(command.reason)
                    return
                if isinstance(command, _Start):
                    self._start(command.request)
                elif isinstance(command, _Rejoin):
                    self._rejoin(command.request.assignment)
                elif isinstance(command, _Replace):
                    self._replace(command.request)
                elif isinstance(command, _Stop):
                    self._stop(command.request, command.attempt)
                if self._group is not None:
                    self._check_workers()
        except Exception:
            logger.exception("supervisor failed; killing workers")
            with self.board.lock:
                self.board.set(NodeState.SHUTDOWN, reason="agent supervisor failed")
            # If this fails too, the agent exits and the workers' death signal kills them.
            self._end_attempt(signal.SIGKILL, 0.0)
        finally:
            self._injector.close()
            if self._spawner is not None:
                self._spawner.close()
            self._exits.close()
            self._reporter.close()
            self.done.set()
            self.on_done()

    def _start(self, request: AttemptRequest) -> None:
        if self._shutdown_requested:
            return
        assignment = request.assignment
        monitor = build_monitor(assignment.monitor, on_detection=self._reporter.nudge)
        self._replicate(request)
        if self._persister is None:
            self._persister = make_persister(
                self._agent_env, assignment.job_id, lambda: self._group is not None, self._fence
            )
        beats_dir = self._layout.attempt_dir(assignment.attempt) / "heartbeats"
        beats_dir.mkdir(parents=True, exist_ok=True)
        events_dir = beats_dir.parent / "events"
        events_dir.mkdir(exist_ok=True)
        kind = ResilientGroup if assignment.in_process else WorkerGroup
        group = kind(
            assignment,
            self._worker_argv,
            self._layout,
            agent_env={
                **self._agent_env,
                HEARTBEAT_DIR_ENV: str(beats_dir),
                EVENT_DIR_ENV: str(events_dir),
                # trainguard.elastic: created when a scaling asks the ranks to save and exit.
                ELASTIC_FILE_ENV: str(self._scale_request(assignment.attempt)),
            },
            cwd=self._cwd,
            reap_timeout=self._timings.reap_timeout,
            spawned=self._exits.watch,
            spawner=self._spawner,
        )
        with self.board.lock:
            self.board.attach(monitor, beats_dir, group)
        failure = self._run_script("pre-train", self._start_options.scripts.pre)
        if failure is not None:
            group.finish()
            with self.board.lock:
                self.board.set(NodeState.FAULTED, reason=failure)
            return
        logger.info("starting attempt %d: ranks %s", assignment.attempt, assignment.global_ranks)
        try:
            pids = group.start()
        except Exception as exc:
            logger.exception("could not start the workers of attempt %d", assignment.attempt)
            group.finish()
            with self.board.lock:
                self.board.set(NodeState.FAULTED, reason=f"could not start workers: {exc}")
            return
        self._group = group
        self._tailer = LogTailer(
            self._layout,
            assignment.attempt,
            group.ranks,
            interval=self._timings.tail_interval,
            console=self._console,
            on_lines=_both(
                _both(self.board.monitor_lines, self._injector.on_lines), self._on_lines
            ),
            limits=assignment.monitor.logs,
        )
        self._injector.attempt(
            assignment.monitor.progress_pattern,
            {group.ranks[local]: pid for local, pid in pids.items()},
        )
        self._tail_fast_if_armed()
        self._tailer.start()
        workers = {
            local: WorkerStatus(
                local_rank=local, rank=rank, pid=pids.get(local), state=WorkerState.RUNNING
            )
            for local, rank in group.ranks.items()
        }
        with self.board.lock:
            # A stop may have been accepted meanwhile: then stay "stopping".
            state = NodeState.RUNNING if self.board.state is NodeState.STARTING else None
            self.board.set(state or self.board.state, workers=workers)

    def _replicate(self, request: AttemptRequest) -> None:
        """Before the workers start: refill an empty memory tier from a replica peer (the
        replica of the node that last ran these ranks: this one, or the one it replaces),
        then keep pushing this node's memory tier to its replica peers."""
        if self._pusher is not None:
            self._pusher.stop()
            self._pusher = None
        memory_dir = self._agent_env.get(MEMORY_DIR_ENV)
        wanted = request.assignment.replica_peers
        peers = {n: request.peers[n] for n in wanted if n in request.peers}
        if not memory_dir or not peers or not self._token:
            return
        source = request.assignment.replica_source or self.node_id  # whose ranks it runs
        restored = restore_from_peers(self.node_id, Path(memory_dir), peers, self._token, source)
        if restored is not None:
            self.restored_from = restored
            logger.info(
                "memory tier of %s restored from %s's replica of %s",
                self.node_id, restored, source,
            )  # fmt: skip
        urls = list(peers.values())
        self._pusher = ReplicaPusher(self.node_id, Path(memory_dir), urls, self._token)
        self._pusher.start()

    def _rejoin(self, assignment: NodeAssignment) -> None:
        group = self._group
        if not isinstance(group, ResilientGroup):
            with self.board.lock:
                self.board.set(NodeState.FAULTED, reason="in-process restart: no workers")
            return
        # A survivor's step lines of the attempt before, read after this point, are not
        # this attempt's progress: a rank's count once it acknowledged this attempt.
        control_dir, number = group.control_dir, assignment.attempt

        def joined(rank: int) -> bool:
            try:
                ack = read_ack(control_dir, rank)
            except ProtocolError:  # being replaced as it is read: not yet
                return False
            return ack is not None and ack.attempt >= number

        monitor = build_monitor(
            assignment.monitor, on_detection=self._reporter.nudge, joined=joined
        )
        with self.board.lock:
            self.board.monitor = monitor
        before = dict(group.ranks)
        replaced = group.rejoin(assignment)
        if group.ranks != before:  # an elastic scaling in place renumbered them
            logger.info("attempt %d: ranks %s are now %s", assignment.attempt,
                        sorted(before.values()), sorted(group.ranks.values()))  # fmt: skip
            if self._tailer is not None:
                self._tailer.relabel(group.ranks)
            self._injector.attempt(
                assignment.monitor.progress_pattern,
                {group.ranks[local]: pid for local, pid in group.pids().items()},
            )
        self._took_over(group, replaced)

    def _replace(self, request: ReplaceRequest) -> None:
        group = self._group
        if not isinstance(group, ResilientGroup) or group.assignment.attempt != request.attempt:
            return  # the attempt moved on since the request was accepted
        logger.warning(
            "attempt %d: ranks %s are stuck in the failed attempt; replacing them",
            request.attempt,
            list(request.ranks),
        )
        self._took_over(group, group.replace(request.ranks))

    def _took_over(self, group: ResilientGroup, replaced: Replaced) -> None:
        """New processes run these local ranks now: follow their output, report them."""
        for local, (pid, paths, how) in replaced.items():
            if self._tailer is not None:
                self._tailer.follow(local, group.ranks[local], paths)
            logger.info(
                "attempt %d: rank %d taken over by a %s (pid %d)",
                group.assignment.attempt, group.ranks[local], how, pid,
            )  # fmt: skip
        self._injector.took_over(
            {group.ranks[local]: pid for local, (pid, _, _) in replaced.items()}
        )
        with self.board.lock:
            self.board.took_over({local: pid for local, (pid, _, _) in replaced.items()})

    def _tail_fast_if_armed(self) -> None:
        tailer, group = self._tailer, self._group
        if tailer is not None and group is not None:
            armed = self._injector.armed_for(list(group.ranks.values()))
            tailer.interval = FAST_TAIL_INTERVAL if armed else self._timings.tail_interval

    def _wait(self) -> float:
        """How long to wait for a command before looking at the workers unwoken: long
        where each worker's exit wakes the supervisor (pidfds), else ``poll_interval``."""
        group = self._group
        if group is not None and self._exits.supported and not group.settling():
            return self._timings.watched_interval
        return self._timings.poll_interval

    def _check_workers(self) -> None:
        """Record exits at once; report; clean up only once every worker has exited."""
        group = self._group
        assert group is not None
        exits = group.poll()
        if not exits:
            return
        self._record_exits(exits, stopped=False)
        failed = sorted((group.ranks[local], local) for local, code in exits.items() if code != 0)
        if failed:
            rank, local = failed[0]
            logger.warning("rank %d exited with %d", rank, exits[local])
        with self.board.lock:
            first = next(
                (w for w in self.board.workers.values() if w.state is WorkerState.FAILED), None
            )
            if first is not None and self.board.state is not NodeState.FAULTED:
                self.board.set(NodeState.FAULTED, reason=first.describe_exit())
            completed = first is None and group.all_exited()
            stopping = self.board.state is NodeState.STOPPING
        if completed:  # the post-train script first: its failure is the node's fault
            failure = None if stopping else self._run_script("post-train", self._post_train)
            with self.board.lock:
                if failure is not None:
                    self.board.set(NodeState.FAULTED, reason=failure)
                else:
                    self.board.set(NodeState.COMPLETED, reason=None)
        if group.all_exited():
            self._finish_attempt()
            logger.info("attempt %d %s", group.assignment.attempt, self.board.state.value)

    @property
    def _post_train(self) -> tuple[str, ...]:
        return self._start_options.scripts.post

    def _run_script(self, phase: str, argv: tuple[str, ...]) -> str | None:
        """Run the node's ``phase`` script if it has one: None, or why it failed."""
        if not argv:
            return None
        log_file = self._layout.root / f"{self.node_id}-{phase}.log"
        return run_train_script(phase, argv, self._agent_env, self._cwd, log_file)

    def _stop(self, request: StopRequest, attempt: int) -> None:
        with self.board.lock:
            if not self.board.matches(attempt):
                return  # a late stop for an attempt that is no longer current
            if self.board.state is not NodeState.STOPPING:
                self.board.set(NodeState.STOPPING, reason=f"stop requested ({request.mode})")
        logger.info("stopping attempt %s (%s)", self.board.attempt, request.mode)
        if request.capture_stacks and self._group is not None:
            group = self._group
            pids = {group.ranks[local]: pid for local, pid in group.pids().items()}
            stacks = capture_stacks(pids, self._timings.stack_timeout)
            with self.board.lock:
                self.board.stacks = stacks
        if request.notice > 0 and request.mode == "graceful":
            self._ask_to_scale(request.notice)
        if request.mode == "process" or request.timeout <= 0:
            self._end_attempt(signal.SIGKILL, self._timings.reap_timeout)
        else:
            self._end_attempt(signal.SIGTERM, request.timeout)
        with self.board.lock:
            self.board.set(NodeState.STOPPED)

    def _scale_request(self, attempt: int) -> Path:
        """The attempt's ``trainguard.elastic`` request file (created on a scaling)."""
        return self._layout.attempt_dir(attempt) / "scale-request"

    def _ask_to_scale(self, notice: float) -> None:
        """An elastic scaling: ask the ranks to save and exit (``trainguard.elastic``'s
        request file), and give those that read it (they left ``<file>.armed``) up to
        ``notice`` seconds to do so before they are signalled."""
        group = self._group
        if group is None or self.board.attempt is None:
            return
        request = self._scale_request(self.board.attempt)
        request.touch()
        if not Path(str(request) + ARMED_SUFFIX).exists():
            return  # an unmodified script: it is stopped at once
        deadline = time.monotonic() + notice
        while time.monotonic() < deadline and group.running():
            time.sleep(0.05)
        exits = group.poll()
        # A rank that agreed to the request and exited 0 stopped for the scaling; one
        # that exited 0 without it had finished its work (the job may be complete).
        agreed = Path(str(request) + AGREED_SUFFIX).exists()
        self._record_exits({r: c for r, c in exits.items() if c == 0}, stopped=agreed)
        self._record_exits({r: c for r, c in exits.items() if c != 0}, stopped=False)

    def _shutdown(self, reason: str) -> None:
        logger.info("shutting down: %s", reason)
        if self._pusher is not None:
            self._pusher.stop()
        if self._persister is not None:
            self._persister.close()
        with self.board.lock:
            if self.board.busy():
                self.board.set(NodeState.STOPPING, reason=reason)
        self._end_attempt(signal.SIGKILL, self._timings.reap_timeout)
        with self.board.lock:
            self.board.set(NodeState.SHUTDOWN, reason=reason)

    def _end_attempt(self, first_signal: signal.Signals, grace: float) -> None:
        """Close the running attempt's workers, if any, and drain its logs."""
        if self._group is None:
            return
        self._record_exits(self._group.poll(), stopped=False)
        self._record_exits(self._group.close(first_signal, grace), stopped=True)
        self._finish_attempt()

    def _finish_attempt(self) -> None:
        """Every worker has exited: collect error messages, drain the logs, drop the group."""
        assert self._group is not None
        errors = self._group.finish()
        if self._tailer is not None and not self._tailer.stop(self._timings.drain_timeout):
            logger.error("log tailer did not drain within %.0f s", self._timings.drain_timeout)
        self._group = None
        self._tailer = None
        if errors:
            with self.board.lock:
                self.board.errors(errors)

    def _record_exits(self, exits: dict[int, int], stopped: bool) -> None:
        """Record exits; ``stopped``: the agent caused them (a stop). A failed worker's
        error message is read now, before anything is reported."""
        group = self._group
        for local in exits:
            if self._tailer is not None:
                self._tailer.finish_rank(local)
        errors: dict[int, str | None] = {}
        tracebacks: dict[int, str | None] = {}
        if group is not None and not stopped:
            for local in (local for local, code in exits.items() if code != 0):
                errors[local] = group.error_message(local)
                tracebacks[local] = group.error_traceback(local)
        with self.board.lock:
            self.board.exited(exits, errors, stopped, tracebacks)


def _both(first: LinesHook, second: LinesHook | None) -> LinesHook:
    """One lines hook calling two (the monitor, then the agent's own hook if any)."""
    if second is None:
        return first

    def hook(rank: int, stream: str, block: bytes, t: float) -> None:
        first(rank, stream, block, t)
        second(rank, stream, block, t)

    return hook
