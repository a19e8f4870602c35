"""How the ranks agree on the step to restore.

Each rank offers the steps it can load (its memory shards and the durable tier's
committed steps); the step restored is the newest one *every* rank offers, so a step
with a missing or foreign shard on any rank is never restored. After fetching and
verifying its shard of that step, each rank reports success; if any rank failed (say
a checksum mismatch), every rank drops that step and they agree again.

Without ``torch.distributed`` initialised only a world of one can agree. The collectives
move CPU tensors over gloo (:func:`trainguard.collectives.control_group`), whatever the
training loop's backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from trainguard.collectives import control_group

__all__ = ["agree_on_step", "all_ranks_succeeded", "newest_common_step", "worst_outcome"]


def newest_common_step(offers: Sequence[Iterable[int]]) -> int | None:
    """The newest step in every rank's offer; None if there is none (pure)."""
    common: set[int] | None = None
    for offer in offers:
        steps = {step for step in offer if step >= 0}
        common = steps if common is None else common & steps
    return max(common) if common else None


def _group_size(world_size: int) -> int:
    import torch.distributed as dist

    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"Checkpointer.load_latest: WORLD_SIZE is {world_size}; the ranks must agree on the "
            "step, so call torch.distributed.init_process_group() before load_latest()"
        )
    size = int(dist.get_world_size())
    if size != world_size:
        raise RuntimeError(
            f"Checkpointer.load_latest: the process group has {size} ranks, "
            f"the Checkpointer was configured for world_size {world_size}"
        )
    return size


def agree_on_step(offer: Sequence[int], world_size: int, limit: int) -> int | None:
    """The newest step every rank offers (an all_gather of each rank's newest ``limit``)."""
    newest = sorted(set(offer), reverse=True)[:limit]
    if _group_size(world_size) == 1:
        return newest_common_step([newest])
    import torch.distributed as dist

    mine = torch.full((limit,), -1, dtype=torch.int64)
    if newest:
        mine[: len(newest)] = torch.tensor(newest, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=control_group())
    return newest_common_step([t.tolist() for t in gathered])


def worst_outcome(outcome: int, world_size: int) -> int:
    """The smallest ``outcome`` of every rank (an all_reduce MIN)."""
    if _group_size(world_size) == 1:
        return outcome
    import torch.distributed as dist

    flag = torch.tensor([outcome], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control_group())
    return int(flag.item())


def all_ranks_succeeded(ok: bool, world_size: int) -> bool:
    """Whether ``ok`` holds on every rank."""
    return worst_outcome(1 if ok else 0, world_size) == 1
