"""The workers of a node whose script adopts :mod:`trainguard.resilient`: in-process restarts.

Unlike :class:`~trainguard.agent.workers.WorkerGroup`, a failed worker does not end the
group. Its peers keep their processes (model, optimizer and data stay in memory) while the
controller decides; :meth:`ResilientGroup.rejoin` then starts the next attempt in place:

1. ``attempt.json`` in the node's control directory names the new attempt (its
   rendezvous and barrier timeout); every live worker aborts its process group and joins
   the new one (see :mod:`trainguard.resilient.protocol`);
2. each dead local rank is taken over by an idle hot spare (``spare-<k>.json``: a process
   already started, torch imported, script loaded, waiting) or, without one, by a new
   process; either takes its state from a healthy peer;
3. a survivor leaves the failed attempt as soon as a collective fails or it sees the
   new ``attempt.json`` (it reports an ``InProcessRestart`` worker event). Survivors can
   deadlock, though: when a rank dies in the middle of a collective, some peers may have
   finished it and moved on to the next one while others wait in it, and a gloo
   collective blocked on a *live* peer never fails (aborting a group does not close its
   sockets while DDP holds it; only the peer's exit does). A survivor that has not left
   within ``leave_timeout`` is therefore killed and replaced like a dead rank, in the
   same attempt; it takes its state from a peer;
4. each worker acknowledges (``ack-rank-<R>.json``) once it has joined and synced. A
   worker that has not within the barrier timeout is killed and reported as having
   missed the barrier, which makes the controller fall back to a process-level restart;
5. once every rank has acknowledged, the node starts new spares for the ones used up
   (each with a fresh spare id), so the next fault finds a warm standby too. They start
   after the barrier, not during the recovery, which their imports would slow down.

Workers are started directly (``subprocess``) through the exec shim, each in its own
process group; their output goes to the same per-attempt files as other workers', and a
spare's to ``attempt-<n>/<node>-spare-<k>/`` (spare ids count per node). Call everything
from the supervisor thread (the workers' parent-death signal is tied to the thread that
forked them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainguard.agent.logs import STREAMS, LogLayout
from trainguard.agent.workers import ERROR_FILE_ENV, read_error_message, shim_args, worker_envs
from trainguard.control.assignment import NodeAssignment
from trainguard.control.policy import BARRIER_MISSED
from trainguard.monitor.worker_events import EVENT_DIR_ENV, read_events
from trainguard.resilient.protocol import (
    ATTEMPT_ENV,
    CONTROL_DIR_ENV,
    SPARE_ID_ENV,
    Attempt,
    SpareAssignment,
    read_ack,
    write_attempt,
    write_spare,
)

logger = logging.getLogger(__name__)

# Set for spares in place of a rank: they learn theirs from spare-<k>.json.
_SPARE_UNSET = ("RANK", "LOCAL_RANK", "ROLE_RANK")
LEAVE_TIMEOUT_SECONDS = 3.0
"""How long a survivor has to leave a failed attempt before it counts as deadlocked."""

Replaced = dict[int, tuple[int, dict[str, Path], str]]
"""Local rank -> (pid, output files, "spare" | "process") of the process that took it over."""


@dataclass
class _Process:
    proc: subprocess.Popen[bytes]
    paths: dict[str, Path]  # stream -> file
    error_file: Path
    files: list[IO[bytes]]


class ResilientGroup:
    """One node's resilient workers across in-process attempts (see the module docstring)."""

    def __init__(
        self,
        assignment: NodeAssignment,
        worker_argv: Sequence[str],
        layout: LogLayout,
        *,
        agent_env: Mapping[str, str],
        cwd: Path | None,
        reap_timeout: float,
        leave_timeout: float = LEAVE_TIMEOUT_SECONDS,
    ) -> None:
        self.assignment = assignment
        self.leave_timeout = leave_timeout
        self.ranks = dict(enumerate(assignment.global_ranks))  # local -> global
        self.control_dir = layout.root / "control" / assignment.node_id
        self._argv = list(worker_argv)
        self._layout = layout
        self._agent_env = dict(agent_env)
        self._cwd = cwd
        self._reap_timeout = reap_timeout
        self._workers: dict[int, _Process] = {}  # local rank -> its current process
        self._spares: dict[int, _Process] = {}  # idle spares by spare id
        self._next_spare = 0  # spare ids are never reused (spare-<k>.json stays behind)
        self._exitcodes: dict[int, int] = {}  # local rank -> exit of its current process
        self._missed: dict[int, str] = {}  # local rank -> why it was killed at the barrier
        self._barrier: tuple[int, float] | None = None  # (attempt, deadline) awaiting acks
        # After a rejoin: (attempt left, deadline, survivors' local ranks) until they left it.
        self._leaving: tuple[int, float, list[int]] | None = None

    # -- the WorkerGroup interface --------------------------------------------------------

    def start(self) -> dict[int, int]:
        """Start every worker and the node's hot spares; returns local rank -> pid."""
        shutil.rmtree(self.control_dir, ignore_errors=True)  # a process-level (re)start
        self.control_dir.mkdir(parents=True)
        a = self.assignment
        write_attempt(self.control_dir, self._attempt_file(a))
        envs = worker_envs(a, self._env(a))
        for local, rank in self.ranks.items():
            self._workers[local] = self._spawn(envs[local], self._layout.rank_dir(a.attempt, rank))
        self._replenish_spares()
        return self.pids()

    def pids(self) -> dict[int, int]:
        return {local: w.proc.pid for local, w in self._workers.items()}

    def poll(self) -> dict[int, int]:
        """Workers that exited since the last call: local rank -> exit code (<0: signal)."""
        new: dict[int, int] = {}
        for local, worker in self._workers.items():
            if local not in self._exitcodes and (code := worker.proc.poll()) is not None:
                self._exitcodes[local] = new[local] = code
        for k, spare in list(self._spares.items()):
            if (code := spare.proc.poll()) is not None:
                logger.warning("hot spare %d exited with %d while idle", k, code)
                self._close_files(spare)
                del self._spares[k]
        return new

    def all_exited(self) -> bool:
        return len(self._exitcodes) == len(self.ranks)

    def close(self, first_signal: signal.Signals, grace: float) -> dict[int, int]:
        """Signal every live worker and spare, SIGKILL after ``grace``; returns worker exits."""
        live = [
            p for p in [*self._workers.values(), *self._spares.values()] if p.proc.poll() is None
        ]
        for p in live:
            _signal_group(p.proc.pid, signal.SIGCONT)
            _signal_group(p.proc.pid, first_signal)
        deadline = time.monotonic() + grace
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.0, deadline - time.monotonic()))
        for p in live:
            if p.proc.poll() is None:
                _signal_group(p.proc.pid, signal.SIGKILL)
            try:
                p.proc.wait(self._reap_timeout)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d survived SIGKILL", p.proc.pid)
        return self.poll()

    def finish(self) -> dict[int, str]:
        """Error messages by local rank (failed workers); kill what the workers left behind."""
        errors = dict(self._missed)
        for local, worker in self._workers.items():
            if self._exitcodes.get(local) and local not in errors:
                message = read_error_message(worker.error_file)
                if message is not None:
                    errors[local] = message
        for p in [*self._workers.values(), *self._spares.values()]:
            _signal_group(p.proc.pid, signal.SIGKILL)
            self._close_files(p)
        return errors

    # -- in-process restarts ------------------------------------------------------------

    @property
    def idle_spares(self) -> int:
        return len(self._spares)

    def dead(self) -> list[int]:
        """Local ranks whose current process has exited."""
        return sorted(self._exitcodes)

    def rejoin(self, assignment: NodeAssignment) -> Replaced:
        """Start ``assignment``'s attempt in place; returns the replaced local ranks."""
        left = self.assignment.attempt
        self.assignment = assignment
        write_attempt(self.control_dir, self._attempt_file(assignment))
        dead = self.dead()
        survivors = [local for local in self.ranks if local not in dead]
        replaced = {local: self._replace(local) for local in dead}
        self._missed.clear()
        now = time.monotonic()
        self._barrier = (assignment.attempt, now + assignment.barrier_timeout)
        self._leaving = (left, now + self.leave_timeout, survivors)
        return replaced

    def replace_deadlocked(self) -> Replaced:
        """Once ``leave_timeout`` has passed since a rejoin: kill the survivors that have
        neither left the failed attempt nor joined the new one, and replace them in place."""
        if self._leaving is None:
            return {}
        left, deadline, survivors = self._leaving
        if time.monotonic() < deadline:
            return {}
        self._leaving = None
        events = self._agent_env.get(EVENT_DIR_ENV)
        gone = {
            e.rank
            for e in (read_events(Path(events)) if events else [])
            if e.kind == "InProcessRestart" and int(e.data.get("attempt", -1)) >= left
        }
        attempt = self.assignment.attempt
        stuck = [
            local
            for local in survivors
            if local not in self._exitcodes
            and self.ranks[local] not in gone
            and not self._acked(self.ranks[local], attempt)
        ]
        replaced: Replaced = {}
        for local in stuck:
            logger.warning(
                "rank %d did not leave attempt %d within %g s (deadlocked in a collective); "
                "replacing it", self.ranks[local], left, self.leave_timeout,
            )  # fmt: skip
            old = self._workers[local].proc
            _signal_group(old.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.wait(self._reap_timeout)
            replaced[local] = self._replace(local)
        return replaced

    def _replace(self, local: int) -> tuple[int, dict[str, Path], str]:
        """Give ``local``'s rank a new process for the current attempt: a spare, else new."""
        assignment, rank = self.assignment, self.ranks[local]
        self._close_files(self._workers[local])
        if self._spares:
            k = min(self._spares)
            worker = self._spares.pop(k)
            write_spare(self.control_dir, k, SpareAssignment(rank, local, assignment.attempt))
            how = "spare"
            logger.info("hot spare %d takes over rank %d", k, rank)
        else:
            env = worker_envs(assignment, self._env(assignment))[local]
            worker = self._spawn(env, self._layout.rank_dir(assignment.attempt, rank))
            how = "process"
        self._workers[local] = worker
        self._exitcodes.pop(local, None)
        return worker.proc.pid, worker.paths, how

    def missed_barrier(self) -> list[int]:
        """Once the barrier timeout has passed: kill the live workers that have not joined
        the current attempt, and return their local ranks (also after they all joined: [])."""
        if self._barrier is None:
            return []
        attempt, deadline = self._barrier
        waiting = [
            local
            for local, rank in self.ranks.items()
            if local not in self._exitcodes and not self._acked(rank, attempt)
        ]
        if not waiting:
            self._barrier = None
            self._replenish_spares()
            return []
        if time.monotonic() < deadline:
            return []
        self._barrier = None
        timeout = self.assignment.barrier_timeout
        for local in waiting:
            self._missed[local] = (
                f"rank {self.ranks[local]} {BARRIER_MISSED} of attempt {attempt} "
                f"within {timeout:g} s"
            )
            _signal_group(self._workers[local].proc.pid, signal.SIGKILL)
        return waiting

    def missed_reason(self, local: int) -> str | None:
        return self._missed.get(local)

    # -- internals ------------------------------------------------------------------------

    def _acked(self, rank: int, attempt: int) -> bool:
        try:
            ack = read_ack(self.control_dir, rank)
        except ValueError:
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

    def _attempt_file(self, a: NodeAssignment) -> Attempt:
        return Attempt(a.attempt, a.master_addr, a.master_port, a.world_size, a.barrier_timeout)

    def _env(self, a: NodeAssignment) -> dict[str, str]:
        return {
            **self._agent_env,
            CONTROL_DIR_ENV: str(self.control_dir),
            ATTEMPT_ENV: str(a.attempt),
        }

    def _spawn(self, env: Mapping[str, str], log_dir: Path) -> _Process:
        log_dir.mkdir(parents=True, exist_ok=True)
        paths = {stream: log_dir / f"{stream}.log" for stream in STREAMS}
        error_file = log_dir / "error.json"
        error_file.unlink(missing_ok=True)
        files: list[IO[bytes]] = [open(paths[s], "ab") for s in STREAMS]  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, *shim_args(os.getpid(), self._argv, self._cwd)],
            env={**os.environ, **env, ERROR_FILE_ENV: str(error_file)},
            stdin=subprocess.DEVNULL,
            stdout=files[0],
            stderr=files[1],
            start_new_session=True,
        )
        return _Process(proc, paths, error_file, files)

    @staticmethod
    def _close_files(p: _Process) -> None:
        for f in p.files:
            f.close()
        p.files.clear()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
