"""Checkpointless recovery inside the worker: in-process restart, hot spares, peer state.

A torchrun script changes three places (:mod:`trainguard.resilient.loop`)::

    import trainguard.resilient as resilient

    resilient.init_process_group("gloo")            # was dist.init_process_group("gloo")
    ddp = resilient.DistributedDataParallel(model)  # made again on each attempt's group

    def train_step(step: int) -> None:              # was the body of the training loop
        ...  # forward, backward (gradient all_reduce), optimizer.step()

    resilient.loop(train_step, range(1, steps + 1), {"model": model, "optim": optimizer})

A sharded model (FSDP2, HSDP) also takes trainguard's ``init_device_mesh`` and
``fully_shard``, made again on each attempt's groups (:mod:`trainguard.resilient.mesh`,
:mod:`trainguard.resilient.fsdp`); a replaced rank takes its shards from a rank holding
the same ones, else every rank rolls back to the checkpoint tiers::

    mesh = resilient.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    resilient.fully_shard(model, mesh=mesh)

The lower-level form wraps a function of the attempt (:mod:`trainguard.resilient.restartable`)::

    state = resilient.TrainState(model=model, optimizer=optimizer)

    @resilient.restartable(state, fallback=lambda: checkpointer.load_latest(state))
    def train(run: resilient.Run) -> None:
        for step in range(run.start_step, total_steps):
            ...  # forward, backward (gradient all_reduce), optimizer.step()
            run.completed(step)

    train()

See :mod:`trainguard.resilient.protocol` for the files the node agent and the workers
exchange, and :mod:`trainguard.resilient.supervisor` for what happens on a fault.
"""

from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.ddp import DistributedDataParallel
from trainguard.resilient.fsdp import fully_shard
from trainguard.resilient.group import AttemptInterrupted, is_collective_failure
from trainguard.resilient.loop import StepFunction, loop
from trainguard.resilient.mesh import init_device_mesh
from trainguard.resilient.protocol import EXIT_BARRIER_TIMEOUT, StateSource
from trainguard.resilient.restartable import Fallback, TrainFunction, restartable
from trainguard.resilient.run import Run
from trainguard.resilient.session import init_process_group
from trainguard.resilient.state import State, Stateful, TrainState

__all__ = [
    "EXIT_BARRIER_TIMEOUT",
    "AttemptInterrupted",
    "DistributedDataParallel",
    "Fallback",
    "ResilientConfig",
    "Run",
    "State",
    "StateSource",
    "Stateful",
    "StepFunction",
    "TrainFunction",
    "TrainState",
    "fully_shard",
    "init_device_mesh",
    "init_process_group",
    "is_collective_failure",
    "loop",
    "restartable",
]
