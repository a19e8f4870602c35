"""The workers of a node whose script adopts :mod:`trainguard.resilient`: in-process restarts.

Like any :class:`~trainguard.agent.workers.WorkerGroup`, a failed worker is reported at
once and its peers keep running while the controller decides. When it decides on an
in-process restart, :meth:`ResilientGroup.rejoin` starts the next attempt in place:

1. ``attempt.json`` in the node's control directory names the new attempt (its
   rendezvous and barrier timeout); every live worker aborts its process group and joins
   the new one (see :mod:`trainguard.wire.control_files`);
2. each dead local rank is taken over by an idle hot spare (``spare-<k>.json``: a process
   already started, torch imported, script loaded, waiting) or, without one, by a new
   process; either takes its state from a healthy peer;
3. each worker acknowledges (``ack-rank-<R>.json``) once it has joined and synced; once
   every rank of the node has, the node starts new spares for the ones used up (each
   with a fresh spare id), so the next fault finds a warm standby too. They start after
   the barrier, not during the recovery, which their imports would slow down.

The controller watches the ranks through :meth:`facts` (which attempt each rank joined,
and which it left): a survivor stuck in the failed attempt is given a new process by
:meth:`replace` on the controller's word; a rank that misses the barrier is the
controller's fault to call. This group decides nothing on a timer.

A spare's output goes to ``attempt-<n>/<node>-spare-<k>/`` (spare ids count per node).
Call everything from the supervisor thread (the workers' parent-death signal is tied to
the thread that forked them).
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from trainguard.agent.workers import WorkerGroup, WorkerProcess, signal_group, worker_envs
from trainguard.control.events import EventKind
from trainguard.wire.control_files import (
    ATTEMPT_ENV,
    CONTROL_DIR_ENV,
    SPARE_ID_ENV,
    ProtocolError,
    ResilientAttempt,
    SpareAssignment,
    read_ack,
    write_attempt,
    write_spare,
)
from trainguard.wire.requests import NodeAssignment
from trainguard.wire.status import WorkerEvent

logger = logging.getLogger(__name__)

# Set for spares in place of a rank: they learn theirs from spare-<k>.json.
_SPARE_UNSET = ("RANK", "LOCAL_RANK", "ROLE_RANK")
LEFT_EVENT = EventKind.IN_PROCESS_RESTART
"""The worker event a resilient worker emits when it leaves a failed attempt."""

Replaced = dict[int, tuple[int, dict[str, Path], str]]
"""Local rank -> (pid, output files, "spare" | "process") of the process that took it over."""


class ResilientGroup(WorkerGroup):
    """One node's resilient workers across in-process attempts (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # WorkerGroup's
        super().__init__(*args, **kwargs)
        self.control_dir = self._layout.root / "control" / self.assignment.node_id
        self._spares: dict[int, WorkerProcess] = {}  # idle spares by spare id
        self._next_spare = 0  # spare ids are never reused (spare-<k>.json stays behind)
        self._replenish_at: int | None = None  # attempt whose acks start new spares

    def start(self) -> dict[int, int]:
        """Start every worker and the node's hot spares; returns local rank -> pid."""
        shutil.rmtree(self.control_dir, ignore_errors=True)  # a process-level (re)start
        self.control_dir.mkdir(parents=True)
        write_attempt(self.control_dir, self._attempt_file(self.assignment))
        pids = super().start()
        self._replenish_spares()
        return pids

    def poll(self) -> dict[int, int]:
        new = super().poll()
        for k, spare in list(self._spares.items()):
            if (code := spare.proc.poll()) is not None:
                logger.warning("hot spare %d exited with %d while idle", k, code)
                spare.close_files()
                del self._spares[k]
        if self._replenish_at is not None and all(
            self._acked(rank, self._replenish_at)
            for local, rank in self.ranks.items()
            if local not in self._exitcodes
        ):
            self._replenish_at = None
            self._replenish_spares()
        return new

    def settling(self) -> bool:
        """Waiting for the ranks' acks to start new spares (files: no exit wakes it)."""
        return self._replenish_at is not None

    # -- in-process restarts ------------------------------------------------------------

    @property
    def idle_spares(self) -> int:
        return len(self._spares)

    def dead(self) -> list[int]:
        """Local ranks whose current process has exited."""
        return sorted(self._exitcodes)

    def rejoin(self, assignment: NodeAssignment) -> Replaced:
        """Start ``assignment``'s attempt in place; returns the replaced local ranks.

        An elastic scaling in place may renumber this node's ranks (the job lost a node
        before this one): the workers learn theirs from ``attempt.json``."""
        self.assignment = assignment
        self.ranks = dict(enumerate(assignment.global_ranks))
        write_attempt(self.control_dir, self._attempt_file(assignment))
        replaced = {local: self._replace(local) for local in self.dead()}
        self._replenish_at = assignment.attempt
        return replaced

    def replace(self, ranks: Sequence[int]) -> Replaced:
        """Kill these global ranks' processes (stuck in a failed attempt) and give each a
        spare or a new process in the current attempt."""
        locals_ = [local for local, rank in self.ranks.items() if rank in ranks]
        replaced: Replaced = {}
        for local in locals_:
            old = self._workers[local].proc
            signal_group(old.pid, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                old.wait(self._reap_timeout)
            replaced[local] = self._replace(local)
        return replaced

    def facts(self, events: Sequence[WorkerEvent]) -> dict[int, tuple[int | None, int | None]]:
        """Global rank -> (the newest attempt it joined, the newest it left), as its
        acknowledgement and ``events`` (its node's worker events) say."""
        left: dict[int, int] = {}
        for e in events:
            attempt = e.data.get("attempt")
            if e.kind == LEFT_EVENT and isinstance(attempt, int):
                left[e.rank] = max(left.get(e.rank, -1), attempt)
        out: dict[int, tuple[int | None, int | None]] = {}
        for rank in self.ranks.values():
            try:
                ack = read_ack(self.control_dir, rank)
            except ProtocolError:
                ack = None
            out[rank] = (ack.attempt if ack is not None else None, left.get(rank))
        return out

    def _replace(self, local: int) -> tuple[int, dict[str, Path], str]:
        """Give ``local``'s rank a new process for the current attempt: a spare, else new."""
        assignment, rank = self.assignment, self.ranks[local]
        self._workers[local].close_files()
        if self._spares:
            k = min(self._spares)
            worker = self._spares.pop(k)
            spare = SpareAssignment(rank=rank, local_rank=local, attempt=assignment.attempt)
            write_spare(self.control_dir, k, spare)
            how = "spare"
            logger.info("hot spare %d takes over rank %d", k, rank)
        else:
            env = worker_envs(assignment, self._env(assignment))[local]
            worker = self._spawn(env, self._layout.rank_dir(assignment.attempt, rank))
            how = "process"
        self._workers[local] = worker
        self._exitcodes.pop(local, None)
        return worker.pid, worker.paths, how

    # -- internals ------------------------------------------------------------------------

    def _processes(self) -> list[WorkerProcess]:
        return [*self._workers.values(), *self._spares.values()]

    def _acked(self, rank: int, attempt: int) -> bool:
        try:
            ack = read_ack(self.control_dir, rank)
        except ProtocolError:
            return False
        return ack is not None and ack.attempt >= attempt

    def _replenish_spares(self) -> None:
        """Start spares until the node has ``hot_spares`` idle ones."""
        a = self.assignment
        while len(self._spares) < a.hot_spares:
            k, self._next_spare = self._next_spare, self._next_spare + 1
            env = worker_envs(a, self._env(a))[0]
            env = {key: v for key, v in env.items() if key not in _SPARE_UNSET}
            env[SPARE_ID_ENV] = str(k)
            log_dir = self._layout.attempt_dir(a.attempt) / f"{a.node_id}-spare-{k}"
            self._spares[k] = self._spawn(env, log_dir)
            if a.attempt > 0:
                logger.info("started hot spare %d (attempt %d)", k, a.attempt)

    @staticmethod
    def _attempt_file(a: NodeAssignment) -> ResilientAttempt:
        return ResilientAttempt(
            attempt=a.attempt,
            master_addr=a.master_addr,
            master_port=a.master_port,
            world_size=a.world_size,
            barrier_timeout_seconds=a.barrier_timeout,
            ranks=tuple(a.global_ranks),
        )

    def _env(self, a: NodeAssignment) -> dict[str, str]:
        return {
            **self._agent_env,
            CONTROL_DIR_ENV: str(self.control_dir),
            ATTEMPT_ENV: str(a.attempt),
        }
