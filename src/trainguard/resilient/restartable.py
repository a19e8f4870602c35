"""``@restartable``: re-run a training function in the same process after a fault.

Under trainguard (``TRAINGUARD_CONTROL_DIR`` set) the wrapper joins the attempt in
``attempt.json`` (see :mod:`trainguard.resilient.protocol`), brings every rank to the
same state (:mod:`trainguard.resilient.sync`), acknowledges, and calls the function.
When a collective fails (a peer died) or the agent announces a newer attempt, it drops
the process group, waits for the newer attempt and calls the function again, with the
model, optimizer and data still in memory (:mod:`trainguard.resilient.supervisor`). Any
other exception is re-raised. A worker that cannot join an attempt in time exits with
``EXIT_BARRIER_TIMEOUT``, and so does a rank 0 that cannot host the attempt's rendezvous
store (its port is taken). After :func:`trainguard.resilient.init_process_group` the
wrapper runs in the attempt that call joined, and leaves its group to the script.

Without ``TRAINGUARD_CONTROL_DIR`` (plain torchrun, or plain ``python``) the function
runs once on an ``env://`` process group (a one-rank group without torchrun's env).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from trainguard.resilient import session
from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.group import end_default_group
from trainguard.resilient.protocol import ATTEMPT_ENV, CONTROL_DIR_ENV
from trainguard.resilient.run import Fallback, Run, StateProgress, TrainFunction
from trainguard.resilient.state import State
from trainguard.resilient.supervisor import ResilientSupervisor
from trainguard.resilient.sync import synchronise

__all__ = ["Fallback", "TrainFunction", "restartable", "run_resilient"]


def restartable(
    state: State,
    fallback: Fallback | None = None,
    *,
    config: ResilientConfig | None = None,
) -> Callable[[TrainFunction], Callable[[], None]]:
    """Make ``train(run)`` survive faults of other ranks without leaving the process.

    ``state`` holds everything a rank hands to a peer that lacks it (model, optimizer,
    data position): a :class:`~trainguard.resilient.TrainState`, any object with
    ``state_dict()``/``load_state_dict()``, or a dict of them (as a checkpoint state).
    ``fallback()`` runs on every rank when no rank has state (a fresh start, a full
    restart): it restores ``state`` from a checkpoint and returns the number of completed
    steps it holds, or None to start at step 0. The decorated function takes no arguments.
    """
    settings = config or ResilientConfig()

    def decorate(train: TrainFunction) -> Callable[[], None]:
        @functools.wraps(train)
        def wrapper() -> None:
            run_resilient(train, state, fallback, settings)

        return wrapper

    return decorate


def run_resilient(
    train: TrainFunction, state: State, fallback: Fallback | None, config: ResilientConfig
) -> None:
    """Run ``train`` across attempts under trainguard, once without it (see the module doc)."""
    started = session.current()
    if started is not None:  # init_process_group() joined the first attempt
        try:
            started.run(train, state, fallback)
        finally:
            started.stop_watching()
        return
    control_dir = os.environ.get(CONTROL_DIR_ENV)
    if not control_dir:
        _run_once(train, state, fallback, config)
        return
    if dist.is_initialized():
        raise RuntimeError(
            "under trainguard's in-process restarts the process groups are trainguard's: "
            "call trainguard.resilient.init_process_group() in place of "
            "torch.distributed.init_process_group()"
        )
    supervisor = ResilientSupervisor(Path(control_dir), config)
    supervisor.start()
    try:
        supervisor.run(train, state, fallback)
    except BaseException:
        supervisor.stop_watching()
        raise
    supervisor.leave()


def _run_once(
    train: TrainFunction, state: State, fallback: Fallback | None, config: ResilientConfig
) -> None:
    """Plain torchrun: one attempt on the ``env://`` group, no restarts."""
    owns_group = session.plain_group(config)
    progress = StateProgress()
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
