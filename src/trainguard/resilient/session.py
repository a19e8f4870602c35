"""``init_process_group``: the line of a torchrun script that makes its group, made resilient.

Plain torchrun (or plain ``python``: a one-rank group) makes the ``env://`` group, as
``torch.distributed.init_process_group`` does. Under trainguard's in-process restarts
(``TRAINGUARD_CONTROL_DIR``) it starts this worker's :class:`ResilientSupervisor`: a hot spare
waits here until it takes over a rank; every worker then joins its first attempt's group,
so the code after this line (the model, the optimizer, ``dist.get_rank()``) runs as under
torchrun. The training loop, :func:`trainguard.resilient.loop`, runs in that attempt and
in each next one after a fault.

A spare runs the code between this line and the loop while the others are in the loop:
that code must not use a collective (a ``dist.barrier()``, a checkpoint load: the loop
restores from the checkpoint tiers itself), and a
:class:`trainguard.resilient.DistributedDataParallel` makes its DDP inside the loop.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from trainguard.collectives import BackendChoice, backend_string, resolve_choice
from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.protocol import CONTROL_DIR_ENV
from trainguard.resilient.spare_init import mark_spare
from trainguard.resilient.supervisor import ResilientSupervisor

__all__ = ["current", "init_process_group", "plain_group"]

_session: list[ResilientSupervisor] = []  # the process's one ResilientSupervisor, once started


def init_process_group(
    backend: str | None = None, *, config: ResilientConfig | None = None
) -> None:
    """Make the process group, as ``torch.distributed.init_process_group(backend)`` does,
    in the first attempt of a resilient worker under trainguard (see the module doc).

    ``backend``: ``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl`` or None (trainguard's choice:
    :mod:`trainguard.collectives`); ``config``'s backend wins over it when it names one.
    """
    settings = config or ResilientConfig()
    if settings.backend is None and backend is not None:
        settings = replace(settings, backend=_choice(backend))
    control_dir = os.environ.get(CONTROL_DIR_ENV)
    if not control_dir:
        plain_group(settings)
        return
    if _session:
        raise RuntimeError("trainguard.resilient.init_process_group() was called already")
    supervisor = ResilientSupervisor(Path(control_dir), settings)
    supervisor.start()
    _session.append(supervisor)
    if supervisor.spare:
        mark_spare()


def current() -> ResilientSupervisor | None:
    """The ResilientSupervisor :func:`init_process_group` started in this process, if any."""
    return _session[0] if _session else None


def plain_group(config: ResilientConfig) -> bool:
    """Without trainguard: the ``env://`` group (a one-rank group without torchrun's
    environment), unless one is up already; returns whether it made one."""
    if dist.is_initialized():
        return False
    backend = backend_string(resolve_choice(config.backend))
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _choice(backend: str) -> BackendChoice:
    """torch's backend name as trainguard's choice; ValueError for one it does not make."""
    name = backend.strip().lower()
    if name == "cpu:gloo,cuda:nccl":
        return "auto"
    return resolve_choice(name)
