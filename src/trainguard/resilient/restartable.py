"""``@restartable``: re-run a training function in the same process after a fault.

Under trainguard (``TRAINGUARD_CONTROL_DIR`` set) the wrapper joins the attempt in
``attempt.json`` (see :mod:`trainguard.resilient.protocol`), brings every rank to the
same state (:mod:`trainguard.resilient.sync`), acknowledges, and calls the function.
When a collective fails (a peer died) or the agent announces a newer attempt, it drops
the process group, waits for the newer attempt and calls the function again, with the
model, optimizer and data still in memory. Any other exception is re-raised. A worker
that cannot join an attempt in time exits with ``EXIT_BARRIER_TIMEOUT``, and so does a
rank 0 that cannot host the attempt's rendezvous store (its port is taken).

Without ``TRAINGUARD_CONTROL_DIR`` (plain torchrun, or plain ``python``) the function
runs once on an ``env://`` process group (a one-rank group without torchrun's env).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from trainguard.collectives import backend_string, resolve_choice
from trainguard.monitor import worker_events
from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.cuda_check import EXIT_CUDA_UNHEALTHY, check_cuda
from trainguard.resilient.group import (
    AttemptGroup,
    AttemptInterrupted,
    BarrierTimeout,
    StoreUnavailable,
    end_default_group,
    is_collective_failure,
)
from trainguard.resilient.identity import Identity, attempt_from_env, resolve_identity
from trainguard.resilient.protocol import (
    ATTEMPT_ENV,
    CONTROL_DIR_ENV,
    EXIT_BARRIER_TIMEOUT,
    Ack,
    Attempt,
    read_attempt,
    write_ack,
)
from trainguard.resilient.run import Progress, Run
from trainguard.resilient.state import Stateful
from trainguard.resilient.sync import synchronise
from trainguard.resilient.watcher import AttemptWatcher

__all__ = ["Fallback", "TrainFunction", "restartable"]

log = logging.getLogger(__name__)

TrainFunction = Callable[[Run], None]
Fallback = Callable[[], int | None]


def restartable(
    state: Stateful,
    fallback: Fallback | None = None,
    *,
    config: ResilientConfig | None = None,
) -> Callable[[TrainFunction], Callable[[], None]]:
    """Make ``train(run)`` survive faults of other ranks without leaving the process.

    ``state`` holds everything a rank hands to a peer that lacks it (model, optimizer,
    data position): a :class:`~trainguard.resilient.TrainState` or any object with
    ``state_dict()``/``load_state_dict()``. ``fallback()`` runs on every rank when no
    rank has state (a fresh start, a full restart): it restores ``state`` from a
    checkpoint and returns the number of completed steps it holds, or None to start at
    step 0. The decorated function takes no arguments.
    """
    settings = config or ResilientConfig()

    def decorate(train: TrainFunction) -> Callable[[], None]:
        @functools.wraps(train)
        def wrapper() -> None:
            control_dir = os.environ.get(CONTROL_DIR_ENV)
            if control_dir:
                _Supervisor(Path(control_dir), train, state, fallback, settings).run()
            else:
                _run_once(train, state, fallback, settings)

        return wrapper

    return decorate


def _run_once(
    train: TrainFunction, state: Stateful, fallback: Fallback | None, config: ResilientConfig
) -> None:
    """Plain torchrun: one attempt on the ``env://`` group, no restarts."""
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = backend_string(resolve_choice(config.backend))
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    progress = Progress()
    source, _ = synchronise(state, progress, fallback)
    train(
        Run(
            rank=dist.get_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=dist.get_world_size(),
            attempt=int(os.environ.get(ATTEMPT_ENV, "0")),
            state_source=source,
            progress=progress,
            interrupted=lambda: False,
        )
    )
    if owns_group:
        end_default_group()


class _Supervisor:
    """Runs the training function once per attempt until it returns."""

    watcher: AttemptWatcher

    def __init__(
        self,
        control_dir: Path,
        train: TrainFunction,
        state: Stateful,
        fallback: Fallback | None,
        config: ResilientConfig,
    ) -> None:
        self.control_dir = control_dir
        self.train = train
        self.state = state
        self.fallback = fallback
        self.config = config
        self.group = AttemptGroup(
            config.join_poll_interval,
            config.collective_timeout,
            backend_string(resolve_choice(config.backend)),
        )
        self.progress = Progress()
        self.rank = -1
        self.local_rank = 0

    def run(self) -> None:
        if not self.control_dir.is_dir():
            raise ValueError(f"{CONTROL_DIR_ENV}={self.control_dir}: not a directory")
        identity = resolve_identity(self.control_dir, self.config.poll_interval)
        self.rank, self.local_rank = identity.rank, identity.local_rank
        if identity.spare_id is not None:
            _say(f"spare {identity.spare_id} takes over rank {identity.rank}")
        self.watcher = AttemptWatcher(self.control_dir, self.config.poll_interval, self.group.abort)
        # What the script built so far (imports, model, data) lives as long as the process:
        # freezing it keeps the collection after each fault (which frees the failed
        # attempt's group and frames) to the attempt's own objects: ~0.1 ms, not ~100 ms.
        gc.collect()
        gc.freeze()
        try:
            self._attempts(identity)
        finally:
            self.watcher.stop()

    def _attempts(self, identity: Identity) -> None:
        last = identity.first_attempt - 1
        wait_deadline = time.monotonic() + self.config.barrier_timeout
        failed_at: float | None = None
        while True:
            attempt = self._await_attempt(last, wait_deadline)
            last = attempt.attempt
            self._take_rank(attempt)
            joined = time.monotonic()
            join_deadline = joined + attempt.barrier_timeout_seconds
            try:
                self.group.join(
                    attempt,
                    self.rank,
                    join_deadline,
                    functools.partial(self.watcher.newer_than, attempt.attempt),
                )
            except AttemptInterrupted:
                self.group.abort()
                wait_deadline = join_deadline
                continue
            except (BarrierTimeout, StoreUnavailable) as exc:
                self.group.abort()
                _give_up(f"rank {self.rank}: {exc}")
            except Exception as exc:
                if not is_collective_failure(exc):
                    raise
                self.group.abort()
                _say(f"joining attempt {attempt.attempt} failed ({_short(exc)}); waiting")
                wait_deadline = join_deadline
                continue
            fault = self._run_until_fault(attempt, joined, failed_at)
            if fault is None:
                self.group.leave()
                return
            failed_at, fault_time, reason = fault
            gc.collect()  # the failed step's frames may keep the old group (or a DDP) alive
            self._exit_if_cuda_broken(attempt.attempt)
            _say(
                f"attempt {attempt.attempt} failed at step {self.progress.steps}: {reason}; "
                "waiting for the next attempt"
            )
            worker_events.emit(
                "InProcessRestart",
                f"rank {self.rank} left attempt {attempt.attempt}: {reason}",
                attempt=attempt.attempt,
                step=self.progress.steps,
                fault_time=fault_time,
            )
            wait_deadline = failed_at + attempt.barrier_timeout_seconds

    def _run_until_fault(
        self, attempt: Attempt, joined: float, failed_at: float | None
    ) -> tuple[float, float, str] | None:
        """Run ``attempt``: None when train() returns, else when (monotonic and wall-clock
        time) and why it failed.

        Re-raises exceptions that are neither a collective failure nor caused by a newer
        attempt (the process exits with the user's error).
        """
        self.watcher.arm(attempt.attempt)
        try:
            self._run_attempt(attempt, joined, failed_at)
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

    def _run_attempt(self, attempt: Attempt, joined: float, failed_at: float | None) -> None:
        source, detail = synchronise(self.state, self.progress, self.fallback)
        seconds = time.monotonic() - joined
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
        since_fault = (
            "" if failed_at is None else f", {time.monotonic() - failed_at:.3f} s after the fault"
        )
        _say(
            f"joined attempt {attempt.attempt} (world {attempt.world_size}) in {seconds:.3f} s"
            f"{since_fault}; state from {detail}"
        )
        worker_events.emit(
            "AttemptJoined",
            f"rank {self.rank} joined attempt {attempt.attempt}; state from {detail}",
            attempt=attempt.attempt,
            step=self.progress.steps,
            state_source=source,
            seconds=seconds,
        )
        self.train(
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

    def _take_rank(self, attempt: Attempt) -> None:
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
        worker_events.emit("CudaUnhealthy", reason, attempt=attempt)
        sys.stdout.flush()
        os._exit(EXIT_CUDA_UNHEALTHY)  # no atexit: CUDA and NCCL teardown can hang

    def _await_attempt(self, last: int, deadline: float) -> Attempt:
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
            if time.monotonic() >= deadline:
                _give_up(f"rank {self.rank}: no attempt after {last} within the barrier timeout")
            time.sleep(self.config.poll_interval)


def _say(message: str) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"[trainguard.resilient] rank {rank}: {message}", file=sys.stderr, flush=True)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


def _give_up(reason: str) -> NoReturn:
    """Exit at once with ``EXIT_BARRIER_TIMEOUT`` (the agent restarts the process)."""
    _say(f"giving up: {reason}; exiting with {EXIT_BARRIER_TIMEOUT}")
    worker_events.emit("BarrierTimeout", reason)
    sys.stdout.flush()
    os._exit(EXIT_BARRIER_TIMEOUT)  # no atexit: gloo teardown can hang with dead peers
