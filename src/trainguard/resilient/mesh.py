""":func:`init_device_mesh`: torch's device mesh, bound again to each attempt's groups.

A ``DeviceMesh`` holds the process groups of its dimensions (by name, resolved through
the mesh's registry and torch's), made when the mesh is made; an in-process restart
aborts them with the attempt's default group. Under trainguard's in-process restarts
(``TRAINGUARD_CONTROL_DIR``) this module keeps every mesh it made, and at the start of
each later attempt, before the state sync, :func:`rebind` makes each mesh's groups again
on the new default group and points the same ``DeviceMesh`` object at them: the DTensors,
``fully_shard`` states and submeshes that hold the mesh keep working. Under plain
torchrun (no trainguard environment) it is torch's ``init_device_mesh`` and nothing more.

What this relies on (torch 2.13, checked in its source):

- ``DeviceMesh._init_process_groups(layout, rank_map, dim_names, backend_override)``
  makes a mesh's groups (``new_group`` per subgroup, the default group itself for a 1-D
  mesh of the whole world on a CPU machine) and returns their names; the mesh keeps them
  in ``_dim_group_names`` and ``_pg_registry``, flattened meshes in the root's
  ``_flatten_mapping``. A submesh (``mesh["dp"]``) copies its root's names and resolves
  them through the root's registry, so it follows the root.
- Aborting the default group resets torch's group counter, so an attempt's groups get
  the same names, in the same order, on every rank: a survivor that rebinds its meshes
  and a replacement that runs the script's ``init_device_mesh`` in the same attempt make
  the same ``new_group`` calls in the same order (the meshes in the order the script made
  them, each root before its flattened meshes). Nothing else may make a group between an
  attempt's start and its state sync (trainguard's control group is the default group
  wherever the CPU backend is gloo).
- The world size and every rank's place in each mesh stay the same across attempts.
- gloo connects a new group's ranks when the group is made: the sockets opened then are
  added to the attempt's (:func:`trainguard.resilient.group.attempt_sockets`), so a
  rank that fails shuts them down too, and a peer blocked on it in a mesh group's
  collective (HSDP's replicate all-reduce) fails at once instead of waiting out the
  collective timeout (seen: such a survivor was replaced as stuck after 3 s).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from trainguard.resilient.group import attempt_sockets
from trainguard.resilient.protocol import CONTROL_DIR_ENV

__all__ = ["init_device_mesh", "mesh_index", "meshes", "on_rebind", "rebind"]


@dataclass
class _Bound:
    """A mesh this module made, and the default group its groups belong to."""

    mesh: DeviceMesh
    world: object


_meshes: list[_Bound] = []
_listeners: list[Callable[[], None]] = []


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: dict[int | str, Any] | None = None,
) -> DeviceMesh:
    """``torch.distributed.device_mesh.init_device_mesh``, its groups made again in each
    attempt under trainguard's in-process restarts (see the module doc)."""
    if backend_override is not None and os.environ.get(CONTROL_DIR_ENV):
        raise ValueError(
            "trainguard.resilient.init_device_mesh: backend_override is not rebound across "
            "in-process restarts; leave it out (the attempt's backend is the job's)"
        )
    with attempt_sockets():
        mesh = torch_init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
    if os.environ.get(CONTROL_DIR_ENV):
        _meshes.append(_Bound(mesh, dist.group.WORLD))
    return mesh


def meshes() -> list[DeviceMesh]:
    """The meshes made under trainguard so far, in the order the script made them."""
    return [bound.mesh for bound in _meshes]


def mesh_index(mesh: DeviceMesh) -> int | None:
    """Where ``mesh`` (or the root of a submesh) is in :func:`meshes`; None if not there."""
    root = mesh._get_root_mesh()
    return next((i for i, bound in enumerate(_meshes) if bound.mesh is root), None)


def on_rebind(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after each :func:`rebind` that made groups (once per listener)."""
    if listener not in _listeners:
        _listeners.append(listener)


def rebind() -> bool:
    """Make the groups of every mesh made in an earlier attempt on the current default
    group (a collective: every rank calls it at the start of an attempt, before anything
    else makes a group); returns whether any mesh changed."""
    world = dist.group.WORLD
    changed = [bound for bound in _meshes if bound.world is not world]
    resized = [b.mesh for b in changed if b.mesh.size() != dist.get_world_size()]
    if resized:  # an elastic scaling in place: the script must make its meshes anew
        raise RuntimeError(
            f"the world size changed to {dist.get_world_size()}, and a device mesh of "
            f"{resized[0].size()} ranks cannot follow it in process; the job restarts the "
            "processes instead"
        )
    for bound in changed:
        with attempt_sockets():
            _make_groups(bound.mesh, bound.mesh)
            for flat in bound.mesh._flatten_mapping.values():
                _make_groups(flat, bound.mesh)
        bound.world = world
    if changed:
        for listener in _listeners:
            listener()
    return bool(changed)


def _make_groups(mesh: DeviceMesh, root: DeviceMesh) -> None:
    """Make ``mesh``'s dimension groups on the current default group, as torch does when
    it makes the mesh, and register them where the mesh looks them up."""
    names = DeviceMesh._init_process_groups(
        mesh._layout, mesh._rank_map, mesh._mesh_dim_names, ((None, None),) * len(mesh._layout)
    )
    mesh._dim_group_names = names
    if mesh is root:
        root._pg_registry = {}
    for name in names:
        root._pg_registry[name] = distributed_c10d._resolve_process_group(name)
