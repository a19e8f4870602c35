"""Tiered checkpoints: node memory that survives a crashed worker, durable storage behind it.

::

    from trainguard.checkpoint import Checkpointer, RNGState

    state = {"model": model, "optim": optimizer, "rng": RNGState()}  # objects, read at save()
    ckpt = Checkpointer()              # from the job's env under trainguard; kwargs override
    step = ckpt.load_latest(state)     # restores model, optimizer, RNG; None if no checkpoint
    for step in range((step or 0) + 1, steps + 1):
        ...
        ckpt.save(step, state)         # returns after the copy into memory (a memcpy)
    ckpt.close()                       # waits for the background work, then stops it

``Checkpointer(...)`` keyword arguments (all optional; None: from the environment, see
:mod:`trainguard.checkpoint.config`): ``memory_every_steps`` (1), ``memory_keep`` (2),
``memory_dir``, ``durable_url`` (None: no durable tier; ``""`` turns an inherited one
off), ``durable_every_steps``, ``durable_every_seconds``, ``durable_keep`` (3),
``storage_options``, ``job_id``, ``rank``, ``world_size``, ``commit_timeout`` (60 s).

- ``save(step, state, force=False) -> bool``: snapshots when ``step`` is a multiple of
  ``memory_every_steps`` (or ``force``). Returns whether it saved. Under trainguard the
  node agents persist to the durable tier the steps the controller picks (see
  :mod:`trainguard.agent.persist`); ``force`` flags the step for them. Outside
  trainguard (``durable_writer`` "worker", the default) this rank's background thread
  persists when ``durable_every_steps`` divides ``step``, when a
  ``durable_every_seconds`` wall-clock period began since the last durable write, or on
  ``force``; with a durable URL and neither cadence, every snapshot is persisted.
- ``wait(timeout=None)``: blocks until the checksums, durable writes and (rank 0)
  durable commits of saved steps are done; ``TimeoutError`` after ``timeout``.
- Background failures are logged and raised as ``CheckpointError`` from the next
  ``save()`` or ``wait()``.
- ``load_latest(state) -> int | None``; ``last_restore`` then holds
  ``Restore(step, tier, seconds)``. Rank 0 prints ``Restored step N from memory in S s``.
- ``close(timeout=None)``; also a context manager.

**State.** Nested dicts (``str``/``int`` keys), lists and tuples of dense tensors, plain
values (``int``, ``float``, ``str``, ``bool``, ``None``) and objects with ``state_dict()`` and
``load_state_dict()`` (torch DCP's ``Stateful``: a model, an optimizer, a scheduler,
:class:`RNGState`); anything else raises ``TypeError`` naming the key path. Each object is
read through ``state_dict()`` at every ``save()``, so pass the objects, not their state
dicts: a state dict captured once goes stale (an Adam's has no moments before its first
step), and nothing can tell it from a right one. Tuples stay tuples. Tensors are stored as
raw bytes with dtype and shape, plain values as JSON: nothing is ever unpickled. A
DTensor (FSDP2, HSDP, tensor parallel) is saved as its rank's local shard, with where it
lies in the whole tensor; it is restored into the same layout or resharded into another
mesh or world size (:mod:`trainguard.checkpoint.sharding`, :mod:`.gather`).

**Restore** is in place: each tensor is ``copy_``-ed into the state's tensor (an object's
into what its ``state_dict()`` returns at the restore: a model's parameters directly), plain
values and tuples are put into their containers, and entries the state lacks (e.g. a fresh
optimizer's empty ``state``) are added as new tensors; then each object gets its part
through ``load_state_dict()``. Every mismatch (shape, dtype, structure) is detected before
anything changes and raised as ``StateMismatch`` naming the key.

**Tiers.** The memory tier (:mod:`trainguard.checkpoint.memory`) keeps ``memory_keep``
pre-faulted slots per rank in ``/dev/shm`` (the agent's directory under trainguard);
``save()`` costs one copy into them. The durable tier
(:mod:`trainguard.checkpoint.durable`) is written from those slots in the background.

**Consistency.** A step is restored only if every rank can load its shard of it (the
ranks agree on the newest such step, :mod:`trainguard.checkpoint.agreement`), and each
shard is checked (format, job id, world size, rank, step, size, checksum) before
anything is restored; a corrupt, foreign or missing shard is logged, skipped, and an
older step is used. Durable shards always carry an xxh3-128 checksum and count only in
a step with a commit marker. A memory shard may be restored before its background
checksum was written (a worker killed right after ``save()`` returned): its meta is
only written after the copy finished, and removed before its slot is overwritten, so
it always names complete data; see :mod:`trainguard.checkpoint.memory`.

Not implemented yet: peer replicas (``replicas`` is accepted and ignored).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.checkpoint.checkpointer import Checkpointer, CheckpointError, Restore
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.ranked import RankedCheckpointer
    from trainguard.checkpoint.rng import RNGState
    from trainguard.checkpoint.shard import ShardInvalid
    from trainguard.checkpoint.state import StateMismatch
    from trainguard.checkpoint.stateful import Stateful

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "RNGState",
    "RankedCheckpointer",
    "Restore",
    "ShardInvalid",
    "StateMismatch",
    "Stateful",
]

# Imported on first use: the node agent reads this package's torch-free modules
# (files, durable) without importing torch.
_HOME = {
    "Checkpointer": "checkpointer",
    "CheckpointError": "checkpointer",
    "Restore": "checkpointer",
    "CheckpointConfig": "config",
    "RankedCheckpointer": "ranked",
    "RNGState": "rng",
    "ShardInvalid": "shard",
    "StateMismatch": "state",
    "Stateful": "stateful",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
