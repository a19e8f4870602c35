"""Elastic training in a torchrun script, in a few lines.

When the controller scales the job (capacity lost or back), every rank sees
`scale_requested` return True at the same step; the script saves a checkpoint (with
the ``Checkpointer`` or DCP) and returns, and the job restarts at the new world size::

    from trainguard.elastic import batch_split, scale_requested, shard_indices

    split = batch_split(GLOBAL_BATCH, world_size, max_per_rank=16)
    shard = shard_indices(len(dataset), state["consumed"], rank, world_size, split.per_rank)
    micro_batches = iter(shard)
    for done in range(1, len(shard) // split.accumulation_steps + 1):
        for _ in range(split.accumulation_steps):
            forward_backward(next(micro_batches))
        optimizer.step()
        state["consumed"] = shard.consumed_after(done * split.accumulation_steps)
        if scale_requested():
            save(state)
            return

- `scale_requested` (alias `elastic_event_detected`, HyperPod's name): the request
  arrives as SIGUSR1 or as the file named by ``TRAINGUARD_ELASTIC_FILE``; the ranks
  agree with an all-reduce MAX (see `trainguard.elastic.request`).
- `batch_split`: the per-rank batch and accumulation steps that keep the global batch;
  the learning rate is kept.
- `shard_indices`: the rest of the epoch dealt over the new world, each sample once.

Importing this package does not import torch.
"""

from trainguard.elastic.batch import BatchSplit, batch_split
from trainguard.elastic.data import EpochShard, epoch_order, shard_indices
from trainguard.elastic.request import (
    ELASTIC_FILE_ENV,
    FILE_CHECK_INTERVAL,
    SCALE_SIGNAL,
    clear_scale_request,
    elastic_event_detected,
    handles_scale_signal,
    scale_requested,
)

__all__ = [
    "ELASTIC_FILE_ENV",
    "FILE_CHECK_INTERVAL",
    "SCALE_SIGNAL",
    "BatchSplit",
    "EpochShard",
    "batch_split",
    "clear_scale_request",
    "elastic_event_detected",
    "epoch_order",
    "handles_scale_signal",
    "scale_requested",
    "shard_indices",
]
