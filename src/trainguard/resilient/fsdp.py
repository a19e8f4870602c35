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
dimension holds copies; every other dimension of every mesh splits the state. Two ranks
whose coordinates agree on every dimension but the replicate ones hold the same local
state.

What this relies on (torch 2.13, checked in its source): ``FSDPState._fsdp_param_groups``,
each group's ``mesh_info``/``post_forward_mesh_info`` and each ``FSDPParam``'s, the mesh
infos' ``__post_init__`` that reads the groups from ``mesh.get_group``, and
``reset_iter_state`` on the root module.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainguard.resilient import mesh as meshes
from trainguard.resilient.protocol import CONTROL_DIR_ENV

if TYPE_CHECKING:  # torch.distributed.fsdp (and its DTensor) are imported at first use:
    # they add ~0.3 s to every resilient worker's start, a DDP one's too
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

__all__ = ["fully_shard", "shard_key"]

_modules: list[FSDPModule] = []


def fully_shard(module: Any, **kwargs: Any) -> Any:
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)``, its groups followed across
    in-process restarts under trainguard (see the module doc)."""
    under_trainguard = bool(os.environ.get(CONTROL_DIR_ENV))
    if under_trainguard:
        given = kwargs.get("mesh")
        if not isinstance(given, DeviceMesh) or meshes.mesh_index(given) is None:
            raise ValueError(
                "trainguard.resilient.fully_shard: pass mesh= a mesh made by "
                "trainguard.resilient.init_device_mesh (its groups are made again after "
                "an in-process restart)"
            )
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    sharded = torch_fully_shard(module, **kwargs)
    if under_trainguard:
        _modules.extend(sharded if isinstance(sharded, list) else [sharded])
        meshes.on_rebind(_rebind)
    return sharded


def shard_key() -> int:
    """This rank's shard coordinates, as one number: equal on two ranks only when they
    hold the same state (0 without a mesh). Every dimension of every mesh made by
    :func:`trainguard.resilient.init_device_mesh` splits the state (a tensor-parallel
    one, an FSDP one), except the replicate dimensions of the HSDP modules sharded here.
    A mesh no DTensor uses makes the ranks look different: they then restore from the
    checkpoint tiers rather than from a peer, never from a peer with other shards."""
    replicated: dict[int, set[int]] = {}  # mesh index -> its root's dims that hold copies
    for info in (i for module in _modules for i in _infos(module)):
        dim = getattr(info, "replicate_mesh_dim", None)
        index = meshes.mesh_index(info.mesh)
        if dim is None or index is None:
            continue
        replicated.setdefault(index, set()).add(_root_dim(info.mesh, meshes.meshes()[index], dim))
    key = 0
    for index, mesh in enumerate(meshes.meshes()):
        coordinates = mesh.get_coordinate() or []
        for dim, coordinate in enumerate(coordinates):
            if dim not in replicated.get(index, set()):
                key = key * mesh.size(dim) + coordinate
    return key


def _root_dim(mesh: DeviceMesh, root: DeviceMesh, dim: int) -> int:
    """Dimension ``dim`` of ``mesh`` (the root or a submesh of it) as one of the root's."""
    if mesh is root:
        return dim
    name = (mesh.mesh_dim_names or ())[dim]
    return (root.mesh_dim_names or ()).index(name)


def _infos(module: nn.Module) -> list[DataParallelMeshInfo]:
    """The mesh infos of ``module``'s FSDP state (its parameter groups' and parameters')."""
    from torch.distributed.fsdp import FSDPModule

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
