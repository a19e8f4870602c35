"""The copy plan of ``save()``: a state's flattened layout, made once and reused.

:func:`~trainguard.checkpoint.state.flatten` builds a :class:`TensorEntry` per tensor
(its dtype name, shape, 64-byte aligned offset, a DTensor's sharding) and the meta's
JSON of them; :func:`~trainguard.checkpoint.copying.copy_to_host` then makes a view of
the slot per tensor. Done at every save, that cost ~15-40 µs a tensor (2-core VM): for a
small model with its optimizer (hundreds of tensors, a megabyte or two) it was most of
``save()``.

A :class:`CopyPlan` keeps them: the layout, the entries' JSON (encoded once:
:class:`~trainguard.checkpoint.shard.EncodedEntries`), and, per slot buffer, the
destination views. Each save walks the freshly captured state once (:func:`scan`),
which yields its tensors, its tree (with the plain values read now) and a *signature*:
every container's kind and keys (with their types), every tensor's class, dtype,
shape, layout, device and (for a DTensor) sharding, every plain value's type. The plan
is reused only when that signature equals the plan's; anything else (an optimizer's
moments appearing after its first step, a resized tensor, a dtype change, a new key) makes
:func:`plan_for` build a new plan from :func:`flatten`, so no tensor is ever copied by a
stale plan. The signature covers everything the layout depends on; the plain values are
in the tree, which is rebuilt at every save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainguard.checkpoint.shard import EncodedEntries
from trainguard.checkpoint.sharding import is_dtensor, local_tensor, sharding_of
from trainguard.checkpoint.state import PLAIN, Layout, flatten

__all__ = ["CopyPlan", "plan_for", "scan"]


class CopyPlan:
    """The layout of one state structure, its entries' JSON, and the slot views."""

    def __init__(self, layout: Layout, tensors: Sequence[torch.Tensor], signature: list[Any]):
        self.layout = layout
        self.signature = signature
        self.entries_json = EncodedEntries([entry.to_json() for entry in layout.entries])
        self.cuda = any(tensor.is_cuda for tensor in tensors)
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def views(self, slot: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's destination in ``slot``'s ``buffer`` (made once per buffer; a
        slot that was remapped has a new buffer, and gets new views)."""
        held = self._views.get(slot)
        if held is None or held[0] is not buffer:
            self._views[slot] = held = (buffer, [e.view(buffer) for e in self.layout.entries])
        return held[1]


def scan(state: Any) -> tuple[list[Any], list[torch.Tensor], Any]:
    """``state``'s signature, tensors (a DTensor's local tensor) and tree, in one walk.

    The tree is :func:`flatten`'s; a leaf that :func:`flatten` would refuse gets a
    signature no plan has (so :func:`plan_for` calls :func:`flatten`, which raises).
    """
    signature: list[Any] = []
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        kind = type(node)
        if isinstance(node, torch.Tensor):
            sharding, local = None, node
            if is_dtensor(node):
                try:
                    sharding = sharding_of(node, "")
                except TypeError:  # placed otherwise: flatten() names the key
                    signature.append(object())
                    return None
                local = local_tensor(node)
            signature.append((kind, local.dtype, local.shape, local.layout, local.device, sharding))
            tensors.append(local)
            return {"t": len(tensors) - 1}
        if isinstance(node, dict):
            keys = tuple(node)
            signature.append((kind, keys, tuple(map(type, keys))))
            return {"d": [[key, walk(value)] for key, value in node.items()]}
        if isinstance(node, (list, tuple)):
            signature.append((kind, len(node)))
            children = [walk(value) for value in node]
            return {"l": children} if isinstance(node, list) else {"u": children}
        if isinstance(node, PLAIN):
            signature.append(kind)
            return {"v": node}
        signature.append(object())  # equal to nothing: flatten() names the leaf
        return None

    tree = walk(state)
    return signature, tensors, tree


def plan_for(state: Any, plan: CopyPlan | None) -> tuple[CopyPlan, Layout, list[torch.Tensor]]:
    """The plan for ``state`` (``plan`` itself while the structure is unchanged, else a
    new one), the layout of this save (the plan's entries, this state's tree) and the
    tensors to copy, in layout order."""
    signature, tensors, tree = scan(state)
    if plan is not None and signature == plan.signature:
        return plan, Layout(plan.layout.entries, plan.layout.nbytes, tree), tensors
    layout, tensors = flatten(state)
    plan = CopyPlan(layout, tensors, signature)
    return plan, layout, tensors
