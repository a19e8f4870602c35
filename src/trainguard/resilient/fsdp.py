""":func:`fully_shard`: torch's FSDP2, its process groups followed across attempts.

``fully_shard`` keeps its mesh's process groups in each parameter group's mesh info
(``FSDPMeshInfo.shard_process_group``, ``replicate_process_group`` for HSDP), taken from
the mesh when the module is sharded; its parameters are DTensors on that mesh. Sharding a
module twice is refused, and sharding again would lose the optimizer's hold on the
parameters, so nothing is sharded again after a fault: under trainguard's in-process
restarts, once :func:`trainguard.resilient.mesh.rebind` has made the mesh's groups again
on the new attempt's default group, each module sharded here (a) has its per-iteration
state reset (``FSDPModule.reset_iter_state()``: the failed step's all-gathers and
reductions are dropped and its parameters resharded) and (b) has its mesh infos derive
their groups from the mesh again (their ``__post_init__``). The mesh must come from
:func:`trainguard.resilient.init_device_mesh`. Under plain torchrun it is torch's
``fully_shard`` and nothing more.

Which ranks hold the same shards (:func:`shard_key`): an HSDP mesh info's replicate
dimension holds copies; every other dimension splits the state. Two ranks whose
coordinates agree on every dimension but the replicate ones hold the same local state.

What this relies on (torch 2.13, checked in its source): ``FSDPState._fsdp_param_groups``,
each group's ``mesh_info``/``post_forward_mesh_info`` and each ``FSDPParam``'s, the mesh
infos' ``__post_init__`` that reads the groups from ``mesh.get_group``, and
``reset_iter_state`` on the root module.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

from trainguard.resilient import mesh as meshes
from trainguard.resilient.protocol import CONTROL_DIR_ENV

__all__ = ["fully_shard", "shard_key"]

_modules: list[FSDPModule] = []


def fully_shard(module: Any, **kwargs: Any) -> Any:
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)``, its groups followed across
    in-process restarts under trainguard (see the module doc)."""
    sharded = torch_fully_shard(module, **kwargs)
    if os.environ.get(CONTROL_DIR_ENV):
        for made in sharded if isinstance(sharded, list) else [sharded]:
            info = _infos(made)
            unknown = [i.mesh for i in info if meshes.mesh_index(i.mesh) is None]
            if unknown:
                raise ValueError(
                    "trainguard.resilient.fully_shard: the mesh must come from "
                    "trainguard.resilient.init_device_mesh (its groups are made again "
                    "after an in-process restart)"
                )
            _modules.append(made)
        meshes.on_rebind(_rebind)
    return sharded


def shard_key() -> int:
    """This rank's shard coordinates in the modules sharded here, as one number: equal
    on two ranks exactly when they hold the same shards (0 without any)."""
    key = 0
    seen: set[tuple[int, int | None]] = set()
    for info in (i for module in _modules for i in _infos(module)):
        index = meshes.mesh_index(info.mesh)
        assert index is not None
        replicate = getattr(info, "replicate_mesh_dim", None)
        if (index, replicate) in seen:
            continue
        seen.add((index, replicate))
        key = _mixed_radix(key, info.mesh, replicate)
    return key


def _mixed_radix(key: int, mesh: DeviceMesh, replicate: int | None) -> int:
    coordinates = mesh.get_coordinate() or []
    for dim, coordinate in enumerate(coordinates):
        if dim != replicate:
            key = key * mesh.size(dim) + coordinate
    return key


def _infos(module: nn.Module) -> list[DataParallelMeshInfo]:
    """The mesh infos of ``module``'s FSDP state (its parameter groups' and parameters')."""
    assert isinstance(module, FSDPModule)
    found: dict[int, DataParallelMeshInfo] = {}
    for group in module._get_fsdp_state()._fsdp_param_groups:
        candidates = [group.mesh_info, group.post_forward_mesh_info]
        for param in group.fsdp_params:
            candidates += [param.mesh_info, param.post_forward_mesh_info]
        for info in candidates:
            if info is not None:
                found.setdefault(id(info), info)
    return list(found.values())


def _rebind() -> None:
    """After the meshes' groups were made again: reset, then re-read the groups."""
    for module in _modules:
        state = module._get_fsdp_state()
        if state._is_root:
            try:
                module.reset_iter_state()
            except RuntimeError:  # the failed attempt's work raises as it is waited on
                for group in state._fsdp_param_groups:
                    group._all_gather_result = None
                module.reset_iter_state()
        for info in _infos(module):
            info.__post_init__()
