"""Sharded tensors (DTensor) in a checkpoint: each rank's local shard and where it lies.

A DTensor (FSDP2's ``fully_shard``, HSDP on a 2-D mesh, tensor parallelism's
``parallelize_module``) is saved as its local tensor's bytes, and its entry's JSON meta
records where that shard lies in the whole tensor (:func:`sharding_of`)::

    {"global_shape": [8, 4], "offsets": [4, 0],
     "mesh": {"shape": [2, 2], "dim_names": ["replicate", "shard"]},
     "placements": ["replicate", "shard(0)"]}

A shard is a *box* of the global tensor: its offsets and its local shape
(torch's ``compute_local_shape_and_global_offset``). Restoring copies into a target's
local tensor every region where a saved box overlaps the target's box
(:func:`plan_copy`): the target's own saved shard when the layout is unchanged (one
whole copy), the overlapping shards of any saved ranks when the mesh or the world size
changed (resharding). Replicated shards hold the same box; one of them is used. Only
``Shard(dim)`` and ``Replicate()`` placements are supported (a ``Partial`` value is not a
state; ``_StridedShard``, FSDP2 over TP, is not a box).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "Box",
    "NotCovered",
    "Source",
    "StateMismatch",
    "box_of_entry",
    "box_of_target",
    "dtype_name",
    "init_optimizer_state",
    "is_dtensor",
    "local_tensor",
    "plan_copy",
    "sharding_of",
]


class StateMismatch(ValueError):
    """A checkpoint does not fit the state it is restored into (names the key)."""


class NotCovered(ValueError):
    """The shards at hand do not cover a target's local shard (other ranks' are needed)."""


@dataclass(frozen=True)
class Box:
    """A region of a tensor: its start in every dimension and its shape."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def overlap(self, other: Box) -> Box | None:
        """The region both boxes hold (in global coordinates); None if empty."""
        starts = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        ends = [
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.shape, other.offsets, other.shape, strict=True)
        ]
        if any(end <= start for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(tuple(starts), tuple(e - s for s, e in zip(starts, ends, strict=True)))

    def within(self, region: Box) -> tuple[slice, ...]:
        """``region`` (inside this box) as slices of this box's local tensor."""
        return tuple(
            slice(r - o, r - o + n)
            for o, r, n in zip(self.offsets, region.offsets, region.shape, strict=True)
        )


Source = tuple[Any, torch.Tensor]
"""A saved tensor: its entry (a :class:`~trainguard.checkpoint.state.TensorEntry`) and
the flat uint8 buffer its bytes are in."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor. torch.distributed.tensor is not imported for it
    (a second or so of every worker's start): no DTensor exists until it is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise), sharing its storage."""
    if is_dtensor(value):
        with torch.no_grad():  # to_local() then returns the local tensor itself
            local: torch.Tensor = cast(Any, value).to_local()
            return local
    return value


def _placement_name(placement: object, where: str) -> str:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, Replicate):
        return "replicate"
    if isinstance(placement, Shard) and not isinstance(placement, _StridedShard):
        return f"shard({placement.dim})"
    raise TypeError(
        f"{where}: a DTensor placed as {placement!r} cannot be checkpointed "
        "(only Shard(dim) and Replicate() placements)"
    )


def sharding_of(value: DTensor, where: str) -> dict[str, Any]:
    """The JSON record of where ``value``'s local shard lies (see the module doc)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    placements = [_placement_name(p, where) for p in value.placements]
    _, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    names = mesh.mesh_dim_names
    return {
        "global_shape": list(value.shape),
        "offsets": [int(n) for n in offsets],
        "mesh": {"shape": list(mesh.shape), "dim_names": list(names) if names else None},
        "placements": placements,
    }


def box_of_target(target: torch.Tensor) -> tuple[Box, tuple[int, ...]]:
    """The box a target's local tensor holds, and the global shape."""
    shape = tuple(int(n) for n in target.shape)
    if is_dtensor(target):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        assert isinstance(target, sys.modules["torch.distributed.tensor"].DTensor)
        local, offsets = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        return Box(tuple(int(n) for n in offsets), tuple(int(n) for n in local)), shape
    return Box((0,) * len(shape), shape), shape


def box_of_entry(entry: Any) -> tuple[Box, tuple[int, ...]]:
    """The box a saved entry holds (the whole tensor for a plain one), and the global shape."""
    sharding = entry.sharding
    if sharding is None:
        return Box((0,) * len(entry.shape), tuple(entry.shape)), tuple(entry.shape)
    return Box(tuple(sharding["offsets"]), tuple(entry.shape)), tuple(sharding["global_shape"])


def plan_copy(
    target: torch.Tensor,
    sources: Sequence[Source],
    where: str,
    non_blocking: bool = False,
) -> Callable[[], None]:
    """The copy that fills ``target``'s local tensor from the overlapping ``sources``.

    Raises :class:`StateMismatch` (dtype, global shape) or
    :class:`NotCovered` when the sources leave part of the local shard unfilled.
    """
    box, global_shape = box_of_target(target)
    dtype = dtype_name(target.dtype)
    regions: list[tuple[Box, Any, torch.Tensor, Box]] = []
    seen: set[Box] = set()
    for entry, buffer in sources:
        saved, saved_shape = box_of_entry(entry)
        if saved_shape != global_shape or entry.dtype != dtype:
            raise StateMismatch(
                f"{where}: checkpoint has {entry.dtype}{list(saved_shape)}, "
                f"state has {dtype}{list(global_shape)}"
            )
        if saved in seen:  # a replica of a box already used
            continue
        seen.add(saved)
        region = box.overlap(saved)
        if region is not None:
            regions.append((region, entry, buffer, saved))
    if sum(region.numel for region, *_ in regions) != box.numel:
        raise NotCovered(f"{where}: the shards at hand do not cover this rank's part")

    def copy() -> None:
        local = local_tensor(target)
        for region, entry, buffer, saved in regions:
            part = entry.view(buffer)[saved.within(region)]
            local[box.within(region)].copy_(part, non_blocking=non_blocking)

    return copy


def init_optimizer_state(value: object) -> None:
    """Give an optimizer of DTensor parameters its state (moments) before a restore.

    A fresh optimizer has none, and a DTensor moment cannot be made from saved bytes
    without its parameter's mesh: torch's ``_init_optim_state`` (what
    ``get_optimizer_state_dict`` uses) takes one step with zero gradients and a zero
    learning rate, so that the restore copies into moments laid out like their parameters.
    """
    if not isinstance(value, torch.optim.Optimizer) or value.state:
        return
    params = [p for group in value.param_groups for p in group["params"]]
    if any(is_dtensor(p) for p in params):
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(value)
