"""Checkpointless recovery inside the worker: in-process restart, hot spares, peer state.

A training script adds a few lines::

    import trainguard.resilient as resilient

    state = resilient.TrainState(model=model, optimizer=optimizer)

    @resilient.restartable(state, fallback=lambda: checkpointer.load_latest(state))
    def train(run: resilient.Run) -> None:
        for step in range(run.start_step, total_steps):
            ...  # forward, backward (gradient all_reduce), optimizer.step()
            run.completed(step)

    train()

See :mod:`trainguard.resilient.protocol` for the files the node agent and the workers
exchange, and :mod:`trainguard.resilient.restartable` for what happens on a fault.
"""

from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.group import AttemptInterrupted, is_collective_failure
from trainguard.resilient.protocol import EXIT_BARRIER_TIMEOUT, StateSource
from trainguard.resilient.restartable import Fallback, TrainFunction, restartable
from trainguard.resilient.run import Run
from trainguard.resilient.state import Stateful, TrainState

__all__ = [
    "EXIT_BARRIER_TIMEOUT",
    "AttemptInterrupted",
    "Fallback",
    "ResilientConfig",
    "Run",
    "StateSource",
    "Stateful",
    "TrainFunction",
    "TrainState",
    "is_collective_failure",
    "restartable",
]
