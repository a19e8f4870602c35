"""The node's status as the agent keeps it: state, workers, and what it saw of them.

One :class:`NodeBoard` per agent, guarded by its ``lock`` (request threads read and check
it, the supervisor thread changes it). Every change bumps ``seq``; a change the
controller did not ask for and must act on (the node turned ``faulted`` or
``completed``) calls ``on_news`` (the reporter's nudge: report first). What the
controller caused itself (a start, a stop) it learns at its next poll: thousands of
agents pushing every acknowledgement would only slow it down. :meth:`NodeBoard.snapshot`
assembles the :class:`~trainguard.wire.status.NodeStatus` the agent serves and pushes
(the workers' heartbeat and event files read again only once they may have changed:
:mod:`trainguard.agent.dircache`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.agent.api import Refused
from trainguard.agent.dircache import DirCache
from trainguard.agent.inprocess import ResilientGroup
from trainguard.monitor.heartbeat import read_heartbeats
from trainguard.monitor.rules import NodeLogMonitor
from trainguard.monitor.worker_events import read_events
from trainguard.platform.procs import cpu_seconds
from trainguard.wire.requests import NodeAssignment, ReplaceRequest
from trainguard.wire.status import (
    CheckpointStatus,
    MonitorSnapshot,
    NodeState,
    NodeStatus,
    WorkerState,
    WorkerStatus,
    signal_name,
)

if TYPE_CHECKING:
    from trainguard.agent.persist import DurablePersister
    from trainguard.agent.workers import WorkerGroup

__all__ = ["NodeBoard", "StartRefused"]


class StartRefused(Refused):
    """A ``/start`` while workers may still be alive (the caller must stop first)."""


class _Keep(Enum):
    """Sentinel: leave this field as it is."""

    KEEP = 0


KEEP = _Keep.KEEP
NEWS = frozenset({NodeState.FAULTED, NodeState.COMPLETED})
"""States the agent reports at once: the controller decides on them."""


class NodeBoard:
    """The node's status (see the module docstring). Change it with ``lock`` held."""

    def __init__(self, node_id: str, incarnation: str = "") -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.lock = threading.Lock()
        self.state = NodeState.READY
        self.attempt: int | None = None
        self.reason: str | None = None
        self.workers: dict[int, WorkerStatus] = {}  # by local rank
        self.stacks: dict[int, str] = {}
        self.ranks: list[int] = []  # the global ranks of the latest attempt on this node
        self.seq = 0
        self.updated_at = time.time()
        self.on_news: Callable[[], None] = lambda: None
        # Detection state of the current (or last) attempt, reported with the status.
        self.monitor: NodeLogMonitor | None = None
        self._heartbeat_dir: Path | None = None
        self._group: WorkerGroup | None = None
        # What the workers left, read again only once it may have changed.
        self._events = DirCache(read_events)
        self._beats = DirCache(read_heartbeats)

    # -- with the lock held ------------------------------------------------------------

    def set(
        self,
        state: NodeState,
        *,
        attempt: int | _Keep | None = KEEP,
        reason: str | _Keep | None = KEEP,
        workers: dict[int, WorkerStatus] | None = None,
    ) -> None:
        news = state is not self.state and state in NEWS
        self.state = state
        if not isinstance(attempt, _Keep):
            self.attempt = attempt
        if not isinstance(reason, _Keep):
            self.reason = reason
        if workers is not None:
            self.workers = workers
        self.changed()
        if news:
            self.on_news()

    def changed(self) -> None:
        """Something the status carries changed: a new ``seq`` (with ``lock`` held)."""
        self.seq += 1
        self.updated_at = time.time()

    def busy(self) -> bool:
        """Workers may be alive: a new attempt must not start."""
        if self.state in (NodeState.STARTING, NodeState.RUNNING, NodeState.STOPPING):
            return True
        return any(w.state is WorkerState.RUNNING for w in self.workers.values())

    def admit_start(self, assignment: NodeAssignment, shutting_down: bool) -> bool:
        """Check a ``/start`` and take it (``starting``); False for a retry of the current
        attempt (nothing to do). :class:`Refused` while workers may be alive."""
        state, attempt = self.state, self.attempt
        if shutting_down or state is NodeState.SHUTDOWN:
            raise StartRefused("agent is shutting down")
        if attempt == assignment.attempt and state is not NodeState.STOPPED:
            return False
        if self.busy():
            raise StartRefused(
                f"attempt {attempt} is {state.value}; stop it before starting "
                f"attempt {assignment.attempt}"
            )
        # Nothing the previous attempt's workers did may be reported as this attempt's.
        self.monitor, self._heartbeat_dir, self._group, self.stacks = None, None, None, {}
        self.set(NodeState.STARTING, attempt=assignment.attempt, reason=None, workers={})
        self.ranks = list(assignment.global_ranks)
        return True

    def admit_rejoin(self, assignment: NodeAssignment, shutting_down: bool) -> bool:
        """Check a ``/rejoin`` and take it (``running`` the new attempt); False for a retry.
        :class:`Refused` unless resilient workers of an older attempt run here."""
        state, attempt = self.state, self.attempt
        if shutting_down or state is NodeState.SHUTDOWN:
            raise Refused("agent is shutting down")
        if attempt == assignment.attempt and state is NodeState.RUNNING:
            return False
        # Starting is fine: the rejoin is carried out after the start (one thread, in order).
        rejoinable = (NodeState.STARTING, NodeState.RUNNING, NodeState.FAULTED)
        if not assignment.in_process or state not in rejoinable:
            raise Refused(
                f"an in-process restart needs running resilient workers; this node is {state.value}"
            )
        if attempt is not None and assignment.attempt <= attempt:
            raise Refused(f"attempt {assignment.attempt} is not after {attempt}")
        self.monitor = None  # the new attempt's comes with the rejoin; none of the old one's
        ranks = assignment.global_ranks  # renumbered by an elastic scaling in place
        workers = {
            local: w.model_copy(update={"rank": ranks[local]}) if local < len(ranks) else w
            for local, w in self.workers.items()
        }
        self.set(NodeState.RUNNING, attempt=assignment.attempt, reason=None, workers=workers)
        self.ranks = list(ranks)
        return True

    def admit_replace(self, request: ReplaceRequest) -> None:
        """Check a ``/replace``: :class:`Refused` unless its attempt runs here and the
        ranks are this node's."""
        if self.attempt != request.attempt or self.state not in (
            NodeState.RUNNING,
            NodeState.FAULTED,
        ):
            raise Refused(
                f"attempt {request.attempt} is not running here "
                f"(attempt {self.attempt}, {self.state.value})"
            )
        foreign = sorted(set(request.ranks) - set(self.ranks))
        if foreign:
            raise Refused(f"ranks {foreign} are not on this node")

    def exited(
        self,
        exits: Mapping[int, int],
        errors: Mapping[int, str | None],
        stopped: bool,
        tracebacks: Mapping[int, str | None] | None = None,
    ) -> None:
        """Workers (by local rank) exited with these codes; ``stopped``: the agent ended
        them (a stop), else they ended on their own. ``errors`` and ``tracebacks``: what
        the failed ones left."""
        workers = dict(self.workers)
        for local, code in exits.items():
            if stopped:
                state = WorkerState.STOPPED  # even if it exited 0 on our SIGTERM
            else:
                state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
            workers[local] = workers[local].model_copy(
                update={
                    "state": state,
                    "exitcode": code,
                    "signal": signal_name(code),
                    "error": errors.get(local),
                    "traceback": (tracebacks or {}).get(local),
                }
            )
        self.set(self.state, workers=workers)

    def errors(self, errors: Mapping[int, str]) -> None:
        """Error messages found once every worker exited, for workers that had none."""
        workers = {
            local: w.model_copy(update={"error": errors[local]})
            if local in errors and w.error is None
            else w
            for local, w in self.workers.items()
        }
        self.set(self.state, workers=workers)

    def took_over(self, pids: Mapping[int, int]) -> None:
        """New processes (local rank -> pid) run these ranks now."""
        workers = dict(self.workers)
        for local, pid in pids.items():
            workers[local] = WorkerStatus(
                local_rank=local, rank=self.ranks[local], pid=pid, state=WorkerState.RUNNING
            )
        self.set(self.state, workers=workers)

    def matches(self, attempt: int | None) -> bool:
        return attempt is None or self.attempt is None or attempt == self.attempt

    def attach(self, monitor: NodeLogMonitor, heartbeat_dir: Path, group: WorkerGroup) -> None:
        """A new attempt's monitor, heartbeat directory and workers."""
        self.monitor, self._heartbeat_dir, self._group = monitor, heartbeat_dir, group
        self.stacks = {}

    # -- from any thread ---------------------------------------------------------------

    def monitor_lines(self, rank: int, stream: str, block: bytes, t: float) -> None:
        """Feed a block of worker lines to the current attempt's monitor (an in-process
        restart replaces the monitor while the workers, and the tailer, go on)."""
        monitor = self.monitor
        if monitor is not None:
            monitor.on_lines(rank, stream, block, t)

    def snapshot(self, persister: DurablePersister | None) -> NodeStatus:
        with self.lock:
            monitor, beats_dir, group = self.monitor, self._heartbeat_dir, self._group
            state, attempt, reason = self.state, self.attempt, self.reason
            seq, updated_at, stacks = self.seq, self.updated_at, dict(self.stacks)
            workers = [self.workers[k] for k in sorted(self.workers)]
        # Outside the lock: the monitor has its own, heartbeats and events are files.
        events = self._events.get(beats_dir.parent / "events") if beats_dir is not None else []
        workers = [_with_cpu(w) for w in workers]
        if isinstance(group, ResilientGroup):
            facts = group.facts(events)
            workers = [
                w.model_copy(update={"joined": facts[w.rank][0], "left": facts[w.rank][1]})
                if w.rank in facts
                else w
                for w in workers
            ]
        return NodeStatus(
            node_id=self.node_id,
            incarnation=self.incarnation,
            pid=os.getpid(),
            seq=seq,
            state=state,
            attempt=attempt,
            reason=reason,
            updated_at=updated_at,
            workers=tuple(workers),
            monitor=monitor.snapshot() if monitor is not None else MonitorSnapshot(),
            heartbeats=self._beats.get(beats_dir) if beats_dir is not None else {},
            stacks=stacks,
            events=tuple(events),
            checkpoint=persister.status() if persister is not None else CheckpointStatus(),
            hot_spares=group.idle_spares if isinstance(group, ResilientGroup) else 0,
        )


def _with_cpu(worker: WorkerStatus) -> WorkerStatus:
    """A running worker's status with its CPU time so far (the controller tells a rank
    that lingers idle after the others exited from one still working)."""
    if worker.state is not WorkerState.RUNNING or worker.pid is None:
        return worker
    used = cpu_seconds(worker.pid)
    return worker if used is None else worker.model_copy(update={"cpu_seconds": used})
