"""The agent's supervisor: one long-lived thread that owns the node's workers.

HTTP handlers never touch processes. They check and update the status under a
lock (so a second ``/start`` is refused at once) and queue a command; the
supervisor thread executes commands in order and polls the running attempt.
Workers are forked by this thread only, because their parent-death signal fires
when the forking *thread* exits.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from trainguard.agent.inprocess import Replaced, ResilientGroup
from trainguard.agent.logs import Console, LineHook, LogLayout, LogTailer
from trainguard.agent.monitoring import build_monitor
from trainguard.agent.persist import DurablePersister, DurableSettings
from trainguard.agent.replicas import ReplicaPusher, replica_peers, restore_from_peers
from trainguard.agent.status import (
    STOP_MODES,
    AgentState,
    AgentStatus,
    WorkerState,
    WorkerStatus,
    signal_name,
)
from trainguard.agent.workers import WorkerGroup
from trainguard.control.assignment import NodeAssignment
from trainguard.monitor.heartbeat import HEARTBEAT_DIR_ENV, read_heartbeats
from trainguard.monitor.rules import NodeLogMonitor
from trainguard.monitor.stacks import capture_stacks
from trainguard.monitor.worker_events import EVENT_DIR_ENV, read_events

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = "TRAINGUARD_CHECKPOINT_MEMORY_DIR"
CONFIG_ENV = "TRAINGUARD_CHECKPOINT_CONFIG"


@dataclass(frozen=True)
class AgentTimings:
    """Every interval and timeout of the agent, in seconds, with its default."""

    poll_interval: float = 0.1  # how often the supervisor checks its workers
    tail_interval: float = 0.1  # how often the tailer reads the workers' log files
    fault_grace: float = 5.0  # SIGTERM -> SIGKILL for the peers of a failed worker
    reap_timeout: float = 5.0  # wait for a process to vanish after SIGKILL
    drain_timeout: float = 30.0  # wait for the tailer to drain the logs of an attempt
    shutdown_timeout: float = 20.0  # after a signal, exit even if the supervisor is stuck
    stack_timeout: float = 10.0  # py-spy's time to dump the workers' stacks before a stop


class Refused(Exception):
    """A request the agent cannot take now."""


class StartRefused(Refused):
    """A ``/start`` while workers may still be alive (the caller must stop first)."""


@dataclass(frozen=True)
class _Start:
    assignment: NodeAssignment


@dataclass(frozen=True)
class _Stop:
    attempt: int | None
    mode: str
    timeout: float
    capture_stacks: bool = False


@dataclass(frozen=True)
class _Rejoin:
    assignment: NodeAssignment


@dataclass(frozen=True)
class _Shutdown:
    reason: str


_Command = _Start | _Stop | _Rejoin | _Shutdown


class _Keep(Enum):
    """Sentinel: leave this field of the status as it is."""

    KEEP = 0


class Supervisor:
    """Runs attempts on this node as commanded, and keeps the status snapshot."""

    def __init__(
        self,
        node_id: str,
        worker_argv: Sequence[str],
        layout: LogLayout,
        *,
        agent_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        console: Console | None = None,
        on_line: LineHook | None = None,
        timings: AgentTimings = AgentTimings(),
        token: str = "",
    ) -> None:
        self.node_id = node_id
        self._worker_argv = list(worker_argv)
        self._layout = layout
        self._agent_env = dict(agent_env or {})
        self._cwd = cwd
        self._console = console
        self._on_line = on_line
        self._timings = timings
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._lock = threading.Lock()
        self._state = AgentState.READY
        self._attempt: int | None = None
        self._reason: str | None = None
        self._workers: dict[int, WorkerStatus] = {}
        self._updated_at = time.time()
        self._shutdown_requested = False
        self._group: WorkerGroup | ResilientGroup | None = None
        self._tailer: LogTailer | None = None
        # Detection state of the current (or last) attempt, reported in the status.
        self._monitor: NodeLogMonitor | None = None
        self._heartbeat_dir: Path | None = None
        self._stacks: dict[int, str] = {}
        self._token = token  # the job's: this agent calls its peers for memory-tier replicas
        self._pusher: ReplicaPusher | None = None
        self._persister: DurablePersister | None = None  # set by the first attempt
        self._ranks: list[int] = []  # the global ranks of the latest attempt on this node
        self.restored_from: str | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-supervisor", daemon=True)

    # -- called from any thread ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> AgentStatus:
        with self._lock:
            monitor, beats_dir = self._monitor, self._heartbeat_dir
            status = AgentStatus(
                node_id=self.node_id,
                pid=os.getpid(),
                state=self._state,
                attempt=self._attempt,
                reason=self._reason,
                updated_at=self._updated_at,
                workers=tuple(self._workers[k] for k in sorted(self._workers)),
                stacks={str(rank): text for rank, text in sorted(self._stacks.items())},
            )
        # Outside the lock: the monitor has its own, and heartbeats are files.
        beats = read_heartbeats(beats_dir) if beats_dir is not None else {}
        events = read_events(beats_dir.parent / "events") if beats_dir is not None else []
        persister = self._persister
        return replace(
            status,
            monitor=monitor.snapshot() if monitor is not None else {},
            heartbeats={str(rank): beat.to_json() for rank, beat in sorted(beats.items())},
            events=tuple(e.to_json() for e in events),
            checkpoint=persister.status() if persister is not None else {},
        )

    def request_start(self, assignment: NodeAssignment) -> None:
        """Accept an attempt, or raise :class:`StartRefused` if workers may be alive."""
        with self._lock:
            if self._shutdown_requested or self._state is AgentState.SHUTDOWN:
                raise StartRefused("agent is shutting down")
            if self._state.is_active:
                raise StartRefused(
                    f"attempt {self._attempt} is {self._state.value}; stop it before starting "
                    f"attempt {assignment.attempt}"
                )
            self._set(AgentState.STARTING, attempt=assignment.attempt, reason=None, workers={})
            self._ranks = list(assignment.global_ranks)
            self._commands.put(_Start(assignment))

    def request_stop(
        self, attempt: int | None, mode: str, timeout: float, capture_stacks: bool = False
    ) -> None:
        """Stop ``attempt`` (None: whatever runs). Idempotent; another attempt is left alone.

        ``capture_stacks``: dump every worker's Python stack before stopping it.
        """
        if mode not in STOP_MODES:
            raise ValueError(f"mode: expected one of {', '.join(STOP_MODES)}, got {mode!r}")
        with self._lock:
            if self._state.is_active and self._matches(attempt):
                self._set(AgentState.STOPPING, reason=f"stop requested ({mode})")
            self._commands.put(_Stop(attempt, mode, timeout, capture_stacks))

    def request_rejoin(self, assignment: NodeAssignment) -> None:
        """Start ``assignment``'s attempt in place (an in-process restart): the live workers
        rejoin, dead ranks are replaced. :class:`Refused` unless this node runs resilient
        workers of an older attempt."""
        with self._lock:
            if self._shutdown_requested or self._state is AgentState.SHUTDOWN:
                raise Refused("agent is shutting down")
            if not assignment.in_process or self._state not in (
                AgentState.RUNNING,
                AgentState.FAULTED,
            ):
                raise Refused(
                    f"an in-process restart needs running resilient workers; this node is "
                    f"{self._state.value}"
                )
            if self._attempt is not None and assignment.attempt <= self._attempt:
                raise Refused(f"attempt {assignment.attempt} is not after {self._attempt}")
            self._set(AgentState.RUNNING, attempt=assignment.attempt, reason=None)
            self._ranks = list(assignment.global_ranks)
            self._commands.put(_Rejoin(assignment))

    def request_persist(self, step: int, world_size: int, commit: bool) -> None:
        """Persist this node's memory shards of ``step`` in the background (see
        :mod:`trainguard.agent.persist`); :class:`Refused` without a durable tier."""
        with self._lock:
            persister, ranks = self._persister, self._ranks
        if persister is None or not ranks:
            raise Refused("this node has no durable checkpoint tier (or no attempt started yet)")
        persister.request(step, world_size, commit, ranks)

    def request_shutdown(self, reason: str) -> None:
        """Kill the workers and end the supervisor (then the agent exits)."""
        with self._lock:
            self._shutdown_requested = True
            self._commands.put(_Shutdown(reason))

    # -- the supervisor thread -------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                try:
                    command = self._commands.get(timeout=self._timings.poll_interval)
                except queue.Empty:
                    command = None
                if isinstance(command, _Shutdown):
                    self._shutdown(command.reason)
                    return
                if isinstance(command, _Start):
                    self._start(command.assignment)
                elif isinstance(command, _Rejoin):
                    self._rejoin(command.assignment)
                elif isinstance(command, _Stop):
                    self._stop(command)
                if self._group is not None:
                    self._check_workers()
        except Exception:
            logger.exception("supervisor failed; killing workers")
            with self._lock:
                self._set(AgentState.SHUTDOWN, reason="agent supervisor failed")
            # If this fails too, the agent exits and the workers' death signal kills them.
            self._end_attempt(signal.SIGKILL, 0.0)
        finally:
            self.done.set()

    def _start(self, assignment: NodeAssignment) -> None:
        if self._shutdown_requested:
            return
        monitor = build_monitor(assignment.monitor)  # validated when the request came in
        self._replicate(assignment)
        if self._persister is None:
            self._persister = self._make_persister(assignment.job_id)
        beats_dir = self._layout.attempt_dir(assignment.attempt) / "heartbeats"
        beats_dir.mkdir(parents=True, exist_ok=True)
        events_dir = beats_dir.parent / "events"
        events_dir.mkdir(exist_ok=True)
        with self._lock:
            self._monitor, self._heartbeat_dir, self._stacks = monitor, beats_dir, {}
        kind = ResilientGroup if assignment.in_process else WorkerGroup
        group = kind(
            assignment,
            self._worker_argv,
            self._layout,
            agent_env={
                **self._agent_env,
                HEARTBEAT_DIR_ENV: str(beats_dir),
                EVENT_DIR_ENV: str(events_dir),
            },
            cwd=self._cwd,
            reap_timeout=self._timings.reap_timeout,
        )
        logger.info("starting attempt %d: ranks %s", assignment.attempt, assignment.global_ranks)
        try:
            pids = group.start()
        except Exception as exc:
            logger.exception("could not start the workers of attempt %d", assignment.attempt)
            with self._lock:
                self._set(AgentState.FAULTED, reason=f"could not start workers: {exc}")
            return
        self._group = group
        self._tailer = LogTailer(
            self._layout,
            assignment.attempt,
            group.ranks,
            interval=self._timings.tail_interval,
            console=self._console,
            on_line=_both(self._monitor_line, self._on_line),
        )
        self._tailer.start()
        workers = {
            local: WorkerStatus(local, rank, pids.get(local), WorkerState.RUNNING)
            for local, rank in group.ranks.items()
        }
        with self._lock:
            # A stop may have been accepted meanwhile: then stay "stopping".
            state = AgentState.RUNNING if self._state is AgentState.STARTING else self._state
            self._set(state, workers=workers)

    def _replicate(self, assignment: NodeAssignment) -> None:
        """Before the workers start: refill an empty memory tier from a peer, then keep
        pushing this node's memory tier to its replica peers."""
        if self._pusher is not None:
            self._pusher.stop()
            self._pusher = None
        memory_dir = self._agent_env.get(MEMORY_DIR_ENV)
        if not memory_dir or not assignment.peers or not self._token:
            return
        try:
            config = json.loads(self._agent_env.get(CONFIG_ENV) or "{}")
            replicas = int(config.get("replicas", 0))
        except (ValueError, TypeError, AttributeError):
            replicas = 0
        if replicas <= 0:
            return
        restored = restore_from_peers(self.node_id, Path(memory_dir), assignment.peers, self._token)
        if restored is not None:
            self.restored_from = restored
            logger.info("memory tier of %s restored from %s's replica", self.node_id, restored)
        peers = replica_peers(self.node_id, assignment.peers, replicas)
        self._pusher = ReplicaPusher(self.node_id, Path(memory_dir), peers, self._token)
        self._pusher.start()

    def _monitor_line(self, rank: int, stream: str, line: str, t: float) -> None:
        """Feed a worker line to the current attempt's monitor (an in-process restart
        replaces the monitor while the workers, and the tailer, go on)."""
        monitor = self._monitor
        if monitor is not None:
            monitor.on_line(rank, stream, line, t)

    def _rejoin(self, assignment: NodeAssignment) -> None:
        group = self._group
        if not isinstance(group, ResilientGroup):
            with self._lock:
                self._set(AgentState.FAULTED, reason="in-process restart: no resilient workers")
            return
        monitor = build_monitor(assignment.monitor)
        with self._lock:
            self._monitor = monitor
        self._took_over(group, group.rejoin(assignment))

    def _took_over(self, group: ResilientGroup, replaced: Replaced) -> None:
        """New processes run these local ranks now: follow their output, report them."""
        for local, (_, paths, _) in replaced.items():
            if self._tailer is not None:
                self._tailer.follow(local, group.ranks[local], paths)
        with self._lock:
            workers = dict(self._workers)
            for local, (pid, _, how) in replaced.items():
                workers[local] = WorkerStatus(local, group.ranks[local], pid, WorkerState.RUNNING)
                logger.info(
                    "attempt %d: rank %d taken over by a %s (pid %d)",
                    group.assignment.attempt, group.ranks[local], how, pid,
                )  # fmt: skip
            self._set(self._state, workers=workers)

    def _make_persister(self, job_id: str) -> DurablePersister | None:
        memory_dir = self._agent_env.get(MEMORY_DIR_ENV)
        settings = DurableSettings.from_config_json(self._agent_env.get(CONFIG_ENV), job_id)
        if not memory_dir or settings is None:
            return None
        return DurablePersister(
            Path(memory_dir), settings, workers_alive=lambda: self._group is not None
        )

    def _check_workers(self) -> None:
        group = self._group
        assert group is not None
        resilient = isinstance(group, ResilientGroup)
        if isinstance(group, ResilientGroup):
            self._took_over(group, group.replace_deadlocked())
            group.missed_barrier()  # kills the late ones; their exits show up below
        exits = group.poll()
        if not exits:
            return
        self._record_exits(exits, stopped=False)
        failed = sorted((group.ranks[local], local) for local, code in exits.items() if code != 0)
        first = failed[0][1] if failed else -1  # the lowest failed rank of this poll
        if resilient and failed and not group.all_exited():
            # The peers keep their processes: the controller restarts in place or stops all.
            assert isinstance(group, ResilientGroup)
            with self._lock:
                workers = dict(self._workers)
                for _, local in failed:
                    if (why := group.missed_reason(local)) is not None:
                        workers[local] = replace(workers[local], error=why)
                self._set(AgentState.FAULTED, workers=workers)
                self._set(AgentState.FAULTED, reason=self._workers[first].describe_exit())
            logger.warning("rank %d exited with %d; its peers wait", failed[0][0], exits[first])
            return
        if failed:
            logger.warning("rank %d exited with %d; stopping its peers", failed[0][0], exits[first])
            self._record_exits(group.close(signal.SIGTERM, self._timings.fault_grace), True)
        if failed or group.all_exited():
            self._finish_attempt()
            with self._lock:
                if failed:
                    reason = self._workers[first].describe_exit()
                    self._set(AgentState.FAULTED, reason=reason)
                else:
                    self._set(AgentState.COMPLETED, reason=None)
            logger.info("attempt %d %s", group.assignment.attempt, self.snapshot().state.value)

    def _stop(self, command: _Stop) -> None:
        with self._lock:
            if not self._matches(command.attempt):
                return  # a late stop for an attempt that is no longer current
            if self._state is not AgentState.STOPPING:
                self._set(AgentState.STOPPING, reason=f"stop requested ({command.mode})")
        logger.info("stopping attempt %s (%s)", self._attempt, command.mode)
        if command.capture_stacks and self._group is not None:
            group = self._group
            pids = {group.ranks[local]: pid for local, pid in group.pids().items()}
            stacks = capture_stacks(pids, self._timings.stack_timeout)
            with self._lock:
                self._stacks = stacks
        if command.mode == "process" or command.timeout <= 0:
            self._end_attempt(signal.SIGKILL, self._timings.reap_timeout)
        else:
            self._end_attempt(signal.SIGTERM, command.timeout)
        with self._lock:
            self._set(AgentState.STOPPED)

    def _shutdown(self, reason: str) -> None:
        logger.info("shutting down: %s", reason)
        if self._pusher is not None:
            self._pusher.stop()
        if self._persister is not None:
            self._persister.close()
        with self._lock:
            if self._state.is_active:
                self._set(AgentState.STOPPING, reason=reason)
        self._end_attempt(signal.SIGKILL, self._timings.reap_timeout)
        with self._lock:
            self._set(AgentState.SHUTDOWN, reason=reason)

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
        with self._lock:
            workers = {
                local: replace(w, error=errors[local]) if local in errors else w
                for local, w in self._workers.items()
            }
            self._set(self._state, workers=workers)

    def _record_exits(self, exits: dict[int, int], stopped: bool) -> None:
        """Record exits; ``stopped``: the agent caused them (a stop or a peer's failure)."""
        for local in exits:
            if self._tailer is not None:
                self._tailer.finish_rank(local)
        with self._lock:
            workers = dict(self._workers)
            for local, code in exits.items():
                if stopped:
                    state = WorkerState.STOPPED  # even if it exited 0 on our SIGTERM
                else:
                    state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
                workers[local] = replace(
                    workers[local], state=state, exitcode=code, signal=signal_name(code)
                )
            self._set(self._state, workers=workers)

    # -- helpers (call with the lock held) --------------------------------------

    def _matches(self, attempt: int | None) -> bool:
        return attempt is None or self._attempt is None or attempt == self._attempt

    def _set(
        self,
        state: AgentState,
        *,
        attempt: int | _Keep | None = _Keep.KEEP,
        reason: str | _Keep | None = _Keep.KEEP,
        workers: dict[int, WorkerStatus] | None = None,
    ) -> None:
        self._state = state
        if not isinstance(attempt, _Keep):
            self._attempt = attempt
        if not isinstance(reason, _Keep):
            self._reason = reason
        if workers is not None:
            self._workers = workers
        self._updated_at = time.time()


def _both(first: LineHook, second: LineHook | None) -> LineHook:
    """One line hook calling two (the monitor, then the agent's own hook if any)."""
    if second is None:
        return first

    def hook(rank: int, stream: str, line: str, t: float) -> None:
        first(rank, stream, line, t)
        second(rank, stream, line, t)

    return hook
