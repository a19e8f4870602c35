"""DTensors in a state handed to a peer: sent as their local shards, rebuilt on arrival.

A sharded model's state (``fully_shard``'s, a tensor-parallel one's) holds DTensors. The
state sync (:mod:`trainguard.resilient.sync`) sends plain tensors, so :func:`localise`
replaces each DTensor of a captured state by its local tensor and describes it (its
path, its mesh as an index into :func:`trainguard.resilient.mesh.meshes` and, for a
submesh, its dimension names, its placements, its global shape and stride), and
:func:`globalise` makes the DTensors again on the receiving rank, on its own copy of that
mesh (``DTensor.from_local``, no communication). Sender and receiver hold the same
shard coordinates (the sync only pairs such ranks), so the local tensors fit.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint.state import Path, format_path
from trainguard.resilient import mesh as meshes

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement

_DTENSOR_MODULE = "torch.distributed.tensor"
"""Imported at first use: a state without DTensors never needs it (nor its ~0.3 s)."""

__all__ = ["globalise", "localise"]


def localise(tree: Any) -> tuple[Any, list[dict[str, Any]]]:
    """``tree`` with every DTensor replaced by its local tensor, and their descriptions."""
    described: list[dict[str, Any]] = []
    if _DTENSOR_MODULE not in sys.modules:  # no DTensor was ever made in this process
        return tree, described
    from torch.distributed.tensor import DTensor

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, DTensor):
            described.append(_describe(node, path))
            return node.to_local()
        if isinstance(node, dict):
            return {key: walk(value, (*path, key)) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, (*path, i)) for i, value in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(walk(value, (*path, i)) for i, value in enumerate(node))
        return node

    return walk(tree, ()), described


def globalise(tree: Any, described: list[dict[str, Any]]) -> None:
    """Make the DTensors :func:`localise` described again, in place, in ``tree``."""
    from torch.distributed.tensor import DTensor

    for item in described:
        path = list(item["path"])
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        local: torch.Tensor = parent[path[-1]]
        mesh = meshes.meshes()[int(item["mesh"])]
        if item["dims"] is not None:
            mesh = mesh[tuple(item["dims"])]
        made = DTensor.from_local(
            local,
            mesh,
            [_placement(p) for p in item["placements"]],
            run_check=False,
            shape=torch.Size(item["shape"]),
            stride=tuple(item["stride"]),
        )
        if isinstance(parent, tuple):
            raise TypeError(f"{format_path(tuple(path))}: a DTensor inside a tuple")
        parent[path[-1]] = made


def _describe(tensor: DTensor, path: Path) -> dict[str, Any]:
    mesh = tensor.device_mesh
    index = meshes.mesh_index(mesh)
    if index is None:
        raise TypeError(
            f"{format_path(path)}: a DTensor on a mesh trainguard did not make; make the mesh "
            "with trainguard.resilient.init_device_mesh"
        )
    root = meshes.meshes()[index]
    return {
        "path": list(path),
        "mesh": index,
        "dims": None if mesh is root else list(mesh.mesh_dim_names or ()),
        "placements": [_encode(p) for p in tensor.placements],
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
    }


def _encode(placement: Placement) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return ["strided", placement.dim, placement.split_factor]
    if isinstance(placement, Shard):
        return ["shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["replicate"]
    if isinstance(placement, Partial):
        return ["partial", placement.reduce_op]
    raise TypeError(f"a DTensor placement trainguard cannot send: {placement!r}")


def _placement(encoded: list[Any]) -> Placement:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = encoded[0]
    if kind == "strided":
        return _StridedShard(int(encoded[1]), split_factor=int(encoded[2]))
    if kind == "shard":
        return Shard(int(encoded[1]))
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial(str(encoded[1]))
    raise ValueError(f"unknown DTensor placement {encoded!r}")
