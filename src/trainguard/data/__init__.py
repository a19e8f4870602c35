"""A restart-proof data cache: a rank's batches by step, from a per-node memory-mapped
cache in ``/dev/shm`` that outlives the worker processes.

::

    from trainguard.data import DataCache

    data = DataCache(dataset, global_batch=64, shuffle=True)
    for step in range(start, steps):
        x, y = data.batch(step)      # this rank's rows of global batch `step`

See `trainguard.data.cache` (the API), `trainguard.data.reader` (the node's one reader),
`trainguard.data.slots` (the slot format) and docs/data.md.
"""

from trainguard.data.cache import DataCache

__all__ = ["DataCache"]
