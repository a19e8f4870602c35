"""The attempts of one resilient worker under trainguard: join, run, fail, rejoin.

A :class:`ResilientSupervisor` is made once per process. :meth:`ResilientSupervisor.start`
learns the worker's rank (a hot spare waits here for the rank it takes over) and joins the
first attempt it may; :meth:`ResilientSupervisor.run` then runs a training function in
that attempt and, each time the function fails because of a peer (a collective failure, or
a newer attempt announced), leaves the attempt, joins the next one and calls the function
again, its state synced from a peer (:mod:`trainguard.resilient.sync`). ``@restartable`` does all
three at once and leaves the last attempt's group at the end;
:func:`trainguard.resilient.init_process_group` starts at the script's
``init_process_group`` line, so that the code between it and the training loop runs in
the first attempt's group, and the group stays the script's after the loop.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from trainguard.collectives import backend_string, resolve_choice
from trainguard.control.events import EventKind
from trainguard.monitor import worker_events
from trainguard.resilient import mesh
from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.cuda_check import EXIT_CUDA_UNHEALTHY, check_cuda
from trainguard.resilient.group import (
    AttemptGroup,
    AttemptInterrupted,
    BarrierTimeout,
    StoreUnavailable,
    is_collective_failure,
)
from trainguard.resilient.identity import attempt_from_env, resolve_identity
from trainguard.resilient.protocol import (
    ATTEMPT_ENV,
    CONTROL_DIR_ENV,
    EXIT_BARRIER_TIMEOUT,
    SPARE_ID_ENV,
    Ack,
    ResilientAttempt,
    read_attempt,
    write_ack,
)
from trainguard.resilient.run import Fallback, Run, StateProgress, TrainFunction
from trainguard.resilient.spare_init import warm_up
from trainguard.resilient.state import State
from trainguard.resilient.sync import synchronise
from trainguard.resilient.watcher import AttemptWatcher

__all__ = ["ResilientSupervisor"]


class ResilientSupervisor:
    """One worker's attempts: :meth:`start` joins the first, :meth:`run` runs a training
    function across attempts until it returns (see the module doc)."""

    watcher: AttemptWatcher

    def __init__(self, control_dir: Path, config: ResilientConfig) -> None:
        if not control_dir.is_dir():
            raise ValueError(f"{CONTROL_DIR_ENV}={control_dir}: not a directory")
        self.control_dir = control_dir
        self.config = config
        self.group = AttemptGroup(
            config.join_poll_interval,
            config.collective_timeout,
            backend_string(resolve_choice(config.backend)),
        )
        self.progress = StateProgress()
        self.rank = -1
        self.local_rank = 0
        self.spare = False
        """Whether this worker started as a hot spare (it takes its state from a peer)."""
        self.attempt: ResilientAttempt | None = None
        """The attempt whose process group is up (None before the first join)."""
        self._last = -1  # the newest attempt joined or given up on
        self._wait_deadline = 0.0
        self._joined_at = 0.0
        self._group_seconds = 0.0  # the last join's group.join()
        self._failed_at: float | None = None

    def start(self) -> None:
        """Learn this worker's rank (a hot spare waits for one), then join an attempt."""
        # What the script built so far is frozen before a spare waits, not after it is
        # called in: the first full collection of a process with torch imported takes
        # 0.1-1 s (more in a worker forked from a template: it copies the pages it
        # touches), which was most of a spare's part of the stall. run() freezes again
        # what the script builds after this (a collection of little).
        if os.environ.get(SPARE_ID_ENV) is not None:
            warm_up()  # a spare: what the script imports after the takeover, before it
        gc.collect()
        gc.freeze()
        identity = resolve_identity(self.control_dir, self.config.poll_interval)
        self.rank, self.local_rank = identity.rank, identity.local_rank
        self.spare = identity.spare_id is not None
        if identity.spare_id is not None:
            _say(f"spare {identity.spare_id} takes over rank {identity.rank}")
        self.watcher = AttemptWatcher(self.control_dir, self.config.poll_interval, self.group.abort)
        self._last = identity.first_attempt - 1
        self._wait_deadline = time.monotonic() + self.config.barrier_timeout
        self._join_next()

    def run(self, train: TrainFunction, state: State, fallback: Fallback | None) -> None:
        """Run ``train`` in the current attempt, and again in each next one after a fault,
        until it returns; the last attempt's group stays up."""
        # What the script built so far (imports, model, data) lives as long as the process:
        # freezing it keeps the collection after each fault (which frees the failed
        # attempt's group and frames) to the attempt's own objects: ~0.1 ms, not ~100 ms.
        gc.collect()
        gc.freeze()
        while True:
            assert self.attempt is not None, "start() joins the first attempt"
            attempt = self.attempt
            fault = self._run_until_fault(attempt, train, state, fallback)
            if fault is None:
                return
            self._failed_at, fault_time, reason = fault
            self.attempt = None
            gc.collect()  # the failed step's frames may keep the old group (or a DDP) alive
            self._exit_if_cuda_broken(attempt.attempt)
            _say(
                f"attempt {attempt.attempt} failed at step {self.progress.steps}: {reason}; "
                "waiting for the next attempt"
            )
            worker_events.emit(
                EventKind.IN_PROCESS_RESTART,
                f"rank {self.rank} left attempt {attempt.attempt}: {reason}",
                attempt=attempt.attempt,
                step=self.progress.steps,
                fault_time=fault_time,
            )
            self._wait_deadline = self._failed_at + attempt.barrier_timeout_seconds
            self._join_next()

    def leave(self) -> None:
        """End the last attempt normally (wait for every rank, destroy the group)."""
        self.stop_watching()
        self.group.leave()

    def stop_watching(self) -> None:
        """No newer attempt aborts the current one from now on (its group is the script's)."""
        self.watcher.stop()

    def _join_next(self) -> None:
        """Join the first attempt newer than the last one (waiting for it to be announced)."""
        while True:
            attempt = self._await_attempt(self._last, self._wait_deadline)
            self._last = attempt.attempt
            self._take_rank(attempt)
            self._joined_at = time.monotonic()
            join_deadline = self._joined_at + attempt.barrier_timeout_seconds
            try:
                self.group.join(
                    attempt,
                    self.rank,
                    join_deadline,
                    functools.partial(self.watcher.newer_than, attempt.attempt),
                )
                self._group_seconds = time.monotonic() - self._joined_at
            except AttemptInterrupted:
                self.group.abort()
                self._wait_deadline = join_deadline
                continue
            except (BarrierTimeout, StoreUnavailable) as exc:
                self.group.abort()
                _give_up(f"rank {self.rank}: {exc}")
            except Exception as exc:
                if not is_collective_failure(exc):
                    raise
                self.group.abort()
                _say(f"joining attempt {attempt.attempt} failed ({_short(exc)}); waiting")
                self._wait_deadline = join_deadline
                continue
            self.attempt = attempt
            return

    def _run_until_fault(
        self,
        attempt: ResilientAttempt,
        train: TrainFunction,
        state: State,
        fallback: Fallback | None,
    ) -> tuple[float, float, str] | None:
        """Run ``attempt``: None when train() returns, else when (monotonic and wall-clock
        time) and why it failed.

        Re-raises exceptions that are neither a collective failure nor caused by a newer
        attempt (the process exits with the user's error).
        """
        self.watcher.arm(attempt.attempt)
        try:
            self._run_attempt(attempt, train, state, fallback)
        except Exception as exc:
            failed, failed_wall = time.monotonic(), time.time()
            self.watcher.disarm()
            self.group.abort()
            if is_collective_failure(exc):
                return failed, failed_wall, _short(exc)
            if not self.watcher.newer_than(attempt.attempt):
                raise
            # The watcher dropped the group under the function: whatever it raised then
            # (no default group, say) is not why the attempt ended.
            return failed, failed_wall, "a newer attempt was announced"
        self.watcher.disarm()
        return None

    def _run_attempt(
        self,
        attempt: ResilientAttempt,
        train: TrainFunction,
        state: State,
        fallback: Fallback | None,
    ) -> None:
        synchronising = time.monotonic()
        mesh.rebind()  # the meshes (and fully_shard states) made in an earlier attempt
        source, detail = synchronise(state, self.progress, fallback)
        seconds = time.monotonic() - self._joined_at
        state_seconds = time.monotonic() - synchronising
        write_ack(
            self.control_dir,
            self.rank,
            Ack(
                attempt=attempt.attempt,
                pid=os.getpid(),
                step=self.progress.steps,
                state_source=source,
            ),
        )
        failed_at = self._failed_at
        since_fault = (
            "" if failed_at is None else f", {time.monotonic() - failed_at:.3f} s after the fault"
        )
        # The phases of ``seconds``: the group's join, the script's set-up between it and
        # the loop (a spare builds its model there), the state sync.
        setup = synchronising - self._joined_at - self._group_seconds
        _say(
            f"joined attempt {attempt.attempt} (world {attempt.world_size}) in {seconds:.3f} s"
            f" (group {self._group_seconds:.3f} s, set-up {setup:.3f} s, state "
            f"{state_seconds:.3f} s){since_fault}; state from {detail}"
        )
        worker_events.emit(
            EventKind.ATTEMPT_JOINED,
            f"rank {self.rank} joined attempt {attempt.attempt}; state from {detail}",
            attempt=attempt.attempt,
            step=self.progress.steps,
            state_source=source,
            seconds=seconds,
            # The parts of ``seconds`` (the benchmark's stall breakdown): forming the
            # attempt's group, then getting the state (from memory, a peer, a checkpoint).
            group_seconds=round(self._group_seconds, 6),
            state_seconds=round(state_seconds, 6),
        )
        train(
            Run(
                rank=self.rank,
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                world_size=attempt.world_size,
                attempt=attempt.attempt,
                state_source=source,
                progress=self.progress,
                interrupted=lambda: self.watcher.newer_than(attempt.attempt),
            )
        )

    def _take_rank(self, attempt: ResilientAttempt) -> None:
        """This process's rank in ``attempt``: an elastic scaling in place renumbers the
        ranks after a node that left (the attempt file names each local rank's)."""
        if self.local_rank >= len(attempt.ranks) or attempt.ranks[self.local_rank] == self.rank:
            return
        new = attempt.ranks[self.local_rank]
        _say(f"is rank {new} from attempt {attempt.attempt} (world {attempt.world_size})")
        self.rank = new
        for name in ("RANK", "ROLE_RANK"):
            os.environ[name] = str(new)

    def _exit_if_cuda_broken(self, attempt: int) -> None:
        """A survivor whose CUDA context is broken exits, to be restarted (never rejoins)."""
        problem = check_cuda(self.config.cuda_check_timeout)
        if problem is None:
            return
        reason = f"rank {self.rank} left attempt {attempt} with a broken CUDA context: {problem}"
        _say(f"{reason}; exiting with {EXIT_CUDA_UNHEALTHY} for a process restart")
        worker_events.emit(EventKind.CUDA_UNHEALTHY, reason, attempt=attempt)
        sys.stdout.flush()
        os._exit(EXIT_CUDA_UNHEALTHY)  # no atexit: CUDA and NCCL teardown can hang

    def _await_attempt(self, last: int, deadline: float) -> ResilientAttempt:
        """The first attempt newer than ``last``; gives up at ``deadline``."""
        while True:
            attempt = read_attempt(self.control_dir)
            if attempt is None:
                attempt = attempt_from_env(self.config.barrier_timeout)
            if attempt is not None and attempt.attempt > last:
                for name, value in (
                    ("MASTER_ADDR", attempt.master_addr),
                    ("MASTER_PORT", attempt.master_port),
                    ("WORLD_SIZE", attempt.world_size),
                    (ATTEMPT_ENV, attempt.attempt),
                ):
                    os.environ[name] = str(value)
                return attempt
            left = deadline - time.monotonic()
            if left <= 0:
                _give_up(f"rank {self.rank}: no attempt after {last} within the barrier timeout")
            # The watcher reads attempt.json as it is replaced: wake with it, not a poll later.
            self.watcher.wait_newer_than(last, min(self.config.poll_interval, left))


def _say(message: str) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"[trainguard.resilient] rank {rank}: {message}", file=sys.stderr, flush=True)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


def _give_up(reason: str) -> NoReturn:
    """Exit at once with ``EXIT_BARRIER_TIMEOUT`` (the agent restarts the process)."""
    _say(f"giving up: {reason}; exiting with {EXIT_BARRIER_TIMEOUT}")
    worker_events.emit(EventKind.BARRIER_TIMEOUT, reason)
    sys.stdout.flush()
    os._exit(EXIT_BARRIER_TIMEOUT)  # no atexit: gloo teardown can hang with dead peers
